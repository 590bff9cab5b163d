"""Final latents -> uint8 RGB pixels, as StableDiffusionXLPipeline decodes and postprocesses them.

`graphs=True` (GPUs): the decoder runs as one CUDA graph per latent shape, captured on first use;
same kernels and precision as eager (SDXL's VAE runs in fp32 as diffusers upcasts it). Measured on
an H200 at 1024x1024 (bench/vae_micro.py, fp32, random weights; results in bench/results/):
eager 118 ms, graphs 116, graphs + `fused_kernels` (plugins' GroupNorm+SiLU) 68 ms with pixels
within 1 of eager's, `compiled` 64 ms after a 25 s compile, `channels_last` 164 ms (slower);
bf16 38 ms but 50 dB from fp32, fp16 overflows on SDXL's real VAE. A fast deployment uses
graphs + fused kernels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from backends.core.runtime.placement import Placement


class LatentDecoder:
    def __init__(self, folder: str | Path, placement: Placement, graphs: bool = False, channels_last: bool = False,
                 fused_kernels: bool = False, compiled: bool = False, dtype: torch.dtype | None = None):
        from diffusers import AutoencoderKL

        self.device = torch.device(placement.device)
        self.vae = AutoencoderKL.from_pretrained(Path(folder) / "vae", use_safetensors=True)
        if dtype is None:
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
        if compiled:
            self.vae.decoder = torch.compile(self.vae.decoder)

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
        # diffusers' postprocess, done on the device so that a quarter of the bytes cross to the
        # host: the same fp32 operations in the same order (round half to even), the same pixels.
        image = ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return image.permute(0, 2, 3, 1)[0].cpu().numpy()

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
