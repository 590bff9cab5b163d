"""Final latents -> uint8 RGB pixels, as StableDiffusionXLPipeline decodes and postprocesses them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backends.core.runtime.placement import Placement


class LatentDecoder:
    def __init__(self, folder: str | Path, placement: Placement):
        from diffusers import AutoencoderKL

        self.device = torch.device(placement.device)
        self.vae = AutoencoderKL.from_pretrained(Path(folder) / "vae", use_safetensors=True)
        dtype = placement.torch_dtype
        # diffusers upcasts an fp16 VAE that asks for it (SDXL's overflows in fp16); do it once here.
        if dtype == torch.float16 and self.vae.config.force_upcast:
            dtype = torch.float32
        self.dtype = dtype
        self.vae.to(self.device, dtype).eval()
        cfg = self.vae.config
        self.scaling_factor = cfg.scaling_factor
        self.latents_mean = getattr(cfg, "latents_mean", None)
        self.latents_std = getattr(cfg, "latents_std", None)

    @torch.inference_mode()
    def decode(self, latents: np.ndarray) -> np.ndarray:
        """[1, C, h, w] float latents -> [H, W, 3] uint8."""
        x = torch.from_numpy(latents).to(self.device, self.dtype)
        if self.latents_mean is not None and self.latents_std is not None:
            mean = torch.tensor(self.latents_mean).view(1, -1, 1, 1).to(x)
            std = torch.tensor(self.latents_std).view(1, -1, 1, 1).to(x)
            x = x * std / self.scaling_factor + mean
        else:
            x = x / self.scaling_factor
        image = self.vae.decode(x, return_dict=False)[0]
        image = (image / 2 + 0.5).clamp(0, 1)
        image = image.float().cpu().permute(0, 2, 3, 1).numpy()[0]
        return (image * 255).round().astype(np.uint8)
