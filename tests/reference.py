"""Diffusers, the oracle: the same request run through diffusers' own pipeline."""

from __future__ import annotations

import functools

import numpy as np
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, StableDiffusionXLPipeline)

# Written independently of backends/core/engine/diffusers_schedulers.py on purpose: this is what users would do.
SCHEDULERS = {
    "default": None,
    "euler": lambda cfg: EulerDiscreteScheduler.from_config(cfg),
    "euler_a": lambda cfg: EulerAncestralDiscreteScheduler.from_config(cfg),
    "dpmpp_2m_karras": lambda cfg: DPMSolverMultistepScheduler.from_config(
        cfg, use_karras_sigmas=True, algorithm_type="dpmsolver++"),
    "ddim": lambda cfg: DDIMScheduler.from_config(cfg),
}


@functools.lru_cache(maxsize=4)
def _pipeline(model_dir: str):
    return StableDiffusionXLPipeline.from_pretrained(model_dir, add_watermarker=False)


def diffusers_pixels(model_dir, prompt, *, seed, steps, width, height, guidance_scale=5.0,
                     negative_prompt=None, scheduler="default") -> np.ndarray:
    """uint8 [H, W, 3] pixels of diffusers' StableDiffusionXLPipeline, rounded as numpy_to_pil does."""
    pipe = _pipeline(str(model_dir))
    original = pipe.scheduler
    if SCHEDULERS[scheduler] is not None:
        pipe.scheduler = SCHEDULERS[scheduler](original.config)
    try:
        image = pipe(prompt, negative_prompt=negative_prompt, width=width, height=height,
                     num_inference_steps=steps, guidance_scale=guidance_scale,
                     generator=torch.Generator("cpu").manual_seed(seed), output_type="np").images[0]
    finally:
        pipe.scheduler = original
    return (image * 255).round().astype(np.uint8)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())
