"""Final latents -> uint8 RGB pixels, as StableDiffusionXLPipeline decodes and postprocesses them.

`graphs=True` (GPUs): the decoder runs as one CUDA graph per latent shape, captured on first use;
same kernels and precision as eager (SDXL's VAE runs in fp32 as diffusers upcasts it). Measured on
an H200 at 1024x1024 (bench/micro/vae_micro.py, fp32, random weights; results in bench/results/):
eager 118 ms, graphs 116, graphs + `fused_kernels` (plugins' GroupNorm+SiLU) 68 ms with pixels
within 1 of eager's, `compiled` 64 ms after a 25 s compile, `channels_last` 164 ms (slower);
bf16 38 ms but 50 dB from fp32, fp16 overflows on SDXL's real VAE. A fast deployment uses
graphs + fused kernels. Since the fused GroupNorm+SiLU keeps channels_last tensors in that layout
and the residual blocks' convolution biases are folded into the fused ops (plugins/), the decoder
runs NHWC from its mid block's attention on (cuDNN's NHWC convolutions, no layout copies):
graphs + fused + bf16 attention 45 ms (57.8 before), bf16 29 ms (38), with or without
`channels_last` (the 2026-11-24e run, bench/results/2026-11-24e-h200/notes.md).

`attention_dtype` (fp16 or bf16; for an fp32 VAE, as SDXL's upcast one): the mid block's
attention (one head of 512 channels over all 16384 latent pixels at 1024 px) multiplies in that
dtype instead of fp32; everything around it (norm, projections, residual) stays fp32. In fp32 it
is 15 of those 68 ms (a SIMT kernel: no fp32 flash attention). bf16 keeps fp32's range, fp16 three more bits of precision. On the H200
(bench/micro/vae_micro.py, graphs + fused kernels, random weights): 67.8 -> 57.8 ms with either, the
pixels 62.9 dB from fp32 eager's as without it (max difference 1/255 both ways). A fast
deployment uses bf16: SDXL's VAE overflows fp16 elsewhere, and its attention might too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0

from backends.core.runtime.cuda_graphs import GraphSet
from backends.core.runtime.placement import Placement


class HalfPrecisionAttention:
    """diffusers' AttnProcessor2_0, step for step, for a VAE's attention (4-D input, group norm,
    no mask, no cross-attention), with only the attention product in half precision: queries,
    keys and values rounded to `dtype` (the kernel accumulates in fp32) and the result cast back."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @staticmethod
    def supports(attn: Attention) -> bool:
        return (type(attn.processor) is AttnProcessor2_0 and attn.spatial_norm is None
                and attn.norm_q is None and attn.norm_k is None and not attn.is_cross_attention)

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, temb=None, *args, **kwargs) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None or hidden_states.ndim != 4:
            return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask, temb)
        residual = hidden_states
        batch, channel, height, width = hidden_states.shape
        hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch, -1, attn.heads, head_dim).transpose(1, 2).to(self.dtype)
                             for t in (query, key, value))
        hidden_states = F.scaled_dot_product_attention(query, key, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim).to(residual.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class LatentDecoder:
    def __init__(self, folder: str | Path, placement: Placement, graphs: bool = False, channels_last: bool = False,
                 fused_kernels: bool = False, compiled: bool = False, dtype: torch.dtype | None = None,
                 attention_dtype: torch.dtype | None = None):
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
        self._graphs = GraphSet(memory_format=self.memory_format)  # one per latent shape
        if channels_last:
            self.vae.to(memory_format=torch.channels_last)
        if fused_kernels:
            from plugins import use_fused_kernels

            use_fused_kernels(self.vae.decoder)
        if compiled:
            self.vae.decoder = torch.compile(self.vae.decoder)
        if self.dtype == torch.float32 and attention_dtype not in (None, torch.float32):
            for module in self.vae.decoder.modules():
                if isinstance(module, Attention) and HalfPrecisionAttention.supports(module):
                    module.set_processor(HalfPrecisionAttention(attention_dtype))

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The [1, C, h, w] latents of an image of this size."""
        cfg = self.vae.config
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        return 1, cfg.latent_channels, height // factor, width // factor

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
        image = self._graphs(tuple(x.shape), self._decode, x) if self.graphs else self._decode(x)
        # diffusers' postprocess, done on the device so that a quarter of the bytes cross to the
        # host: the same fp32 operations in the same order (round half to even), the same pixels.
        image = ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        # [H, W, 3] laid out so on the device: a strided view would be copied on the host when the
        # Triton tensor is made (numpy: 6.9 ms at 1024 px on the dev CPU, outside vae_decoder_s).
        return image.permute(0, 2, 3, 1)[0].contiguous().cpu().numpy()

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(x, return_dict=False)[0]
