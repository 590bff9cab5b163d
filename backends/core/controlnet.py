"""ControlNet residuals for one request's rows, as StableDiffusionXLControlNetPipeline computes them.

Each ControlNet sees the same scaled latents, timestep, text embeddings and time ids as the UNet,
plus its control image; its residuals are multiplied by its scale while the step lies inside its
guidance window (diffusers' `controlnet_keep`) and summed over ControlNets as MultiControlNetModel
does. Outside the window diffusers multiplies by zero; here the call is skipped and zeros are
returned, which is the same value for less work.

This is the in-process runner the denoiser uses today; the ControlNet service (its own Triton
model with a GPU cache) will call the same `residuals` per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .adapter_store import AdapterStore
from .placement import Placement


@dataclass
class ControlInput:
    """One ControlNet of a request: its name, control image (PIL) and diffusers' parameters."""

    name: str
    image: Any
    scale: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0


@dataclass
class PreparedControl:
    model: Any  # diffusers ControlNetModel
    image: torch.Tensor  # [rows, 3, H, W], the request's rows (duplicated for CFG)
    scale: float
    guidance_start: float
    guidance_end: float

    def keep(self, step: int, steps: int) -> bool:
        return not (step / steps < self.guidance_start or (step + 1) / steps > self.guidance_end)


def prepare_control_image(image, width: int, height: int, vae_scale_factor: int) -> torch.Tensor:
    """PIL image -> [1, 3, height, width] float32 in [0, 1], resized as diffusers does."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    return processor.preprocess(image, height=height, width=width).to(torch.float32)


class ControlNetBank:
    """ControlNets loaded from the adapter store on first use and kept (the GPU cache with a
    popularity policy replaces this in the ControlNet service)."""

    def __init__(self, store: AdapterStore, placement: Placement):
        self.store = store
        self.placement = placement
        self._loaded: dict[str, Any] = {}

    def get(self, name: str):
        if name not in self._loaded:
            from diffusers import ControlNetModel

            entry = self.store.controlnet(name)
            model = ControlNetModel.from_pretrained(Path(entry.folder), use_safetensors=True)
            self._loaded[name] = model.to(self.placement.device, self.placement.torch_dtype).eval()
        return self._loaded[name]


def residuals(controls: list[PreparedControl], step: int, steps: int, sample, timestep, embeds, pooled, time_ids,
              zeros: Callable[[], tuple[list[torch.Tensor], torch.Tensor]]):
    """Summed (down residuals, mid residual) of a request's ControlNets at `step` of `steps`."""
    down, mid = None, None
    for control in controls:
        if not control.keep(step, steps):
            continue
        d, m = control.model(sample, timestep, encoder_hidden_states=embeds, controlnet_cond=control.image,
                             conditioning_scale=control.scale,
                             added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)
        if down is None:
            down, mid = list(d), m
        else:
            down = [a + b for a, b in zip(down, d)]
            mid = mid + m
    return zeros() if down is None else (down, mid)
