"""Latents -> a small preview image, without the VAE: the cheap latent-to-RGB approximation.

SDXL's VAE maps each latent pixel to an 8x8 block of RGB whose average colour is close to a linear
function of the latent's 4 channels. The factors below are that function fitted for SDXL's VAE on
real images (the ones ComfyUI's and A1111's latent previews use, for latents as the sampler holds
them, i.e. scaled by the VAE's scaling_factor). So a preview costs a [h*w, 4] x [4, 3] product
and a PNG at the latent grid's size (128x128 for a 1024x1024 image), about a millisecond, against
the VAE decoder's tens to hundreds. On another VAE (the tiny test models' random ones) it is only
a picture of the latents, and a VAE whose latents do not have 4 channels gets its first 3 channels
stretched to [0, 255].

numpy only: easel_stream's pipeline (backends/triton/bls_pipeline.py), which runs it, loads no torch.
"""

from __future__ import annotations

import numpy as np

from backends.core.stages.png_encoding import encode_png

SDXL_RGB_FACTORS = np.array([
    #   R        G        B
    [0.3651, 0.4232, 0.4341],
    [-0.2533, -0.0042, 0.1068],
    [0.1076, 0.1111, -0.0362],
    [-0.3165, -0.2492, -0.2188],
], dtype=np.float32)
SDXL_RGB_BIAS = np.array([0.1084, -0.0175, -0.0011], dtype=np.float32)
PNG_LEVEL = 1


def preview_pixels(latents: np.ndarray) -> np.ndarray:
    """[1, C, h, w] latents -> [h, w, 3] uint8 RGB."""
    if latents.ndim != 4 or latents.shape[0] != 1:
        raise ValueError(f"latents: expected [1, C, h, w], got {list(latents.shape)}")
    x = np.moveaxis(latents[0].astype(np.float32, copy=False), 0, -1)  # [h, w, C]
    if x.shape[-1] == SDXL_RGB_FACTORS.shape[0]:
        rgb = x @ SDXL_RGB_FACTORS + SDXL_RGB_BIAS  # in [-1, 1], as the VAE's output
        rgb = (rgb + 1.0) * 127.5
    else:
        rgb = x[..., :3]
        lo, hi = float(rgb.min()), float(rgb.max())
        rgb = (rgb - lo) * (255.0 / (hi - lo) if hi > lo else 0.0)
    return np.clip(rgb, 0, 255).round().astype(np.uint8)


def preview_png(latents: np.ndarray) -> bytes:
    """[1, C, h, w] latents -> a PNG of w x h pixels."""
    return encode_png(np.ascontiguousarray(preview_pixels(latents)), PNG_LEVEL)
