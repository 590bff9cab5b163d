"""silu(group_norm(x)) for channels_last (NHWC) tensors, in Triton's kernel language.

In NHWC a group's elements are not contiguous: each pixel holds C channels side by side, a group
C / G of them. So programs walk pixels, not groups, and load whole [pixels, channels] tiles
(every byte of a row used, coalesced); the groups are put together only from per-channel partials:

1. `_stats`: grid (N, splits). Each program folds a range of one sample's pixels into per-channel
   (mean, M2) with per-lane Welford updates, then merges its pixel lanes (Chan's formula).
2. `_finalize`: grid (N * G). Merges a group's channels' partials of every split into its mean and
   1/std.
3. `_apply`: grid (N, pixel tiles). Normalizes, applies each channel's affine and SiLU in fp32,
   writes once, in NHWC.

As in the NCHW kernels: both passes work on x minus the group's first element (at the sample's
first pixel), and `pre_bias` adds a per-channel bias (a convolution's) rounded to x's dtype.
Traffic: x read twice, y written once; the partials are [N, splits, C] fp32, a few MiB at most.
A channels_last convolution (cuDNN's tensor-core kernels are NHWC) then reads y without the
NCHW -> NHWC copies it makes around an NCHW tensor.
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl

from plugins.groupnorm_silu_kernel import _welford_combine, num_sms, rounded_like

_TILE = 2048  # elements of a [pixels, channels] tile (8 warps x 8 lanes' worth)
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 1024


@triton.jit
def _stats(x_ptr, pre_bias_ptr, mean_ptr, m2_ptr, HW, C, channels_per_group, chunk, splits,
           HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    split = tl.program_id(1)
    base = x_ptr + n.to(tl.int64) * HW * C
    cs = tl.arange(0, BLOCK_C)
    c_live = cs < C
    first_c = (cs // channels_per_group) * channels_per_group
    shift = tl.load(base + first_c, mask=c_live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        shift += tl.load(pre_bias_ptr + first_c, mask=c_live, other=0.0).to(tl.float32)
        bias = tl.load(pre_bias_ptr + cs, mask=c_live, other=0.0).to(tl.float32)

    start = split * chunk
    end = tl.minimum(start + chunk, HW)
    n_full = (end - start) // BLOCK_P
    ps = tl.arange(0, BLOCK_P)
    mean = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for t in range(n_full):
        pix = start + t * BLOCK_P + ps
        v = tl.load(base + pix[:, None].to(tl.int64) * C + cs[None, :], mask=c_live[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_BIAS:
            v = rounded_like(v + bias[None, :], x_ptr)
        v -= shift[None, :]
        delta = v - mean
        mean += delta * (1.0 / (t + 1.0))
        m2 += delta * (v - mean)
    count = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32) + n_full.to(tl.float32)
    pix = start + n_full * BLOCK_P + ps
    live = (pix < end)[:, None] & c_live[None, :]
    v = tl.load(base + pix[:, None].to(tl.int64) * C + cs[None, :], mask=live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = rounded_like(v + bias[None, :], x_ptr)
    v -= shift[None, :]
    count_new = count + live.to(tl.float32)
    delta = v - mean
    mean = tl.where(live, mean + delta / tl.maximum(count_new, 1.0), mean)
    m2 = tl.where(live, m2 + delta * (v - mean), m2)

    # Every channel saw the program's end - start pixels: _finalize works the count out again.
    mean, m2, _ = tl.reduce((mean, m2, count_new), 0, _welford_combine)
    out = (n * splits + split) * C + cs
    tl.store(mean_ptr + out, mean, mask=c_live)
    tl.store(m2_ptr + out, m2, mask=c_live)


@triton.jit
def _finalize(x_ptr, pre_bias_ptr, mean_ptr, m2_ptr, group_mean_ptr, group_rstd_ptr,
              HW, C, G, channels_per_group, chunk, splits, eps,
              HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_CPG: tl.constexpr):
    ng = tl.program_id(0)
    n = ng // G
    c0 = (ng % G) * channels_per_group
    ss = tl.arange(0, BLOCK_S)
    js = tl.arange(0, BLOCK_CPG)
    mean = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    count = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + ss
        live = (s < splits)[:, None] & (js < channels_per_group)[None, :]
        idx = (n * splits + s)[:, None] * C + c0 + js[None, :]
        mean_b = tl.load(mean_ptr + idx, mask=live, other=0.0)
        m2_b = tl.load(m2_ptr + idx, mask=live, other=0.0)
        pixels = tl.minimum(chunk, HW - s * chunk).to(tl.float32)
        count_b = tl.where(live, pixels[:, None], 0.0)
        mean, m2, count = _welford_combine(mean, m2, count, mean_b, m2_b, count_b)
    mean, m2, count = tl.reduce((mean, m2, count), 1, _welford_combine)
    mean, m2, count = tl.reduce((mean, m2, count), 0, _welford_combine)
    first = tl.load(x_ptr + n.to(tl.int64) * HW * C + c0).to(tl.float32)  # the stats pass's shift
    if HAS_BIAS:
        first += tl.load(pre_bias_ptr + c0).to(tl.float32)
    tl.store(group_mean_ptr + ng, mean + first)
    tl.store(group_rstd_ptr + ng, tl.rsqrt(m2 / count + eps))  # biased variance, as torch's GroupNorm


@triton.jit
def _apply(x_ptr, pre_bias_ptr, y_ptr, w_ptr, b_ptr, group_mean_ptr, group_rstd_ptr,
           HW, C, G, channels_per_group, tiles_per_program,
           HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    n = tl.program_id(0)
    cs = tl.arange(0, BLOCK_C)
    c_live = cs < C
    group = n * G + cs // channels_per_group
    mean = tl.load(group_mean_ptr + group, mask=c_live, other=0.0)
    scale = tl.load(w_ptr + cs, mask=c_live, other=0.0).to(tl.float32) * tl.load(group_rstd_ptr + group, mask=c_live,
                                                                                other=0.0)
    shift = tl.load(b_ptr + cs, mask=c_live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(pre_bias_ptr + cs, mask=c_live, other=0.0).to(tl.float32)
    base = n.to(tl.int64) * HW * C
    first = tl.program_id(1) * tiles_per_program
    ps = tl.arange(0, BLOCK_P)
    for t in range(first, first + tiles_per_program):
        pix = t * BLOCK_P + ps
        m = (pix < HW)[:, None] & c_live[None, :]
        offs = base + pix[:, None].to(tl.int64) * C + cs[None, :]
        v = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = rounded_like(v + bias[None, :], x_ptr)
        y = (v - mean[None, :]) * scale[None, :] + shift[None, :]
        y = y * tl.sigmoid(y)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def _launch_config(x: torch.Tensor) -> tuple[int, int, int]:
    """(block_p, block_c, warps) of a [pixels, channels] tile for x's channels."""
    block_c = triton.next_power_of_2(x.shape[1])
    block_p = max(1, _TILE // block_c)
    return block_p, block_c, 8 if block_p * block_c >= 2048 else 4


def group_stats_nhwc(x: torch.Tensor, num_groups: int, eps: float, pre_bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """GroupNorm's statistics of a channels_last [N, C, H, W] x (+ pre_bias): [2, N * num_groups]
    fp32, each sample's and group's mean and 1/std (biased variance), read in x's own dtype (the
    stats and finalize passes)."""
    N, C = x.shape[0], x.shape[1]
    HW = math.prod(x.shape[2:])
    cpg = C // num_groups
    block_p, block_c, warps = _launch_config(x)
    sms = num_sms(x.device)
    # Stats: ~8 resident programs per SM, each at least a few tiles long.
    splits = max(1, min(_MAX_SPLITS, triton.cdiv(8 * sms, N), HW // (_MIN_TILES_PER_SPLIT * block_p)))
    chunk = triton.cdiv(triton.cdiv(HW, splits), block_p) * block_p
    splits = triton.cdiv(HW, chunk)
    partials = torch.empty((2, N * splits * C), device=x.device, dtype=torch.float32)
    stats = torch.empty((2, N * num_groups), device=x.device, dtype=torch.float32)
    has_bias = pre_bias is not None
    bias_arg = pre_bias if has_bias else x  # any pointer: unread without HAS_BIAS
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _stats[(N, splits)](x, bias_arg, partials[0], partials[1], HW, C, cpg, chunk, splits,
                            HAS_BIAS=has_bias, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=warps)
        _finalize[(N * num_groups,)](x, bias_arg, partials[0], partials[1], stats[0], stats[1],
                                     HW, C, num_groups, cpg, chunk, splits, eps, HAS_BIAS=has_bias,
                                     BLOCK_S=64, BLOCK_CPG=triton.next_power_of_2(cpg))
    return stats


def group_norm_silu_nhwc(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, num_groups: int, eps: float,
                         pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = silu(group_norm(x [+ pre_bias])) for a channels_last [N, C, H, W] x; y is channels_last."""
    N, C = x.shape[0], x.shape[1]
    HW = math.prod(x.shape[2:])
    weight, bias = weight.contiguous(), bias.contiguous()
    y = torch.empty_like(x, memory_format=torch.channels_last)
    if x.numel() == 0:
        return y
    block_p, block_c, warps = _launch_config(x)
    has_bias = pre_bias is not None
    pre_bias = pre_bias.contiguous() if has_bias else weight  # any pointer: unread without HAS_BIAS
    stats = group_stats_nhwc(x, num_groups, eps, pre_bias if has_bias else None)
    tiles = triton.cdiv(HW, block_p)
    per_program = max(1, min(8, tiles, (N * tiles) // (8 * num_sms(x.device))))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _apply[(N, triton.cdiv(tiles, per_program))](x, pre_bias, y, weight, bias, stats[0], stats[1],
                                                     HW, C, num_groups, C // num_groups, per_program,
                                                     HAS_BIAS=has_bias, BLOCK_P=block_p, BLOCK_C=block_c,
                                                     num_warps=warps)
    return y
