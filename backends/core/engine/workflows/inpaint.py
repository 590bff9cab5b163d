"""Inpainting: diffusers' StableDiffusionXLInpaintPipeline.__call__ (no crop padding, no
denoising_start), written out per request.

A template's masked region is repainted, the rest kept. For a base UNet (4 input channels) the
latents outside the mask are replaced after each step by the template's latents noised to the
next timestep; an inpainting UNet (9 channels) takes [latents, mask, masked-template latents] as
its input and nothing is blended. `strength` below 1 starts from the template noised to an
earlier timestep, skipping the first steps.

Exact against the pipeline with the same seed: the request's CPU generator draws in the
pipeline's order (the template's latent sample when the UNet has 4 channels or strength < 1, the
noise, the masked template's latent sample, then the sampler's own draws). A request steps with a
vectorized sampler plan from the step strength starts at (samplers.py: batched with other
requests, no host sync; the blend's add_noise too), or, where the scheduler cannot be vectorized,
diffusers' own scheduler with its begin index set.
"""

from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from backends.core.engine import noise
from backends.core.engine.requests import DenoiseJob, EditInputs, RequestState
from backends.core.engine.samplers import add_noise
from backends.core.engine.template_stream import StreamedActivations
from backends.core.engine.workflows.txt2img import Txt2Img
from backends.core.request.params import InvalidInput
from backends.core.runtime.cache_plan import StreamPlans
from backends.core.runtime.conv_subsets import masked_boxes
from backends.core.runtime.host_copies import to_device
from backends.core.runtime.token_subsets import (FULL, RECORD, REUSE, TemplateActivations, TokenLayout, TokenRow,
                                                 computed_tokens, token_share)

log = logging.getLogger(__name__)

UNET_CHANNELS = (4, 9)  # a base UNet (blended after each step), an inpainting UNet (mask as input)


@dataclass
class InpaintState(RequestState):
    image_latents: torch.Tensor | None = None  # the template's, scaled
    noise: torch.Tensor | None = None  # the first draw of noise, which the blend re-noises the template with
    mask: torch.Tensor | None = None  # [1, 1, h, w]
    masked_latents: torch.Tensor | None = None  # the masked template's, scaled
    # A template edit (EditInputs.template): RECORD or REUSE its activations, the recording, and
    # (REUSE) the tokens it computes at each level, made at admission.
    template_role: str = FULL
    template_key: tuple | None = None
    recording: TemplateActivations | StreamedActivations | None = None
    computed: dict[int, torch.Tensor] | None = None
    boxes: dict | None = None  # REUSE: those tokens' bounding boxes (runtime/conv_subsets.py)
    loading: Future | None = None  # its recording on its way to the device (the loop holds it until then)


def template_key(job: DenoiseJob, rows: int) -> tuple:
    """What a template's recording is kept under: its name, the template itself (its encoding's
    digest: a name given to another image records anew) and everything besides the edit's own
    masked tokens that changes what the UNet's blocks output (the model is the engine's own): the
    size, steps, scheduler, strength and seed (the template's latents outside the mask are noised
    with the request's noise), guidance (its rows), the LoRAs and the ControlNets with their
    images, and their files' versions (DenoiseJob.adapter_versions). Not the prompt: InstGenIE's
    premise is that unmasked tokens barely depend on it, which tests/export/test_template_cache.py
    measures."""
    p, edit = job.params, job.edit
    controls = tuple((c.name, c.scale, c.guidance_start, c.guidance_end, _digest(np.asarray(c.image)))
                     for c in job.controls)
    return (edit.template, _digest(edit.image_mean), p.width, p.height, p.steps, p.scheduler, edit.strength, p.seed,
            rows, tuple((lora.name, lora.scale) for lora in p.loras), controls, job.adapter_versions)


def _within(blocks: frozenset[int] | None, ready: frozenset[int] | None) -> frozenset[int] | None:
    """The blocks in both (None: every block)."""
    return ready if blocks is None else blocks if ready is None else blocks & ready


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


class Inpaint(Txt2Img):
    name = "inpaint"

    def start(self, job: DenoiseJob) -> RequestState:
        m, p, edit = self.model, job.params, job.edit
        channels = m.unet_config.in_channels
        if channels not in UNET_CHANNELS:
            raise ValueError(f"inpainting needs a UNet of {' or '.join(map(str, UNET_CHANNELS))} input channels, "
                             f"not {channels}")
        self.check_text(job)
        self._check_edit(edit, self.latent_shape(p))
        # diffusers' get_timesteps: the first steps that strength leaves out are skipped.
        t_start = max(p.steps - min(int(p.steps * edit.strength), p.steps), 0)
        if t_start >= p.steps:
            raise InvalidInput("strength", f"{edit.strength} leaves no step of {p.steps}")
        generator = torch.Generator("cpu").manual_seed(p.seed)
        sched, plan, step_kwargs = self.sampler(p, generator, begin=t_start)
        timesteps = sched.timesteps[t_start * sched.order:]
        full = edit.strength == 1.0
        image_latents = self._sample(edit.image_mean, edit.image_std, edit.scaling_factor, generator) \
            if channels == 4 or not full else None
        drawn = noise.randn_like_diffusers(edit.image_mean.shape, generator, m.device, m.dtype)
        if full:
            latents = drawn * sched.init_noise_sigma
        elif plan is not None:
            latents = add_noise(image_latents, drawn, plan, 0)
        else:
            latents = sched.add_noise(image_latents, drawn, timesteps[:1])
        masked_latents = self._sample(edit.masked_mean, edit.masked_std, edit.scaling_factor, generator)
        mask = to_device(torch.from_numpy(edit.mask), m.device).to(m.dtype)
        state = self.state(job, sched, timesteps, latents, step_kwargs, plan, cls=InpaintState,
                           image_latents=image_latents, noise=drawn, mask=mask, masked_latents=masked_latents)
        if edit.template is not None and m.token_subsets:
            state.template_key = template_key(job, state.rows)
            reuse, recording = m.templates.take(state.template_key, state.rows)
            if isinstance(recording, Future):
                state.loading = recording
            else:
                state.recording = self._readable(recording)
            state.template_role = REUSE if reuse else RECORD
            state.template_use = "reused" if reuse else "recorded"
            if reuse:
                levels = len(m.unet_config.block_out_channels)
                state.computed = computed_tokens(mask, levels)
                state.boxes = masked_boxes(torch.from_numpy(edit.mask), levels)  # host ints from the host mask
                state.token_share = token_share(state.computed)
        return state

    def prefetch(self, job: DenoiseJob) -> None:
        if job.edit is not None and job.edit.template is not None and self.model.token_subsets:
            self.model.templates.prefetch(template_key(job, 2 if job.params.cfg else 1))

    def loading(self, state) -> Future | None:
        return getattr(state, "loading", None)

    def adopt(self, state) -> None:
        """Its recording's load ended: reuse it, or (it failed: a file gone) run exactly."""
        future, state.loading = state.loading, None
        try:
            state.recording = self._readable(future.result())
            if not isinstance(state.recording, StreamedActivations):
                self.model.adopt(state.recording.outputs.values())  # (copied on the cache's stream)
        except Exception as exc:
            log.warning("template recording could not be loaded (%s); request %s runs exactly", exc,
                        state.job.request_id)
            state.template_role, state.template_use, state.computed, state.token_share = FULL, "exact", None, 1.0

    def _readable(self, recording: TemplateActivations) -> TemplateActivations | StreamedActivations:
        """A recording as the blocks read it: on the device as it is; from host memory, streamed."""
        m = self.model
        if not recording.host:
            return recording
        cache = m.templates
        return StreamedActivations(recording, m.device, cache.load_stream(), cache.streamed_bytes, cache.streamed_wait)

    def tokens(self, states) -> TokenLayout | None:
        if all(s.template_role == FULL for s in states):
            return None
        plans = self._plans(states)
        cached = plans.now if plans is not None else None
        for s in states:
            if s.template_role == REUSE and isinstance(s.recording, StreamedActivations):
                ready = s.recording.prepare(s.index, len(s.timesteps) - 1, *(
                    (plans.first, plans.ahead) if plans is not None else ()))
                cached = _within(cached, ready)
        rows = tuple(TokenRow(s.template_role, s.recording, s.index, r, s.computed, s.boxes)
                     for s in states for r in range(s.rows))
        return TokenLayout(rows, cached)

    def _plans(self, states) -> StreamPlans | None:
        """With a measured profile at the request's size: the blocks where taking the recording
        is faster than computing whole, those of streamed recordings with their copies' times
        (Algorithm 1); None, without one: every block."""
        profile, p = self.model.block_profile, states[0].job.params
        reusing = [s for s in states if s.template_role == REUSE]
        if profile is None or not reusing or (p.width, p.height) != (profile.size, profile.size):
            return None
        streamed = sum(s.rows for s in reusing if isinstance(s.recording, StreamedActivations))
        return profile.stream_plans(max(s.token_share for s in reusing), sum(s.rows for s in reusing), streamed)

    def _check_edit(self, edit: EditInputs | None, shape: tuple[int, int]) -> None:
        if edit is None:
            raise InvalidInput("image", "inpainting needs an image and a mask_image")
        if not 0.0 < edit.strength <= 1.0:
            raise InvalidInput("strength", f"{edit.strength} is outside (0, 1]")
        latents = (1, self.model.unet_config.out_channels, *shape)
        for name, array, want in (("image", edit.image_mean, latents), ("image", edit.image_std, latents),
                                  ("image", edit.masked_mean, latents), ("image", edit.masked_std, latents),
                                  ("mask_image", edit.mask, (1, 1, *shape))):
            if tuple(array.shape) != want:
                raise InvalidInput(name, f"encodes to {tuple(array.shape)}, not {want} for these params")
        if not np.isin(edit.mask, (0.0, 1.0)).all():
            raise InvalidInput("mask_image", "is not binary (0 keeps, 1 repaints)")

    def _sample(self, mean: np.ndarray, std: np.ndarray, scaling_factor: float, generator) -> torch.Tensor:
        """The VAE's latent sample (DiagonalGaussianDistribution.sample: one draw of the generator),
        scaled as the pipeline's _encode_vae_image scales it."""
        m = self.model
        mean, std = (to_device(torch.from_numpy(a), m.device).to(m.dtype) for a in (mean, std))
        return scaling_factor * (mean + std * noise.randn_like_diffusers(mean.shape, generator, m.device, m.dtype))

    def model_input(self, states):
        x, t = super().model_input(states)
        if self.model.unet_config.in_channels == 9:  # [latents, mask, masked template] on every row
            extra = torch.cat([torch.cat([s.mask, s.masked_latents], dim=1).expand(s.rows, -1, -1, -1)
                               for s in states])
            x = torch.cat([x, extra], dim=1)
        return x, t

    def advance(self, states, noise_pred, failed) -> None:
        super().advance(states, noise_pred, failed)
        for s in states:
            if s.template_role == RECORD and s.index == len(s.timesteps) - 1 and s.job.request_id not in failed:
                self.model.templates.completed(s.recording, s.template_key)
        if self.model.unet_config.in_channels != 4:
            return
        for s in states:  # keep the template outside the mask, noised to the next step's level
            if s.job.request_id in failed:
                continue
            proper = s.image_latents
            if s.index < len(s.timesteps) - 1:
                proper = add_noise(proper, s.noise, s.plan, s.index + 1) if s.plan is not None \
                    else s.scheduler.add_noise(proper, s.noise, s.timesteps[s.index + 1:s.index + 2])
            s.latents = (1 - s.mask) * proper + s.mask * s.latents
