"""What the denoiser holds per request: the job as it arrives, its state between steps, and what
it reports after a step (progress, latents for a preview)."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from backends.core.adapters.controlnet import ControlInput, PreparedControl
from backends.core.adapters.lora import LoraSet
from backends.core.engine.samplers import SamplerPlan
from backends.core.request.params import GenerateParams


@dataclass(frozen=True)
class EditInputs:
    """What an edit (inpainting) brings besides its text: the VAE encoder's distributions of the
    template and of the template with its masked region blanked (the Gaussian's mean and std per
    latent, before the VAE's scaling factor: the denoiser draws their samples, in diffusers' order
    on the request's generator), and the mask at latent size (1: repaint, 0: keep)."""

    image_mean: np.ndarray  # [1, latent channels, h, w]
    image_std: np.ndarray
    masked_mean: np.ndarray
    masked_std: np.ndarray
    mask: np.ndarray  # [1, 1, h, w] of 0 and 1
    scaling_factor: float  # the VAE's
    strength: float = 1.0  # how far the template is noised before denoising starts (1: pure noise)
    # A template's name: the first edit of it records its activations, later ones reuse them for
    # their unmasked tokens (runtime/token_subsets.py; approximate). None: exact inpainting.
    template: str | None = None


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
    workflow: str = "txt2img"  # which engine/workflows/ plug-in runs it
    edit: EditInputs | None = None  # the inpaint workflow's inputs
    # Of a template edit: its LoRAs' and ControlNets' files as submitted ((inode, mtime, size) each,
    # AdapterStore's StoreFile.stamp), so that a file replaced under the same name keys anew.
    adapter_versions: tuple = ()


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
    workflow: Any  # the Workflow that started it, and steps it (engine/workflows/)
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
    # A template edit: "recorded" (it ran exactly and recorded the template's activations) or
    # "reused" (approximate: its unmasked tokens came from a recording); None: neither.
    template_use: str | None = None
    # The share of the transformer blocks' tokens a step of it computes (a reusing edit's is its
    # mask's): what its steps are priced by (engine/step_cost.py).
    token_share: float = 1.0
    loading_since: float = 0.0  # when the loop began holding it for what it waits for (Workflow.loading)

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]
