"""The denoiser's runner: one batched denoising step for requests of any workflows.

It assembles the step (the workflow's UNet input, the ControlNet calls beside the encoder half,
the batch's LoRAs, the StepBatch), runs the runtime's halves and hands the noise prediction back
to the workflow (engine/workflows/), which owns admission and what follows the UNet. LoRA merge
policy: engine/lora_policy.py; ControlNet calls and their modes: engine/controls.py.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, nullcontext
from pathlib import Path

import numpy as np
import torch

from backends.core.adapters.controlnet import ResidualProvider
from backends.core.adapters.lora import LoraSet
from backends.core.engine import noise
from backends.core.engine.controls import ControlNetSteps
from backends.core.engine.diffusers_schedulers import SchedulerPrototypes
from backends.core.engine.lora_policy import LoraPolicy
from backends.core.engine.template_cache import TemplateCache
from backends.core.runtime.cache_plan import BlockProfile
from backends.core.runtime.token_subsets import FULL, TokenLayout, TokenRow
from backends.core.engine.requests import DenoiseJob, LatentSnapshot, RequestState
from backends.core.engine.step_stats import DECODED, DECODER, ENCODED, ENCODER, SAMPLED, SAMPLER, StepClock
from backends.core.engine.workflows import WORKFLOWS
from backends.core.engine.workflows.base import Model
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.base import StepBatch, UNetRuntime
from backends.core.runtime.placement import Placement
from backends.core.runtime.torch_eager import EagerUNetRuntime

VAE_SCALE_FACTOR_FILE = "vae_scale_factor.json"


class TorchDenoiser:
    def __init__(self, folder: str | Path, placement: Placement, controlnets: ResidualProvider | None = None,
                 controlnet_mode: str = "sync", runtime: UNetRuntime | None = None, controlnet_row_split: bool = False,
                 templates: TemplateCache | None = None):
        """`runtime`: how the UNet runs (backends/core/runtime); default: eager over the folder's halves.
        `controlnet_mode`, `controlnet_row_split`: DenoiserConfig's. `templates`: where templates'
        recordings are kept (default: the device's memory only)."""
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
        noise.choose(self.dtype)  # its check against torch.randn runs at load, not in a request
        self.controls = ControlNetSteps(controlnets, controlnet_mode, controlnet_row_split, self.stream,
                                        self.runtime.side_devices)
        self.loras = LoraPolicy(self.runtime)
        vae_scale_factor = json.loads((folder / VAE_SCALE_FACTOR_FILE).read_text())["vae_scale_factor"]
        self.schedulers = SchedulerPrototypes(_load_scheduler(folder / "scheduler"), self.device)
        self.templates = templates if templates is not None else TemplateCache(self.device)
        model = Model(self.device, self.dtype, self.unet.config, vae_scale_factor, self.schedulers, self.controls,
                      self.templates, token_subsets=self.runtime.caps.token_subsets, adopt=self._adopt,
                      block_profile=BlockProfile.read(folder))
        self.workflows = {name: cls(model) for name, cls in WORKFLOWS.items()}
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

    def workflow(self, job: DenoiseJob):
        workflow = self.workflows.get(job.workflow)
        if workflow is None:
            raise ValueError(f"workflow: {job.workflow!r} is not one of {sorted(self.workflows)}")
        return workflow

    def start(self, job: DenoiseJob) -> RequestState:
        """Admission: the job's workflow checks it and makes its state (sampler, noise, copies to the
        device); LoRAs given up front are adopted (those still loading, on arrival)."""
        workflow = self.workflow(job)
        self.adopt_loras(job.loras)
        return workflow.start(job)

    @torch.inference_mode()
    def step(self, states: list[RequestState]) -> dict[str, str]:
        """One denoising step for requests of one latent shape, as one UNet batch: each workflow's
        requests are contiguous rows (in the order their workflows first appear in `states`).
        Returns the requests that failed (id -> why); the others have advanced."""
        groups: dict = {}
        for s in states:
            groups.setdefault(s.workflow, []).append(s)
        states = [s for group in groups.values() for s in group]
        inputs = [workflow.model_input(group) for workflow, group in groups.items()]
        sample, timestep = (torch.cat(parts) if len(parts) > 1 else parts[0] for parts in zip(*inputs))
        rows_per_request = tuple(s.rows for s in states)
        sides = self.runtime.row_sides(rows_per_request) if any(s.controls for s in states) else None
        # ControlNets take the latents alone: an inpainting UNet's input adds the mask and the masked
        # template after them (diffusers' ControlNet inpaint pipelines give the ControlNet the same).
        pending = self.controls.submit(states, sample[:, :self.unet.config.out_channels], timestep,
                                       sides)  # run beside the encoder half
        lora_segments = self.loras.segments(states)  # (merges first: the text key names the merged set)
        batch = StepBatch(sample, timestep, torch.cat([s.embeds for s in states]), torch.cat([s.pooled for s in states]),
                          torch.cat([s.time_ids for s in states]), lora_segments=lora_segments,
                          text_key=(self.loras.merged, tuple(s.serial for s in states)),
                          rows_per_request=rows_per_request, tokens=self._tokens(groups, lora_segments))
        clock = self.clock
        clock.mark(ENCODER)
        enc = self.runtime.encode(batch)
        clock.mark(ENCODED)
        failed: dict[str, str] = {}
        residuals = self.controls.collect(states, pending, sides, self._adopt, failed)
        clock.mark(DECODER)
        noise_pred = self.runtime.decode(batch, enc, residuals)
        clock.mark(DECODED)

        live = [s for s in states if s.job.request_id not in failed]
        clock.mark(SAMPLER)
        start = 0
        for workflow, group in groups.items():
            rows = sum(s.rows for s in group)
            workflow.advance(group, noise_pred[start:start + rows], failed)
            start += rows
        clock.mark(SAMPLED)
        for s in live:
            s.index += 1
            s.max_batch = max(s.max_batch, len(states))
        return failed

    @staticmethod
    def _tokens(groups: dict, lora_segments) -> TokenLayout | None:
        """The workflows' token subsets for this step (a workflow makes them only where the runtime
        serves them: Model.token_subsets), every token of the rows of those that make none; run
        whole where unmerged LoRA terms are added by row ranges, which subsets would split."""
        parts = [(workflow.tokens(group), group) for workflow, group in groups.items()]
        if all(layout is None for layout, _ in parts):
            return None
        tokens = TokenLayout.join([layout or TokenLayout((TokenRow(FULL),) * sum(s.rows for s in group))
                                   for layout, group in parts])
        return tokens.whole() if lora_segments else tokens

    def adopt_loras(self, loras: LoraSet) -> LoraSet:
        """LoRAs that arrived for a request, checked against the UNet (InvalidInput naming the
        layer that does not fit) and, put on the GPU by a loader thread's stream, read on ours
        from now on."""
        self.loras.check(loras)
        self._adopt(t for lora, _ in loras for layer in lora.unet.values() for t in (layer.down, layer.up))
        return loras

    def _adopt(self, tensors, written=()) -> None:
        """Tensors allocated on another thread's stream and read on ours: the allocator must not
        reuse their memory before our stream is done with them. It tracks memory by block, and a
        LoRA's hundreds of tensors are views of one buffer: one call per buffer does. `written`:
        (event, device) pairs our stream on that device waits for (on the GPU) before reading."""
        if self.stream is None:
            return
        for event, device in written:
            self.streams[device].wait_event(event)
        blocks = {}
        for tensor in tensors:
            if tensor.is_cuda:
                blocks.setdefault(tensor.untyped_storage().data_ptr(), tensor)
        for tensor in blocks.values():
            stream = self.streams.get(tensor.device)
            if stream is not None:  # (a device we never read it on needs no record)
                tensor.record_stream(stream)

    def snapshot(self, state: RequestState) -> LatentSnapshot:
        """The request's latents now, for a preview (on the loop thread: queues a copy, no sync)."""
        return LatentSnapshot(state.latents, self.stream)

    def result(self, state: RequestState) -> np.ndarray:
        """The final latents on the host, from any thread. Copied on the engine's stream: the steps
        that wrote them are queued there, and with graphs the host runs steps ahead of the GPU."""
        with self.on_stream():
            return state.latents.float().cpu().numpy()


def _load_scheduler(folder: Path):
    """The model folder's own scheduler class, by the name in its config (diffusers classes only)."""
    import diffusers

    config = json.loads((folder / "scheduler_config.json").read_text())
    name = config.get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if cls is None or not name.endswith("Scheduler"):
        raise ValueError(f"{folder}: scheduler class {name!r} is not a diffusers scheduler")
    return cls.from_config(config)
