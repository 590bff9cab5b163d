"""What a workflow is to the denoiser's runner (engine/denoiser.py).

The runner assembles a step: it asks the batch's workflow for the UNet's input, runs the UNet
halves with the step's ControlNet residuals and LoRAs, and hands the noise prediction back to the
workflow, which owns what follows (guidance, the sampler, any blend with a template). A workflow
also owns admission: the job's checks and its per-request state. Text-to-image is `txt2img`; an
editing task (inpainting, template edits, patches) is another file beside it, registered in
workflows/__init__.py.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from backends.core.engine.controls import ControlNetSteps
from backends.core.engine.diffusers_schedulers import SchedulerPrototypes
from backends.core.engine.requests import DenoiseJob, RequestState
from backends.core.engine.template_cache import TemplateCache
from backends.core.runtime.cache_plan import BlockProfile
from backends.core.runtime.token_subsets import TokenLayout


@dataclass(frozen=True)
class Model:
    """What workflows read of the engine's model: where it computes and its dimensions."""

    device: torch.device
    dtype: torch.dtype
    unet_config: Any  # the UNet's diffusers config (channels, text and pooled widths)
    vae_scale_factor: int
    schedulers: SchedulerPrototypes
    controls: ControlNetSteps
    templates: TemplateCache  # templates' recorded activations (runtime/token_subsets.py)
    token_subsets: bool = False  # the runtime computes subsets of tokens (RuntimeCaps.token_subsets)
    # Measured block times (runtime/cache_plan.py): which blocks a reusing edit takes from its recording
    block_profile: BlockProfile | None = None
    # Tensors made on another thread's stream (a recording's load) and read on the engine's from now on
    adopt: Callable[[Iterable[torch.Tensor]], None] = lambda tensors: None


class Workflow(Protocol):
    name: str

    def start(self, job: DenoiseJob) -> RequestState:
        """Admission: the job checked (InvalidInput naming the field) and its state made."""

    def model_input(self, states: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The UNet's sample rows and their timesteps for this step, requests in order."""

    def advance(self, states: list[RequestState], noise: torch.Tensor, failed: dict) -> None:
        """After the UNet: each request not in `failed` moves to its next latents."""

    def tokens(self, states: list[RequestState]) -> TokenLayout | None:
        """The step's token subsets (StepBatch.tokens), or None: every token of every row."""

    def prefetch(self, job: DenoiseJob) -> None:
        """The job was submitted (it may queue): start fetching what its admission will need."""

    def loading(self, state: RequestState) -> Future | None:
        """What the request waits for before its first step (the loop holds it), or None."""

    def adopt(self, state: RequestState) -> None:
        """`loading(state)` is done: take its result at this step boundary."""
