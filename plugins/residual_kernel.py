"""(residual + (h + bias[c])) / scale in one pass, in Triton's kernel language: the end of a
ResnetBlock2D, with its second convolution's bias left out of the convolution.

torch adds a convolution's bias as a pass of its own over the output (a broadcast, so not even
its vectorized kernel: 7.3 of the VAE decoder's 58 ms at 1024 px on an H200, bench/micro/vae_micro.py),
then the residual in a second pass and divides by the block's output scale in a third. Here it is
one read of h and of the residual and one write, each intermediate rounded to the tensors' dtype
as torch's separate ops round it. NCHW or channels_last (NHWC): h, residual and the output share
one layout.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl

from plugins.groupnorm_silu_kernel import rounded_like

_BLOCK = 2048


@triton.jit
def _bias_residual(h_ptr, bias_ptr, r_ptr, out_ptr, numel, C, HW, inv_scale,
                   CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < numel
    c = offs % C if CHANNELS_LAST else (offs // HW) % C
    h = tl.load(h_ptr + offs, mask=live, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + c, mask=live, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=live, other=0.0).to(tl.float32)
    out = rounded_like(r + rounded_like(h + b, out_ptr), out_ptr) * inv_scale
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=live)


def bias_residual_triton(h: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, scale: float,
                         channels_last: bool) -> torch.Tensor:
    """h and residual: one shape, one dense layout (NCHW, or NHWC when `channels_last`)."""
    out = torch.empty_like(h)
    if h.numel() == 0:
        return out
    C = h.shape[1]
    # torch on CUDA divides by a Python scalar as a product with its fp32 reciprocal: the same here.
    inv_scale = float(np.float32(1.0) / np.float32(scale))
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        _bias_residual[(triton.cdiv(h.numel(), _BLOCK),)](
            h, bias.contiguous(), residual, out, h.numel(), C, h.numel() // (h.shape[0] * C), inv_scale,
            CHANNELS_LAST=channels_last, BLOCK=_BLOCK, num_warps=8)
    return out
