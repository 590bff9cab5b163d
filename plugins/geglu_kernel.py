"""GEGLU's tail in Triton's kernel language: x[..., :D] * gelu(x[..., D:]) in one pass.

diffusers' GEGLU chunks the projection, runs gelu into a temporary and multiplies (three
tensors through memory); here each output element reads its two inputs once and is written
once. gelu is the exact erf form (approximate="none"), computed in fp32 like torch's half
kernels, with a single rounding at the end. Importing this module needs `triton`;
plugins.ops imports it lazily.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 2048
_MIN_BLOCK = 256  # below this, per-program overhead outweighs a partly masked last tile


@triton.jit
def _geglu(x_ptr, y_ptr, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < D
    src = x_ptr + row * (2 * D) + cols
    h = tl.load(src, mask=m, other=0.0).to(tl.float32)
    g = tl.load(src + D, mask=m, other=0.0).to(tl.float32)
    gelu = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    tl.store(y_ptr + row * D + cols, (h * gelu).to(y_ptr.dtype.element_ty), mask=m)


def geglu_triton(x: torch.Tensor) -> torch.Tensor:
    """The Triton path of easel::geglu: [..., 2D] -> [..., D], contiguous."""
    D = x.shape[-1] // 2
    x = x.contiguous()
    y = x.new_empty((*x.shape[:-1], D))
    rows = x.numel() // (2 * D) if D else 0
    if rows == 0:
        return y
    # The largest power of two dividing D, so no tile is partly masked: SDXL's D is
    # 2560 (640-channel blocks) -> 512 and 5120 (1280) -> 1024.
    block = min(_MAX_BLOCK, D & -D)
    if block < _MIN_BLOCK:
        block = min(_MAX_BLOCK // 2, triton.next_power_of_2(D))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        # 8 elements per thread: 16-byte accesses in half precision
        _geglu[(rows, triton.cdiv(D, block))](x, y, D, BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return y
