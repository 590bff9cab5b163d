"""GEGLU with its projection, in Triton's kernel language: y = h * gelu(g), [h, g] = x @ W.T + b.

diffusers' GEGLU writes the projection's [M, 2D] output to memory, then reads it back to split,
gelu and multiply (two more kernels eagerly, one when compiled). Here one matrix-product kernel
computes a tile of h and the matching tile of g from the same tiles of x (two accumulators) and
writes only y, [M, D]: the [M, 2D] intermediate never reaches memory.

Numerics follow the unfused path: fp32 accumulation, the bias added in fp32 and each product
rounded to the input dtype (as the matrix product's output is), then gelu (exact erf form) and
the multiply in fp32 with one rounding at the end, as inductor's fused tail computes them (its
output equalled the compiled unfused path's bit for bit on SDXL's shapes).

Measured, and not used by the runtime (bench/geglu_linear_micro.py, in git history, H200, fp16, CUDA graphs;
bench/results/2026-11-23b-h200/): against cuBLAS's product plus inductor's fused tail it is 1.05x
and 1.03x faster at 2 rows (one request with guidance) and 1.10x / 0.97x at 16 rows (4096 / 1024
tokens): saving the intermediate's traffic is mostly given back by a product slower than
cuBLAS's (a pointer-based version of this kernel was 0.90-0.96x). At 2 rows that is about 0.3 ms
of a 31 ms step, not worth a second path beside the patched GEGLU. Importing this module needs
`triton`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int  # columns of h (and of g) per program: the product tile is block_m x 2*block_n
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# The fastest on an H200 for SDXL's 2-row shapes (bench/geglu_linear_micro.py, in git history).
DEFAULT = TileConfig(128, 128, 64, 8, 8, 4)


@triton.jit
def _geglu_linear_tma(x_desc, w_desc, b_ptr, y_desc, M, D, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Tiles come in by the Tensor Memory Accelerator (Hopper's TMA): asynchronous copies that
    # need no registers and no address arithmetic per element. Programs walk the output in groups
    # of GROUP_M row tiles so that neighbours share x and W tiles in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(D, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    off_m = (first_m + (pid % in_group) % group_size) * BLOCK_M
    off_n = ((pid % in_group) // group_size) * BLOCK_N

    acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(K, BLOCK_K)):
        a = x_desc.load([off_m, k * BLOCK_K])
        wh = w_desc.load([off_n, k * BLOCK_K])
        wg = w_desc.load([D + off_n, k * BLOCK_K])
        acc_h = tl.dot(a, wh.T, acc_h)
        acc_g = tl.dot(a, wg.T, acc_g)

    cols = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        col_ok = cols < D
        acc_h += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + D + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ty = y_desc.dtype
    h = acc_h.to(out_ty).to(tl.float32)
    g = acc_g.to(out_ty).to(tl.float32)
    y = h * (0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476)))
    y_desc.store([off_m, off_n], y.to(out_ty))  # TMA clips the tile at the tensor's edges


def geglu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 config: TileConfig = DEFAULT) -> torch.Tensor:
    """x [..., K], weight [2D, K] (a Linear's), bias [2D] or None -> [..., D]. K and D are
    multiples of 8 (TMA's 16-byte strides); partial tiles at the edges are fine."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    K = x.shape[-1]
    D = weight.shape[0] // 2
    x2 = x.reshape(-1, K).contiguous()
    weight = weight.contiguous()
    M = x2.shape[0]
    y = x.new_empty((*x.shape[:-1], D))
    if M == 0 or D == 0:
        return y
    cfg = config
    x_desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    y_desc = TensorDescriptor.from_tensor(y.view(M, D), [cfg.block_m, cfg.block_n])
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(D, cfg.block_n),)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _geglu_linear_tma[grid](x_desc, w_desc, bias if bias is not None else weight, y_desc, M, D, K,
                                HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
    return y
