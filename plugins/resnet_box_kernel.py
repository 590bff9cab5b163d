"""A ResNet block's and an upsampler's box in Triton's kernel language: the CUDA implementations of
easel::resnet_box and easel::upsample_box (backends/core/runtime/conv_subsets.py holds the math, its
torch form, which every other device runs, and the geometry these read).

As torch operators the box's passes over its windows (gathers, GroupNorm's scale and shift, SiLU,
masks, the deviation sums, the scatter into the recording) were about 75 kernels a block and took
longer than its two convolutions at SDXL's sizes on an H200. Here each pass is one kernel, around
cuDNN's convolutions:

1. norm1's statistics over x's whole grid (groupnorm_silu_nhwc_kernel's passes for a channels_last x,
   groupnorm_silu_kernel's, whose groups are contiguous, for an NCHW one);
2. `_window`: each row's window of x gathered, normalized, SiLU, masked            -> conv1;
3. `_window_sums`: per row and channel, the deviation sums of h (+ the time embedding) on the row's
   own window, and norm2's recorded per-position sums there, as per-program partials that
   `_window_totals` sums per group in a fixed order (deterministic);
4. `_window` again: h normalized with norm2's statistics corrected by those sums (worked out per
   channel in the kernel: conv_subsets._swapped), SiLU, masked                      -> conv2;
5. `_place`: conv2's output and the shortcut added, scaled and written into a copy of the recording
   on each row's own box.

Every tensor is read through its strides, so any memory layout works; in channels_last a tile's
channels are contiguous. A window is written in the layout of the convolution's weight that reads it
(x may come in NCHW: SDXL's transformer models return NCHW beside channels_last weights, and cuDNN
would copy an NCHW input of an NHWC convolution). Sums and normalization run in fp32, and where the
torch form materializes a tensor in the activations' dtype (h + the time embedding, output +
shortcut) the value is rounded to it the same way.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from plugins.groupnorm_silu_kernel import group_stats_nchw, num_sms, rounded_like
from plugins.groupnorm_silu_nhwc_kernel import group_stats_nhwc

_TILE = 4096  # elements of a [positions, channels] tile
_MAX_BLOCK_C = 128
_SUMS_TILE = 2048


@triton.jit
def _window(src, out, rows_idx, cols_idx, on, mean_ptr, rstd_ptr, stats_ptr, new_ptr, old_ptr, w_ptr, b_ptr, pre_ptr,
            C, G, cpg, bw, n_pos, positions, eps, s_n, s_c, s_h, s_w, o_n, o_c, o_h, o_w,
            GATHER: tl.constexpr, NORM: tl.constexpr, AFFINE: tl.constexpr, PRE: tl.constexpr, MASK: tl.constexpr,
            BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[r, :, i, j] = silu(norm(src[r, :, rows[r, i], cols[r, j]])) where on[r, i, j], else 0.
    NORM 0: no normalization (nor SiLU); 1: with the given statistics; 2: norm2's recorded ones
    corrected by a window's deviation sums."""
    r = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_p = p < n_pos
    live_c = c < C
    live = live_p[:, None] & live_c[None, :]
    i = p // bw
    j = p % bw
    if GATHER:
        gi = tl.load(rows_idx + r * (n_pos // bw) + i, mask=live_p, other=0)
        gj = tl.load(cols_idx + r * bw + j, mask=live_p, other=0)
    else:
        gi = i
        gj = j
    at = (r.to(tl.int64) * s_n + c[None, :].to(tl.int64) * s_c + gi[:, None].to(tl.int64) * s_h
          + gj[:, None].to(tl.int64) * s_w)
    v = tl.load(src + at, mask=live, other=0.0).to(tl.float32)
    if PRE:
        v = rounded_like(v + tl.load(pre_ptr + r * C + c, mask=live_c, other=0.0).to(tl.float32)[None, :], src)
    if NORM == 1:
        g = r * G + c // cpg
        mean = tl.load(mean_ptr + g, mask=live_c, other=0.0)
        rstd = tl.load(rstd_ptr + g, mask=live_c, other=0.0)
    if NORM == 2:
        g = r * 2 * G + c // cpg
        d_sum = tl.load(new_ptr + g, mask=live_c, other=0.0) - tl.load(old_ptr + g, mask=live_c, other=0.0)
        d_squares = tl.load(new_ptr + g + G, mask=live_c, other=0.0) - tl.load(old_ptr + g + G, mask=live_c, other=0.0)
        shift = d_sum / positions
        var = tl.load(stats_ptr + g + G, mask=live_c, other=0.0) + d_squares / positions - shift * shift
        mean = tl.load(stats_ptr + g, mask=live_c, other=0.0) + shift
        rstd = tl.rsqrt(tl.maximum(var, 0.0) + eps)
    if NORM > 0:
        v = (v - mean[None, :]) * rstd[None, :]
        if AFFINE:
            v = (v * tl.load(w_ptr + c, mask=live_c, other=0.0).to(tl.float32)[None, :]
                 + tl.load(b_ptr + c, mask=live_c, other=0.0).to(tl.float32)[None, :])
        v = v * tl.sigmoid(v)
    if MASK:
        keep = tl.load(on + r * n_pos + p, mask=live_p, other=0) != 0
        v = tl.where(keep[:, None], v, 0.0)
    at = (r.to(tl.int64) * o_n + c[None, :].to(tl.int64) * o_c + i[:, None].to(tl.int64) * o_h
          + j[:, None].to(tl.int64) * o_w)
    tl.store(out + at, v.to(out.dtype.element_ty), mask=live)


@triton.jit
def _window_sums(h, pre_ptr, stats_ptr, window, maps, rows_idx, cols_idx, part_h, part_m,
                 C, G, cpg, bw, n_pos, chunk, splits, HW, W, s_n, s_c, s_h, s_w,
                 BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per row and split of the window's positions: each channel's sums of (h + pre - its group's
    recorded mean) and of their squares where window[r, i, j] ([2, C] into part_h), and the sums of
    norm2's recorded per-position maps [2, G, H, W] at (rows[r, i], cols[r, j]) there ([2 * G] into
    part_m)."""
    r = tl.program_id(0)
    split = tl.program_id(1)
    cs = tl.arange(0, BLOCK_C)
    live_c = cs < C
    ks = tl.arange(0, BLOCK_K)
    live_k = ks < 2 * G
    mean = tl.load(stats_ptr + r * 2 * G + cs // cpg, mask=live_c, other=0.0)
    pre = tl.load(pre_ptr + r * C + cs, mask=live_c, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    acc_m = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    first = split * chunk
    end = tl.minimum(first + chunk, n_pos)
    for start in range(first, end, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        live_p = p < end
        i = p // bw
        j = p % bw
        sel = live_p & (tl.load(window + r * n_pos + p, mask=live_p, other=0) != 0)
        at = (r.to(tl.int64) * s_n + cs[None, :].to(tl.int64) * s_c + i[:, None].to(tl.int64) * s_h
              + j[:, None].to(tl.int64) * s_w)
        both = sel[:, None] & live_c[None, :]
        v = rounded_like(tl.load(h + at, mask=both, other=0.0).to(tl.float32) + pre[None, :], h)
        d = tl.where(both, v - mean[None, :], 0.0)
        acc += d
        acc2 += d * d
        gi = tl.load(rows_idx + r * (n_pos // bw) + i, mask=live_p, other=0)
        gj = tl.load(cols_idx + r * bw + j, mask=live_p, other=0)
        at = r.to(tl.int64) * 2 * G * HW + ks[None, :].to(tl.int64) * HW + (gi * W + gj)[:, None].to(tl.int64)
        acc_m += tl.load(maps + at, mask=sel[:, None] & live_k[None, :], other=0.0)
    out = (r * splits + split) * 2 * C + cs
    tl.store(part_h + out, tl.sum(acc, 0), mask=live_c)
    tl.store(part_h + out + C, tl.sum(acc2, 0), mask=live_c)
    tl.store(part_m + (r * splits + split) * 2 * G + ks, tl.sum(acc_m, 0), mask=live_k)


@triton.jit
def _window_totals(part_h, part_m, new_ptr, old_ptr, C, G, cpg, splits, BLOCK_S: tl.constexpr,
                   BLOCK_CPG: tl.constexpr):
    """new[r, :, g], old[r, :, g]: _window_sums' partials of a row's group summed over its splits
    (and, for h's, over the group's channels), in a fixed order."""
    r = tl.program_id(0) // G
    g = tl.program_id(0) % G
    ss = tl.arange(0, BLOCK_S)
    js = tl.arange(0, BLOCK_CPG)
    acc = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_S, BLOCK_CPG], dtype=tl.float32)
    rec = tl.zeros([BLOCK_S], dtype=tl.float32)
    rec2 = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + ss
        live_s = s < splits
        live = live_s[:, None] & (js < cpg)[None, :]
        at = (r * splits + s)[:, None] * 2 * C + g * cpg + js[None, :]
        acc += tl.load(part_h + at, mask=live, other=0.0)
        acc2 += tl.load(part_h + at + C, mask=live, other=0.0)
        at = (r * splits + s) * 2 * G + g
        rec += tl.load(part_m + at, mask=live_s, other=0.0)
        rec2 += tl.load(part_m + at + G, mask=live_s, other=0.0)
    out = r * 2 * G + g
    tl.store(new_ptr + out, tl.sum(tl.sum(acc, 1), 0))
    tl.store(new_ptr + out + G, tl.sum(tl.sum(acc2, 1), 0))
    tl.store(old_ptr + out, tl.sum(rec, 0))
    tl.store(old_ptr + out + G, tl.sum(rec2, 0))


@triton.jit
def _place(out, y, s, rows_idx, cols_idx, own, C, bw, n_pos, scale, o_n, o_c, o_h, o_w, y_n, y_c, y_h, y_w,
           s_n, s_c, s_h, s_w, SHORTCUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """out[r, :, rows[r, i], cols[r, j]] = (y[r, :, i, j] + shortcut) / scale where own[r, i, j].
    SHORTCUT 0: none; 1: s on the grid at the same places (x itself); 2: s on the box (a
    convolution's output)."""
    r = tl.program_id(0)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    live_p = p < n_pos
    live_c = c < C
    i = p // bw
    j = p % bw
    sel = live_p & (tl.load(own + r * n_pos + p, mask=live_p, other=0) != 0)
    both = sel[:, None] & live_c[None, :]
    gi = tl.load(rows_idx + r * (n_pos // bw) + i, mask=live_p, other=0)
    gj = tl.load(cols_idx + r * bw + j, mask=live_p, other=0)
    cc = c[None, :].to(tl.int64)
    v = tl.load(y + r.to(tl.int64) * y_n + cc * y_c + i[:, None].to(tl.int64) * y_h + j[:, None].to(tl.int64) * y_w,
                mask=both, other=0.0).to(tl.float32)
    if SHORTCUT == 1:
        v += tl.load(s + r.to(tl.int64) * s_n + cc * s_c + gi[:, None].to(tl.int64) * s_h
                     + gj[:, None].to(tl.int64) * s_w, mask=both, other=0.0).to(tl.float32)
    if SHORTCUT == 2:
        v += tl.load(s + r.to(tl.int64) * s_n + cc * s_c + i[:, None].to(tl.int64) * s_h
                     + j[:, None].to(tl.int64) * s_w, mask=both, other=0.0).to(tl.float32)
    if SHORTCUT > 0:
        v = rounded_like(v, out) / scale
    at = r.to(tl.int64) * o_n + cc * o_c + gi[:, None].to(tl.int64) * o_h + gj[:, None].to(tl.int64) * o_w
    tl.store(out + at, v.to(out.dtype.element_ty), mask=both)


def _tiles(channels: int) -> tuple[int, int]:
    block_c = min(_MAX_BLOCK_C, triton.next_power_of_2(channels))
    return _TILE // block_c, block_c


def _bytes(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bytes (a view), contiguous: the kernels read it as uint8."""
    return mask.contiguous().view(torch.uint8)


def window(src: torch.Tensor, rows: torch.Tensor | None, cols: torch.Tensor | None, on: torch.Tensor | None,
           shape: tuple[int, int], reader: torch.Tensor, norm: tuple = (), weight: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, pre: torch.Tensor | None = None) -> torch.Tensor:
    """_window's output [rows, C, *shape] in src's dtype and the layout of `reader` (the weight of
    the convolution that reads it). `rows`, `cols` ([rows, h], [rows, w]): where each row's window
    lies on src's grid (None: src is the window); `on` ([rows, h, w] bool): where it is kept (None:
    everywhere); `norm`: () for none, (stats,) with stats [2, rows * G] (mean and 1/std), or (stats,
    new, old, positions, eps), each [rows, 2, G]: norm2's recorded statistics and a window's
    deviation sums, new and recorded; `pre` [rows, C]: added to src first."""
    n, C = src.shape[:2]
    bh, bw = shape
    fmt = torch.channels_last if _channels_last(reader) else torch.contiguous_format
    out = torch.empty((n, C, bh, bw), dtype=src.dtype, device=src.device, memory_format=fmt)
    if out.numel() == 0:
        return out
    stats = new = old = src  # any pointer: unread where the kind of norm does not use it
    mean = rstd = src
    positions, eps, groups = 1.0, 0.0, 1
    if len(norm) == 1:
        mean, rstd = norm[0][0], norm[0][1]
        groups = mean.numel() // n
    elif norm:
        stats, new, old, positions, eps = norm
        stats, new, old, groups = stats.contiguous(), new.contiguous(), old.contiguous(), stats.shape[-1]
    block_p, block_c = _tiles(C)
    gather = rows is not None
    with _on_device(src):
        _window[(n, triton.cdiv(bh * bw, block_p), triton.cdiv(C, block_c))](
            src, out, rows.contiguous() if gather else src, cols.contiguous() if gather else src,
            _bytes(on) if on is not None else src, mean, rstd, stats, new, old,
            weight if weight is not None else src, bias if bias is not None else src, pre if pre is not None else src,
            C, groups, C // groups, bw, bh * bw, float(positions), float(eps), *src.stride(), *out.stride(),
            GATHER=gather, NORM=min(len(norm), 2), AFFINE=weight is not None, PRE=pre is not None,
            MASK=on is not None, BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)
    return out


def window_sums(h: torch.Tensor, pre: torch.Tensor, stats: torch.Tensor, window_mask: torch.Tensor,
                maps: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old), each [rows, 2, G] fp32: the deviation sums of h + pre ([rows, C, h, w], [rows, C])
    from norm2's recorded means (`stats` [rows, 2, G]) over `window_mask`, and norm2's recorded
    per-position sums (`maps` [rows, 2, G, H, W]) over the same positions of the grid (`rows`,
    `cols`: where the window lies)."""
    n, C, bh, bw = h.shape
    G = stats.shape[-1]
    height, width = maps.shape[-2:]
    maps, stats = maps.contiguous(), stats.contiguous()
    block_c = triton.next_power_of_2(C)
    block_p = max(1, _SUMS_TILE // block_c)
    n_pos = bh * bw
    splits = max(1, min(triton.cdiv(n_pos, block_p), triton.cdiv(4 * num_sms(h.device), n)))
    chunk = triton.cdiv(triton.cdiv(n_pos, splits), block_p) * block_p
    splits = triton.cdiv(n_pos, chunk)
    part_h = torch.empty((n, splits, 2, C), dtype=torch.float32, device=h.device)
    part_m = torch.empty((n, splits, 2, G), dtype=torch.float32, device=h.device)
    new, old = torch.empty((2, n, 2, G), dtype=torch.float32, device=h.device)
    with _on_device(h):
        _window_sums[(n, splits)](h, pre, stats, _bytes(window_mask), maps, rows.contiguous(), cols.contiguous(),
                                  part_h, part_m, C, G, C // G, bw, n_pos, chunk, splits, height * width, width,
                                  *h.stride(), BLOCK_P=block_p, BLOCK_C=block_c,
                                  BLOCK_K=triton.next_power_of_2(2 * G), num_warps=8 if block_c >= 1024 else 4)
        _window_totals[(n * G,)](part_h, part_m, new, old, C, G, C // G, splits, BLOCK_S=32,
                                 BLOCK_CPG=triton.next_power_of_2(C // G))
    return new, old


def place(recorded: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, own: torch.Tensor,
          shortcut: torch.Tensor | None = None, on_grid: bool = False, scale: float = 1.0) -> torch.Tensor:
    """A copy of `recorded` ([rows, C, H, W]) with (y + shortcut) / scale (y [rows, C, h, w]) on each
    row's window (`rows`, `cols`) where `own` ([rows, h, w] bool); `shortcut`: on the grid like
    recorded (`on_grid`) or on the window like y."""
    out = recorded.clone()
    n, C, bh, bw = y.shape
    if y.numel() == 0:
        return out
    s = shortcut if shortcut is not None else y
    block_p, block_c = _tiles(C)
    with _on_device(y):
        _place[(n, triton.cdiv(bh * bw, block_p), triton.cdiv(C, block_c))](
            out, y, s, rows.contiguous(), cols.contiguous(), _bytes(own), C, bw, bh * bw, float(scale),
            *out.stride(), *y.stride(), *s.stride(), SHORTCUT=0 if shortcut is None else 1 if on_grid else 2,
            BLOCK_P=block_p, BLOCK_C=block_c, num_warps=4)
    return out


def group_stats(x: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """[2, rows * groups] fp32: each row's and group's mean and 1/std over x's whole grid."""
    return group_stats_nhwc(x, groups, eps) if _channels_last(x) else group_stats_nchw(x.contiguous(), groups, eps)


def resnet_box(x, temb_proj, geometry, recorded, norm2_stats, norm2_maps, norm1_weight, norm1_bias, conv1_weight,
               conv1_bias, norm2_weight, norm2_bias, conv2_weight, conv2_bias, shortcut_weight, shortcut_bias,
               groups1, groups2, eps1, eps2, scale):
    """conv_subsets.resnet_box_body's result, its passes as above."""
    rows2, cols2, on2, rows1, cols1, window1, rows0, cols0, own0 = geometry
    height, width = x.shape[-2:]
    a1 = window(x, rows2, cols2, on2, on2.shape[1:], conv1_weight, (group_stats(x, groups1, eps1),), norm1_weight,
                norm1_bias)
    h = F.conv2d(a1, conv1_weight, conv1_bias)  # the box widened by 1; the time embedding added where read
    new, old = window_sums(h, temb_proj, norm2_stats, window1, norm2_maps, rows1, cols1)
    positions = h.shape[1] // groups2 * height * width
    a2 = window(h, None, None, window1, h.shape[-2:], conv2_weight, (norm2_stats, new, old, positions, eps2),
                norm2_weight, norm2_bias, pre=temb_proj)
    y = F.conv2d(a2, conv2_weight, conv2_bias)
    if shortcut_weight is None:
        return place(recorded, y, rows0, cols0, own0, x, on_grid=True, scale=scale)
    # (in conv1's layout: a 1x1 weight's layout is ambiguous)
    shortcut = F.conv2d(window(x, rows0, cols0, None, own0.shape[1:], conv1_weight), shortcut_weight, shortcut_bias)
    return place(recorded, y, rows0, cols0, own0, shortcut, scale=scale)


def upsample_box(x, geometry, recorded, weight, bias):
    """conv_subsets' upsampler box (easel::upsample_box) as above."""
    source_rows, source_cols, on, box_rows, box_cols, own = geometry
    y = F.conv2d(window(x, source_rows, source_cols, on, on.shape[1:], weight), weight, bias)
    return place(recorded, y, box_rows, box_cols, own)


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def _on_device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
