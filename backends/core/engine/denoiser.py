"""The tensor side of the denoiser: per-request state and one batched denoising step.

Each request carries its own diffusers scheduler and CPU generator, so a step can batch
requests that sit at different timesteps: every row gets its own timestep, text embeddings and
time ids, and each request's scheduler steps its own slice. The maths is diffusers'
StableDiffusionXLPipeline.__call__, written out for many requests at once.
"""

from __future__ import annotations

import inspect
import itertools
import json
import time
from concurrent.futures import Future
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from backends.core.engine.config import CONTROLNET_MODES
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.base import LoraSegment, StepBatch, UNetRuntime
from backends.core.runtime.torch_eager import EagerUNetRuntime
from backends.core.adapters.controlnet import ControlInput, PreparedControl, ResidualProvider, prepare_control_image
from backends.core.adapters.lora import LoraMerger, LoraSet, lora_key
from backends.core.request.params import GenerateParams, InvalidInput
from backends.core.runtime.host_copies import to_device
from backends.core.runtime.placement import Placement
from backends.core.runtime.specs import unet_pooled_dim
from backends.core.engine.controls import collect_controls, submit_controls
from backends.core.engine.diffusers_schedulers import SchedulerPrototypes
from backends.core.engine import noise
from backends.core.engine.samplers import SamplerPlan, model_timesteps, scale_model_input, vectorizable
from backends.core.engine.samplers import step as sampler_step
from backends.core.engine.step_stats import DECODED, DECODER, ENCODED, ENCODER, SAMPLED, SAMPLER, StepClock

VAE_SCALE_FACTOR_FILE = "vae_scale_factor.json"
# Tokens of a prompt's embeddings: the text encoder pads every prompt to CLIP's model_max_length.
TEXT_TOKENS = 77


@dataclass
class DenoiseJob:
    """One request as the denoiser receives it (text already encoded, negative rows first)."""

    request_id: str
    params: GenerateParams
    prompt_embeds: np.ndarray  # [rows, tokens, dim]
    pooled_embeds: np.ndarray  # [rows, pooled dim]
    is_cancelled: Callable[[], bool] = lambda: False
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() past which the client no longer waits for it
    controls: list[ControlInput] = field(default_factory=list)
    loras: LoraSet = ()
    # Bounded asynchrony: LoRAs still loading; the request runs without them up to step
    # `lora_bound` and they join at the first step boundary after the load completes.
    loras_pending: Future | None = None
    lora_bound: int = 0
    # Progress (easel_stream): called on the loop thread after each of its steps, so it must only
    # enqueue; the latents come along every `preview_every` steps (0: never).
    on_step: Callable[["StepProgress"], None] | None = None
    preview_every: int = 0


@dataclass(frozen=True)
class StepProgress:
    request_id: str
    step: int  # steps done, 1 to steps
    steps: int
    latents: "LatentSnapshot | None" = None  # when a preview is due at this step


class LatentSnapshot:
    """A request's latents at one step, read later on another thread without a host sync on the
    loop: on a GPU the loop only queues a copy into pinned memory and an event on its stream, and
    `numpy()` waits for that event (not for the steps queued after it). The latents tensor itself
    is never written in place (every step makes a new one), so holding it is a snapshot."""

    def __init__(self, latents: torch.Tensor, stream: torch.cuda.Stream | None):
        self.event = None
        if latents.is_cuda:
            self.host = latents.float().to("cpu", non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        else:
            self.host = latents.detach().float()

    def numpy(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()


_SERIALS = itertools.count()  # a RequestState's serial: unique for the process's lifetime


@dataclass
class RequestState:
    job: DenoiseJob
    scheduler: Any  # with a plan, the prototype all such requests share (read only); else its own
    timesteps: torch.Tensor
    latents: torch.Tensor
    embeds: torch.Tensor
    pooled: torch.Tensor
    time_ids: torch.Tensor
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    controls: list[PreparedControl] = field(default_factory=list)
    index: int = 0
    max_batch: int = 1  # most requests it shared one step with (itself included)
    # Pipelined ControlNets: the calls submitted at the previous step, used at this one.
    stale_controls: list | None = None
    lora_step: int | None = None  # the step from which its LoRAs were applied
    # The vectorized sampler (engine/samplers.py); None: diffusers' own scheduler steps this request.
    plan: SamplerPlan | None = None
    serial: int = field(default_factory=_SERIALS.__next__)  # names its text rows (StepBatch.text_key)
    admit_s: float = 0.0  # start()'s time: its sampler, noise and copies to the device

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]


class TorchDenoiser:
    def __init__(self, folder: str | Path, placement: Placement, controlnets: ResidualProvider | None = None,
                 controlnet_mode: str = "sync", runtime: UNetRuntime | None = None, controlnet_row_split: bool = False):
        """`runtime`: how the UNet runs (backends/core/runtime); default: eager over the folder's halves.
        `controlnet_row_split`: DenoiserConfig.controlnet_row_split."""
        if controlnet_mode not in CONTROLNET_MODES:
            raise ValueError(f"controlnet_mode: {controlnet_mode!r} is not one of {CONTROLNET_MODES}")
        self.controlnet_mode = controlnet_mode
        self.controlnet_row_split = controlnet_row_split
        self.folder = folder = Path(folder)
        self.placement = placement
        self.device = torch.device(placement.device)
        self.dtype = placement.torch_dtype
        # The loop computes on its own non-blocking stream: Triton copies BLS tensors on the
        # default stream, and those copies must not wait behind the UNet (they would serialize
        # the ControlNets with the encoder half they are meant to run beside).
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.runtime = runtime if runtime is not None else EagerUNetRuntime(*load_unet_halves(folder, placement))
        # The loop's stream on each device it computes on (the runtime's own on other devices).
        self.streams = {s.device: s for s in (*self.runtime.streams, self.stream) if s is not None}
        self.unet = self.runtime.weights_module  # its config; LoRA merges write into its weights in place
        self.base_scheduler = _load_scheduler(folder / "scheduler")
        self.schedulers = SchedulerPrototypes(self.base_scheduler, self.device)
        noise.choose(self.dtype)  # its check against torch.randn runs at load, not in a request
        self.vae_scale_factor = json.loads((folder / VAE_SCALE_FACTOR_FILE).read_text())["vae_scale_factor"]
        self.latent_channels = self.unet.config.in_channels
        self.controlnets = controlnets
        # Seconds the decoder half waited for ControlNet residuals, and calls made: the part of
        # the ControlNets not hidden beside the encoder half (exported as metrics).
        self.control_wait_s = 0.0
        self.control_calls = 0
        # LoRAs: merged in place when the whole batch shares one set, else computed unmerged.
        self.lora_merger = LoraMerger(self.runtime.weight_copies)
        self.merged: tuple = ()
        # Times the halves and the sampler of the loop's steps (events on our stream on a GPU).
        self.clock = StepClock(self.stream)

    def on_stream(self):
        """Context for the thread that owns the engine: its work goes to the engine's stream (and,
        on other devices the runtime computes on, to the runtime's streams there).

        Switching streams orders nothing by itself, so each side waits for the other: the engine's
        streams for what the caller queued before entering, the caller's for what the engine
        queued inside. Without the first, a caller that had just queued a step on the runtime's
        graphs saw its output overwritten by the engine's first step, which wrote the same static
        buffers concurrently (bench/micro/fp8_probe.py's 127-131%, bench/results/2026-11-23i-h200)."""
        if self.stream is None:
            return nullcontext()
        stack = ExitStack()
        for stream in (*self.runtime.streams, self.stream):  # ours last: it leaves our device current
            caller = torch.cuda.current_stream(stream.device)
            stream.wait_stream(caller)
            stack.callback(caller.wait_stream, stream)
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    def latent_shape(self, params: GenerateParams) -> tuple[int, int]:
        return params.height // self.vae_scale_factor, params.width // self.vae_scale_factor

    def start(self, job: DenoiseJob) -> RequestState:
        p = job.params
        rows = 2 if p.cfg else 1
        # Checked here, before the request joins a batch: embeddings of another shape would fail
        # the whole batch's step, everyone's (the denoiser can be called directly, with anything).
        cfg = self.unet.config
        pooled_dim = unet_pooled_dim(cfg)
        for name, array, shape in (("prompt_embeds", job.prompt_embeds, (rows, TEXT_TOKENS, cfg.cross_attention_dim)),
                                   ("pooled_embeds", job.pooled_embeds, (rows, pooled_dim))):
            if tuple(array.shape) != shape:
                raise InvalidInput(name, f"has shape {tuple(array.shape)}, expected {shape} for these params")
        self.adopt_loras(job.loras)  # (LoRAs given up front; those still loading are adopted on arrival)
        sched = self.schedulers.shared(p.scheduler, p.steps)
        generator = torch.Generator("cpu").manual_seed(p.seed)
        h, w = self.latent_shape(p)
        latents = noise.randn_like_diffusers((1, self.latent_channels, h, w), generator, self.device, self.dtype)
        latents = latents * sched.init_noise_sigma
        step_kwargs = {}
        if vectorizable(sched):  # the plan reads the shared scheduler; nothing steps it
            plan = SamplerPlan.from_scheduler(sched, p.steps, generator)
        else:  # diffusers steps the request's own copy
            sched, plan = self.schedulers.fresh(p.scheduler, p.steps), None
            accepted = set(inspect.signature(sched.step).parameters)
            if "eta" in accepted:
                step_kwargs["eta"] = 0.0
            if "generator" in accepted:
                step_kwargs["generator"] = generator

        if job.controls and self.controlnets is None:
            raise ValueError("controlnets: this denoiser has no adapter store")
        controls = []
        for i, c in enumerate(job.controls):
            self.controlnets.check(c.name)  # unknown names fail here, before any step
            image = prepare_control_image(c.image, p.width, p.height, self.vae_scale_factor)
            controls.append(PreparedControl(c.name, to_device(torch.cat([image] * rows), self.device).to(self.dtype),
                                            c.scale, c.guidance_start, c.guidance_end, session=f"{job.request_id}/{i}"))

        # Every copy from pinned memory: admitted beside running requests, it must not wait for their steps.
        time_ids = to_device(torch.tensor([[p.height, p.width, 0, 0, p.height, p.width]], dtype=self.dtype
                                          ).repeat(rows, 1), self.device)
        return RequestState(
            job=job, scheduler=sched, timesteps=sched.timesteps, latents=latents,
            embeds=to_device(torch.from_numpy(job.prompt_embeds), self.device).to(self.dtype),
            pooled=to_device(torch.from_numpy(job.pooled_embeds), self.device).to(self.dtype),
            time_ids=time_ids, step_kwargs=step_kwargs, controls=controls, plan=plan)

    @torch.inference_mode()
    def step(self, states: list[RequestState]) -> dict[str, str]:
        """One denoising step for requests of one latent shape, as one UNet batch. Returns the
        requests that failed (id -> why); the others have advanced."""
        vectorized = all(s.plan is not None for s in states)
        sample, timestep = self._model_input(states) if vectorized else self._model_input_per_request(states)
        embeds = torch.cat([s.embeds for s in states])
        rows_per_request = tuple(s.rows for s in states)
        sides = self.runtime.row_sides(rows_per_request) if any(s.controls for s in states) else None
        pending = self._submit_controls(states, sample, timestep, sides)  # run beside the encoder half
        if self.controlnet_mode == "pipelined":
            pending = self._pipeline(states, pending)
        lora_segments = self._loras(states)  # (merges first: the text key names the merged set)
        batch = StepBatch(sample, timestep, embeds, torch.cat([s.pooled for s in states]),
                          torch.cat([s.time_ids for s in states]), lora_segments=lora_segments,
                          text_key=(self.merged, tuple(s.serial for s in states)), rows_per_request=rows_per_request)
        clock = self.clock
        clock.mark(ENCODER)
        enc = self.runtime.encode(batch)
        clock.mark(ENCODED)
        failed: dict[str, str] = {}
        collected = collect_controls(states, pending, sides, self.runtime.side_devices, self._adopt, failed)
        self.control_wait_s += collected.wait_s
        self.control_calls += collected.calls
        residuals = collected.residuals
        clock.mark(DECODER)
        noise = self.runtime.decode(batch, enc, residuals)
        clock.mark(DECODED)

        live = [s for s in states if s.job.request_id not in failed]
        clock.mark(SAMPLER)
        if vectorized and not failed and _same_guidance(states):
            self._advance(states, noise)
        else:
            for s, pred in zip(states, noise.split([s.rows for s in states])):
                if s.job.request_id not in failed:
                    self._advance([s], pred)
        clock.mark(SAMPLED)
        for s in live:
            s.index += 1
            s.max_batch = max(s.max_batch, len(states))
        return failed

    def _model_input(self, states):
        """The UNet's rows for requests stepped by vectorized samplers: one scale and one
        timestep copy for the whole batch, no host sync."""
        plans, indices = [s.plan for s in states], [s.index for s in states]
        x = torch.cat([s.latents for s in states])
        x = scale_model_input(x, plans, indices)
        rows = [s.rows for s in states]
        x = x.repeat_interleave(rows[0], dim=0) if len(set(rows)) == 1 else torch.cat(
            [x[b:b + 1].expand(r, *x.shape[1:]) for b, r in enumerate(rows)])
        return x, model_timesteps(plans, indices, self.device, repeats=rows)

    @staticmethod
    def _model_input_per_request(states):
        inputs, timesteps = [], []
        for s in states:
            t = s.timesteps[s.index]
            x = torch.cat([s.latents] * s.rows)
            if s.plan is None:
                inputs.append(s.scheduler.scale_model_input(x, t))
                timesteps.append(t.to(torch.float32).expand(s.rows))
            else:
                inputs.append(scale_model_input(x, [s.plan] * s.rows, [s.index] * s.rows))
                timesteps.append(model_timesteps([s.plan], [s.index], x.device, repeats=[s.rows]))
        return torch.cat(inputs), torch.cat(timesteps)

    def _advance(self, states, noise) -> None:
        """Guidance and the sampler step for `states` (their UNet rows in `noise`, in order):
        batched when they share a vectorized sampler call and guidance scale, else one request."""
        if states[0].rows == 2:
            b = len(states)
            pred = noise.view(b, 2, *noise.shape[1:])
            uncond, text = pred[:, 0], pred[:, 1]
            pred = uncond + states[0].job.params.guidance_scale * (text - uncond)
        else:
            pred = noise
        if states[0].plan is not None:
            latents = torch.cat([s.latents for s in states]) if len(states) > 1 else states[0].latents
            latents = sampler_step(pred, latents, [s.plan for s in states], [s.index for s in states])
            for b, s in enumerate(states):
                s.latents = latents[b:b + 1]
            return
        (s,) = states
        s.latents = s.scheduler.step(pred, s.timesteps[s.index], s.latents, **s.step_kwargs, return_dict=False)[0]

    def adopt_loras(self, loras: LoraSet) -> LoraSet:
        """LoRAs that arrived for a request, checked against the UNet (InvalidInput naming the
        layer that does not fit) and, put on the GPU by a loader thread's stream, read on ours
        from now on."""
        for lora, _ in loras:
            self.lora_merger.layers.check(lora)
        self._adopt(t for lora, _ in loras for layer in lora.unet.values() for t in (layer.down, layer.up))
        return loras

    def _adopt(self, tensors) -> None:
        """Tensors allocated on another thread's stream and read on ours: the allocator must not
        reuse their memory before our stream is done with them. It tracks memory by block, and a
        LoRA's hundreds of tensors are views of one buffer: one call per buffer does."""
        if self.stream is None:
            return
        blocks = {}
        for tensor in tensors:
            if tensor.is_cuda:
                blocks.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        for tensor in blocks.values():
            stream = self.streams.get(tensor.device)
            if stream is not None:  # (a device we never read it on needs no record)
                tensor.record_stream(stream)

    def _loras(self, states) -> tuple[LoraSegment, ...]:
        """Merge the batch's LoRA set when all its requests share one (restoring the base weights
        for none), else leave the weights at base and have the runtime add each request's
        low-rank terms on its rows."""
        keys = {lora_key(s.job.loras) for s in states}
        if len(keys) == 1:
            (key,) = keys
            if key != self.merged:
                self.lora_merger.merge(list(states[0].job.loras))  # an empty set restores the base
                self.runtime.weights_written()
                self.merged = key
            return ()
        if self.merged:
            self.lora_merger.restore()
            self.runtime.weights_written()
            self.merged = ()
        segments, row = [], 0
        for s in states:
            if s.job.loras:
                segments.append(LoraSegment(slice(row, row + s.rows), s.job.loras))
            row += s.rows
        return tuple(segments)

    def _submit_controls(self, states, sample, timestep, sides):
        ready = None
        if self.stream is not None and any(s.controls for s in states):
            ready = torch.cuda.Event()
            ready.record(self.stream)
        return submit_controls(self.controlnets, states, sample, timestep, sides, self.runtime.side_devices, ready,
                               split_rows=self.controlnet_row_split)

    @staticmethod
    def _pipeline(states, pending):
        """Use what the previous step submitted; keep this step's calls for the next one."""
        used = []
        for s, fresh in zip(states, pending):
            used.append(fresh if s.stale_controls is None else s.stale_controls)
            s.stale_controls = fresh
        return used

    def snapshot(self, state: RequestState) -> LatentSnapshot:
        """The request's latents now, for a preview (on the loop thread: queues a copy, no sync)."""
        return LatentSnapshot(state.latents, self.stream)

    def result(self, state: RequestState) -> np.ndarray:
        """The final latents on the host, from any thread. Copied on the engine's stream: the steps
        that wrote them are queued there, and with graphs the host runs steps ahead of the GPU."""
        with self.on_stream():
            return state.latents.float().cpu().numpy()


def _same_guidance(states) -> bool:
    """One batched guidance needs one scale and one row count (diffusers multiplies by a Python
    float: a per-row tensor of scales would round differently)."""
    return len({(s.rows, s.job.params.guidance_scale) for s in states}) == 1


def _load_scheduler(folder: Path):
    """The model folder's own scheduler class, by the name in its config (diffusers classes only)."""
    import diffusers

    config = json.loads((folder / "scheduler_config.json").read_text())
    name = config.get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if cls is None or not name.endswith("Scheduler"):
        raise ValueError(f"{folder}: scheduler class {name!r} is not a diffusers scheduler")
    return cls.from_config(config)
