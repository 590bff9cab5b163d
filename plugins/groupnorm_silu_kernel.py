"""silu(group_norm(x)) in Triton's kernel language: two launches, no intermediate tensor. This
module holds the NCHW kernels; channels_last inputs go to groupnorm_silu_nhwc_kernel.

SDXL has few (sample, group) pairs (2 x 32 = 64) but large groups (up to 2^24 elements in the
VAE decoder), so one program per group would leave most SMs idle and hold a whole group in
registers. Instead:

1. `_partial_stats`: grid (N*G, splits). Each program folds a contiguous chunk of one group
   into (mean, M2, count) with per-lane Welford updates (no cross-lane reduction in the loop,
   no cancellation of a naive sum of squares), then merges its lanes (Chan's formula).
2. `_apply`: grid (N*C, HW tiles). Each program merges its group's few partials (cheap, from
   L2), then normalizes, applies the channel's affine and SiLU in fp32, and writes once.

Both passes work on x minus the group's first element: where |mean| >> std, an fp32 running
mean near the true one would carry rounding errors of ulp(mean), large against std.

With `pre_bias` the norm is of x + pre_bias[c] (a convolution's bias, left out of the convolution
so that it costs no pass of its own), rounded to x's dtype as the materialized sum would be.

Traffic: x read twice, y written once (torch's unfused path also writes and re-reads the
GroupNorm output). Importing this module needs `triton`; plugins.ops imports it lazily.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import triton
import triton.language as tl

_STATS_BLOCK = 2048  # elements per loop step of the stats pass (8 warps x 8 lanes' worth)
_APPLY_BLOCK = 2048
_MAX_SPLITS = 64  # the apply pass merges at most this many partials per group
_MIN_TILES_PER_SPLIT = 4  # a stats program shorter than this is mostly launch and merge overhead


@triton.jit
def _welford_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    n = n_a + n_b
    w_b = tl.where(n == 0, 0.0, n_b / tl.maximum(n, 1.0))
    delta = mean_b - mean_a
    return mean_a + delta * w_b, m2_a + m2_b + delta * delta * n_a * w_b, n


@triton.jit
def rounded_like(v, ptr):
    """fp32 `v` rounded to the element type of `ptr` and back: what torch's materialized tensor of
    that dtype would hold (x + a convolution's bias, say), for the fp32 arithmetic after it."""
    return v.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _partial_stats(x_ptr, pre_bias_ptr, mean_ptr, m2_ptr, count_ptr, group_numel, chunk, splits,
                   C, HW, channels_per_group, G, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    group = tl.program_id(0)
    split = tl.program_id(1)
    base = x_ptr + group.to(tl.int64) * group_numel
    c0 = (group % G) * channels_per_group  # the group's first channel
    shift = tl.load(base).to(tl.float32)
    if HAS_BIAS:
        shift += tl.load(pre_bias_ptr + c0).to(tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, group_numel)
    n_full = (end - start) // BLOCK
    lanes = tl.arange(0, BLOCK)

    mean = tl.zeros([BLOCK], dtype=tl.float32)
    m2 = tl.zeros([BLOCK], dtype=tl.float32)
    # Full tiles: every lane has seen the same count, so one scalar reciprocal per step.
    for t in range(n_full):
        offs = start + t * BLOCK + lanes
        v = tl.load(base + offs).to(tl.float32)
        if HAS_BIAS:
            v = rounded_like(v + tl.load(pre_bias_ptr + c0 + offs // HW).to(tl.float32), x_ptr)
        v -= shift
        delta = v - mean
        mean += delta * (1.0 / (t + 1.0))
        m2 += delta * (v - mean)
    count = tl.zeros([BLOCK], dtype=tl.float32) + n_full.to(tl.float32)
    # Tail tile: only some lanes get one more element.
    offs = start + n_full * BLOCK + lanes
    live = offs < end
    v = tl.load(base + offs, mask=live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = rounded_like(v + tl.load(pre_bias_ptr + c0 + offs // HW, mask=live, other=0.0).to(tl.float32), x_ptr)
    v -= shift
    count_new = count + live.to(tl.float32)
    delta = v - mean
    mean = tl.where(live, mean + delta / tl.maximum(count_new, 1.0), mean)
    m2 = tl.where(live, m2 + delta * (v - mean), m2)

    mean, m2, count = tl.reduce((mean, m2, count_new), 0, _welford_combine)
    out = group * splits + split
    tl.store(mean_ptr + out, mean)
    tl.store(m2_ptr + out, m2)
    tl.store(count_ptr + out, count)


@triton.jit
def _merged(x_ptr, mean_ptr, m2_ptr, count_ptr, group, group_numel, splits, BLOCK_S: tl.constexpr):
    """A group's (mean, M2, count) merged from its splits' partials, and the stats pass's shift
    (the group's first element), which the mean is relative to."""
    s = tl.arange(0, BLOCK_S)
    live = s < splits
    part = group * splits + s
    mean, m2, count = tl.reduce(
        (tl.load(mean_ptr + part, mask=live, other=0.0),
         tl.load(m2_ptr + part, mask=live, other=0.0),
         tl.load(count_ptr + part, mask=live, other=0.0)),
        0, _welford_combine)
    return mean, m2, count, tl.load(x_ptr + group.to(tl.int64) * group_numel).to(tl.float32)


@triton.jit
def _apply(x_ptr, pre_bias_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, m2_ptr, count_ptr,
           C, HW, channels_per_group, G, group_numel, splits, tiles_per_program, eps,
           HAS_BIAS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # n * C + c
    n = row // C
    c = row % C
    group = n * G + c // channels_per_group
    mean, m2, count, first = _merged(x_ptr, mean_ptr, m2_ptr, count_ptr, group, group_numel, splits, BLOCK_S)
    if HAS_BIAS:
        first += tl.load(pre_bias_ptr + (c // channels_per_group) * channels_per_group).to(tl.float32)
        x_bias = tl.load(pre_bias_ptr + c).to(tl.float32)
    mean += first
    rstd = tl.rsqrt(m2 / count + eps)  # biased variance, as torch's GroupNorm
    scale = tl.load(w_ptr + c).to(tl.float32) * rstd
    shift = tl.load(b_ptr + c).to(tl.float32)

    base = row.to(tl.int64) * HW
    first = tl.program_id(1) * tiles_per_program
    for t in range(first, first + tiles_per_program):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        m = offs < HW
        v = tl.load(x_ptr + base + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            v = rounded_like(v + x_bias, x_ptr)
        y = (v - mean) * scale + shift
        y = y * tl.sigmoid(y)
        tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _group_totals(x_ptr, mean_ptr, m2_ptr, count_ptr, out_ptr, groups, group_numel, splits, eps,
                  BLOCK_S: tl.constexpr):
    """out[0, group], out[1, group]: a group's mean and 1/std from its splits' partials (the
    statistics alone, without the apply pass)."""
    group = tl.program_id(0)
    mean, m2, count, first = _merged(x_ptr, mean_ptr, m2_ptr, count_ptr, group, group_numel, splits, BLOCK_S)
    tl.store(out_ptr + group, mean + first)
    tl.store(out_ptr + groups + group, tl.rsqrt(m2 / count + eps))  # biased variance, as torch's GroupNorm


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (TRITON_INTERPRET=1) on CPU: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def group_norm_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           num_groups: int, eps: float, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The NCHW Triton path of easel::group_norm_silu: y contiguous; x of any other layout is
    copied to NCHW first (plugins.ops sends channels_last inputs to the NHWC kernels instead)."""
    N, C = x.shape[0], x.shape[1]
    HW = math.prod(x.shape[2:])
    x = x.contiguous()
    weight, bias = weight.contiguous(), bias.contiguous()
    y = torch.empty_like(x)
    if x.numel() == 0:
        return y
    group_numel = (C // num_groups) * HW
    sms = num_sms(x.device)
    has_bias = pre_bias is not None
    pre_bias = pre_bias.contiguous() if has_bias else weight  # any pointer: unread without HAS_BIAS
    partials, splits = _partial_stats_of(x, num_groups, pre_bias if has_bias else None)

    # Apply: one channel row per program axis 0; several tiles per program when there are
    # plenty, so each program's merge of the partials is amortized.
    apply_block = min(_APPLY_BLOCK, triton.next_power_of_2(HW))
    tiles = triton.cdiv(HW, apply_block)
    per_program = max(1, min(8, tiles, (N * C * tiles) // (8 * sms)))
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _apply[(N * C, triton.cdiv(tiles, per_program))](
            x, pre_bias, y, weight, bias, partials[0], partials[1], partials[2],
            C, HW, C // num_groups, num_groups, group_numel, splits, per_program, eps,
            HAS_BIAS=has_bias, BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK=apply_block,
            num_warps=8 if apply_block >= 2048 else 4)
    return y


def _partial_stats_of(x: torch.Tensor, num_groups: int, pre_bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, int]:
    """The stats pass over a contiguous x: partials [3, N * num_groups * splits] (mean, M2, count
    of each group's splits, shifted by the group's first element) and the number of splits."""
    N, C = x.shape[0], x.shape[1]
    HW = math.prod(x.shape[2:])
    group_numel = (C // num_groups) * HW
    if group_numel >= 2**30:  # offsets inside a group are int32 (whole-tensor ones are int64)
        raise ValueError(f"group_norm_silu: groups of {group_numel} elements are over the kernel's 2^30")
    # Aim for ~8 resident programs per SM, each at least a few tiles long.
    block = min(_STATS_BLOCK, triton.next_power_of_2(group_numel))
    groups = N * num_groups
    splits = max(1, min(_MAX_SPLITS, triton.cdiv(8 * num_sms(x.device), groups),
                        group_numel // (_MIN_TILES_PER_SPLIT * block)))
    chunk = triton.cdiv(triton.cdiv(group_numel, splits), block) * block
    splits = triton.cdiv(group_numel, chunk)  # rounding the chunk up may leave fewer
    partials = torch.empty((3, groups * splits), device=x.device, dtype=torch.float32)
    has_bias = pre_bias is not None
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _partial_stats[(groups, splits)](
            x, pre_bias if has_bias else x, partials[0], partials[1], partials[2], group_numel, chunk, splits,
            C, HW, C // num_groups, num_groups,
            HAS_BIAS=has_bias, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return partials, splits


def group_stats_nchw(x: torch.Tensor, num_groups: int, eps: float) -> torch.Tensor:
    """GroupNorm's statistics of a contiguous (NCHW) x [N, C, *spatial]: [2, N * num_groups] fp32,
    each sample's and group's mean and 1/std (biased variance), read in x's own dtype, each group's
    elements contiguous (plugins/groupnorm_silu_nhwc_kernel.group_stats_nhwc reads a channels_last x)."""
    N, C = x.shape[0], x.shape[1]
    partials, splits = _partial_stats_of(x, num_groups)
    out = torch.empty((2, N * num_groups), device=x.device, dtype=torch.float32)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _group_totals[(N * num_groups,)](x, partials[0], partials[1], partials[2], out, N * num_groups,
                                         (C // num_groups) * math.prod(x.shape[2:]), splits, eps,
                                         BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out
