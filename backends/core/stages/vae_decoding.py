"""Final latents -> uint8 RGB pixels, as StableDiffusionXLPipeline decodes and postprocesses them.

`graphs=True` (GPUs): the decoder runs as one CUDA graph per latent shape, captured on first use;
same kernels and precision as eager (SDXL's VAE runs in fp32 as diffusers upcasts it), so the
pixels do not change beyond kernel choice. `channels_last` and `fused_kernels` (plugins/: its
GroupNorm+SiLU at 1024x1024 ran 17x faster than eager's in fp16 on the H200) follow the
deployment's runtime flags; neither has been timed inside the VAE yet.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backends.core.runtime.placement import Placement


class LatentDecoder:
    def __init__(self, folder: str | Path, placement: Placement, graphs: bool = False, channels_last: bool = False,
                 fused_kernels: bool = False):
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
        self.graphs = graphs and self.device.type == "cuda"
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self._graphs: dict[tuple, tuple] = {}  # latent shape -> (graph, static input, static output)
        if channels_last:
            self.vae.to(memory_format=torch.channels_last)
        if fused_kernels:
            from plugins import use_fused_kernels

            use_fused_kernels(self.vae.decoder)

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
        image = self._graphed(x) if self.graphs else self.vae.decode(x, return_dict=False)[0]
        image = (image / 2 + 0.5).clamp(0, 1)
        image = image.float().cpu().permute(0, 2, 3, 1).numpy()[0]
        return (image * 255).round().astype(np.uint8)

    def _graphed(self, x: torch.Tensor) -> torch.Tensor:
        key = tuple(x.shape)
        if key not in self._graphs:
            static = x.clone().contiguous(memory_format=self.memory_format)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # cuDNN picks its algorithms before the capture
                self.vae.decode(static, return_dict=False)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = self.vae.decode(static, return_dict=False)[0]
            self._graphs[key] = (graph, static, out)
        graph, static, out = self._graphs[key]
        static.copy_(x)
        graph.replay()
        return out
