"""ResNet blocks on a reusing template edit's masked region (the convolutions' share of
InstGenIE's mask-aware editing; runtime/token_subsets.py does the transformer blocks).

Outside the transformer blocks a UNet's work is mostly its ResNet blocks (20% of SDXL's FLOPs at
1024 px, bench/micro/template_flops.py); run on every token they cap a reusing edit at about 2x
over exact at a 20% mask. A reusing row computes a ResNet block only on its mask's bounding box at
that grid, widened by `MARGIN`, and takes the rest of the block's output from the recording:

    a1 = silu(norm1(x)) on the box widened by 2      (norm1's statistics over the whole grid)
    h  = conv1(a1) + temb, on the box widened by 1   (no padding: a1 was cut wide enough)
    a2 = silu(norm2(h))                              (norm2's statistics: the recorded ones, with
                                                      the window's recorded share replaced by h's)
    y  = the recorded output, with shortcut(x) + conv2(a2) in the box

Where the widened box leaves the grid the cut is zero-padded, as the convolutions' own padding
is. The recording run keeps, beside the transformer blocks' outputs, each ResNet block's output,
norm2's statistics and, per position, each group's sums of h's deviations from its mean and of
their squares (`keys`). The sums let the box's share of the statistics be swapped for the edit's:
with the recorded statistics as they are, the tiny model lost 1.9-7.3 dB more
(bench/results/2026-11-29c-cpu). The same request again reproduces its exact edit; another
prompt's edit differs, like the transformer blocks' reuse, in what the recording stands in for.

The rows of a step share one box (the union of theirs: one convolution call each) and each keeps
its own part of it, so that an edit's result does not depend on the rows beside it.

The static form that CUDA graphs capture (`static_region`, served by token_subsets.StaticSubsets)
cannot cut a box at host offsets: each row's box is a fixed-size window (`box_side`: a fraction of
the grid's side from `BOX_SIDES`, one per height and width, part of the graph's key) placed on the
device from the row's own computed-token indices, which the static form already holds. Positions
of the window outside the row's own box keep the recording, so a row gets what the eager form
gives it alone. Where each row's window lies (`resnet_geometry`, `upsample_geometry`: gather
indices and masks) is the same for every block at a grid: it is made before the graphs run, when
a step's rows change, and the blocks' operators only read it. Made in each operator, its ~100
small kernels a block were most of a reusing step's launches (4186 at SDXL size).

The upsamplers (SDXL's two: 3.6% of a row's FLOPs, 11% of a reusing step's at a 20% mask with the
ResNet boxes) take the same way in the static form (`static_upsample`), on their input's widened
box doubled and widened by a token: beyond it their input is the recording's (the ResNet blocks'
and transformer blocks' outputs there are), so their output is too, and the box adds no
deviation. The eager form runs them whole and records their outputs (`upsample_rows`), as the
static form does under a load plan (blocks run whole change tokens beyond the box).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Tokens a ResNet block computes beyond its mask's bounding box on each side (a token partly
# masked is already in the box).
MARGIN = 1
# Recording keys: ResNet block i's output under KEY_BASE + 3i, then norm2's statistics and its
# per-position deviation sums (transformer blocks use their install index, below KEY_BASE);
# upsampler j's output under UPSAMPLE_BASE + j.
KEY_BASE = 1 << 16
UPSAMPLE_BASE = KEY_BASE + (1 << 12)

Box = tuple[int, int, int, int]  # (top, bottom, left, right) on a token grid, end-exclusive
# The static form's box sides, as fractions of a grid's side (box_side): a graph pair per height
# and width of them (per row bucket and token share), captured at first use.
BOX_SIDES = tuple(n / 8 for n in range(1, 9))


def keys(index: int) -> tuple[int, int, int]:
    """The recording keys of ResNet block `index`: its output, norm2's statistics, their maps."""
    return KEY_BASE + 3 * index, KEY_BASE + 3 * index + 1, KEY_BASE + 3 * index + 2


def upsample_key(index: int) -> int:
    """The recording key of upsampler `index`'s output."""
    return UPSAMPLE_BASE + index


def is_block_key(key: int) -> bool:
    """Whether a recording key is a transformer block's (one that a cache plan may leave out)."""
    return key < KEY_BASE


def masked_boxes(mask: torch.Tensor, levels: int) -> dict[int, Box | None]:
    """A latent-size mask [1, 1, h, w] (1: repaint) -> per level's token count (as
    token_subsets.computed_tokens), the bounding box of the tokens that cover a masked latent;
    None where there is none. Made once at admission, from the mask in host memory."""
    out = {}
    for h, w in ((mask.shape[-2] >> i, mask.shape[-1] >> i) for i in range(levels)):
        pooled = F.adaptive_max_pool2d(mask.float(), (h, w))[0, 0] > 0
        rows, cols = pooled.any(1).nonzero().reshape(-1), pooled.any(0).nonzero().reshape(-1)
        out[h * w] = None if rows.numel() == 0 else (int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1)
    return out


def plain(block) -> bool:
    """SDXL's ResNet blocks: GroupNorm, SiLU, two 3x3 convolutions, a time embedding added, an
    optional 1x1 shortcut; no resampling inside."""
    from diffusers.models.resnet import ResnetBlock2D

    return (type(block) is ResnetBlock2D and block.upsample is None and block.downsample is None
            and block.time_embedding_norm == "default" and block.time_emb_proj is not None
            and isinstance(block.norm1, torch.nn.GroupNorm) and isinstance(block.norm2, torch.nn.GroupNorm)
            and isinstance(block.nonlinearity, torch.nn.SiLU) and _conv(block.conv1, 3) and _conv(block.conv2, 3)
            and (block.conv_shortcut is None or _conv(block.conv_shortcut, 1)))


def plain_upsampler(block) -> bool:
    """SDXL's upsamplers: nearest-neighbour doubling, then a 3x3 convolution; nothing else."""
    from diffusers.models.upsampling import Upsample2D

    return (type(block) is Upsample2D and block.use_conv and not block.use_conv_transpose and block.interpolate
            and block.norm is None and block.name == "conv" and _conv(block.conv, 3))


def _conv(c, k: int) -> bool:
    return isinstance(c, torch.nn.Conv2d) and c.kernel_size == (k, k) and c.stride == (1, 1) \
        and c.padding == (k // 2, k // 2) and c.dilation == (1, 1) and c.groups == 1


def whole(block, x: torch.Tensor, temb: torch.Tensor,
          stats: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The block on every token, as diffusers' forward runs a plain one; with `stats`, also what a
    reusing row needs of norm2's input h: its statistics per row ([rows, 2, groups]: mean,
    variance) and per position each group's sums of its deviations from the mean and of their
    squares ([rows, 2, groups, H, W], fp32), from which a box's share is taken out (`corrected`)."""
    h = block.conv1(block.nonlinearity(block.norm1(x)))
    t = temb if block.skip_time_act else block.nonlinearity(temb)
    h = h + block.time_emb_proj(t)[:, :, None, None]
    kept = maps = None
    if stats:
        kept = _stats(h, block.norm2.num_groups)
        maps = _deviation_sums(h, kept[:, 0], block.norm2.num_groups)
    h = block.conv2(block.dropout(block.nonlinearity(block.norm2(h))))
    shortcut = x if block.conv_shortcut is None else block.conv_shortcut(x)
    return (shortcut + h) / block.output_scale_factor, kept, maps


def corrected(stats: torch.Tensor, maps: torch.Tensor, h: torch.Tensor, window: Box, positions: int) -> torch.Tensor:
    """norm2's statistics ([rows, 2, groups]) of an h that is the recorded one (`stats`, `maps`:
    whole's) except on `window` of the grid, where it is `h` ([rows, C, window])."""
    top, bottom, left, right = window
    new = _deviation_sums(h, stats[:, 0], stats.shape[-1]).sum((-1, -2))
    return _swapped(stats, new, maps[..., top:bottom, left:right].sum((-1, -2)), positions)


def _swapped(stats: torch.Tensor, new: torch.Tensor, old: torch.Tensor, positions: int) -> torch.Tensor:
    """norm2's statistics ([rows, 2, groups]) with a window's recorded deviation sums `old`
    ([rows, 2, groups]) replaced by `new`; `positions`: a group's elements in the whole grid."""
    mean = stats[:, 0]
    shift = (new[:, 0] - old[:, 0]) / positions
    var = stats[:, 1] + (new[:, 1] - old[:, 1]) / positions - shift * shift
    return torch.stack([mean + shift, var.clamp_min(0.0)], dim=1)


def region(block, x: torch.Tensor, temb: torch.Tensor, box: Box, recorded: torch.Tensor,
           norm2_stats: torch.Tensor, norm2_maps: torch.Tensor, own: list[Box] | None = None) -> torch.Tensor:
    """The block's output for rows whose output outside `box` is `recorded` ([rows, C', H, W]),
    computed in the box from `x` ([rows, C, H, W]) and what whole() kept of norm2's input; with
    `own` (each row's box, within `box`), computed only in each row's own."""
    top, bottom, left, right = box
    height, width = x.shape[-2:]
    a1 = _cut(x, (top - 2, bottom + 2, left - 2, right + 2),
              lambda t: block.nonlinearity(_normed(t, block.norm1, _stats(x, block.norm1.num_groups))))
    h = F.conv2d(a1, block.conv1.weight, block.conv1.bias)  # the box widened by 1, on the grid or past it
    t = temb if block.skip_time_act else block.nonlinearity(temb)
    h = h + block.time_emb_proj(t)[:, :, None, None]
    # norm2 with the recorded statistics corrected by h on the window (a box widened by 1, on the
    # grid), zero past the grid (conv2's padding)
    def window(b: Box) -> Box:
        return max(0, b[0] - 1), min(height, b[1] + 1), max(0, b[2] - 1), min(width, b[3] + 1)

    def on(w: Box, rows: slice = slice(None)) -> torch.Tensor:  # h, which starts at (top - 1, left - 1), on `w`
        return h[rows, :, w[0] - top + 1:w[1] - top + 1, w[2] - left + 1:w[3] - left + 1]

    positions = h.shape[1] // block.norm2.num_groups * height * width
    whole_window = window(box)
    if own is None:
        stats = corrected(norm2_stats, norm2_maps, on(whole_window), whole_window, positions)
    else:  # each row's own window, as it is alone
        stats = torch.cat([corrected(norm2_stats[k:k + 1], norm2_maps[k:k + 1], on(w, slice(k, k + 1)), w, positions)
                           for k, w in enumerate(map(window, own))])
    a2 = block.nonlinearity(_normed(on(whole_window), block.norm2, stats))
    r0, c0 = whole_window[0] - top + 1, whole_window[2] - left + 1
    a2 = F.pad(a2, (c0, h.shape[-1] - c0 - a2.shape[-1], r0, h.shape[-2] - r0 - a2.shape[-2]))
    y = F.conv2d(a2, block.conv2.weight, block.conv2.bias)
    shortcut = x[..., top:bottom, left:right]
    if block.conv_shortcut is not None:
        shortcut = block.conv_shortcut(shortcut)
    y = (shortcut + y) / block.output_scale_factor
    out = recorded.clone()
    if own is None:
        out[..., top:bottom, left:right] = y
        return out
    for k, (b_top, b_bottom, b_left, b_right) in enumerate(own):  # each row its own box: what it gets alone
        out[k, :, b_top:b_bottom, b_left:b_right] = y[k, :, b_top - top:b_bottom - top, b_left - left:b_right - left]
    return out


def widened(boxes: list[Box], height: int, width: int) -> Box:
    """The union of `boxes`, widened by MARGIN and kept on the grid."""
    return (max(0, min(b[0] for b in boxes) - MARGIN), min(height, max(b[1] for b in boxes) + MARGIN),
            max(0, min(b[2] for b in boxes) - MARGIN), min(width, max(b[3] for b in boxes) + MARGIN))


def box_side(fraction: float, side: int) -> int:
    """The static form's box side on a grid side of `side` tokens: `fraction` of it (rounded up)
    with MARGIN on either side, within the grid."""
    return min(side, math.ceil(fraction * side - 1e-6) + 2 * MARGIN)


def graph_box(layout, height: int, width: int, recorded: tuple[int, ...] = (KEY_BASE,)) -> tuple[float, float] | None:
    """For a step whose rows all reuse (token_subsets.graph_share), the smallest (height, width)
    fractions of BOX_SIDES whose boxes hold, at every grid of a latent of `height` x `width`, each
    row's widened box; None where a row's recording lacks one of the keys `recorded` (the first
    ResNet block's and upsampler's: recorded without them, they run whole)."""
    grids = {(height >> i) * (width >> i): (height >> i, width >> i) for i in range(8) if height >> i and width >> i}
    need = [0, 0]  # the fraction each dimension needs
    for r in layout.rows:
        if r.boxes is None or not all(r.activations.holds(r.step, key) for key in recorded):
            return None
        for tokens, box in r.boxes.items():
            if box is None:
                return None
            rows, cols = grids[tokens]
            top, bottom, left, right = widened([box], rows, cols)
            for d, (extent, side) in enumerate(((bottom - top, rows), (right - left, cols))):
                need[d] = max(need[d], next(f for f in BOX_SIDES if box_side(f, side) >= extent))
    return need[0], need[1]


def static_region(block, x: torch.Tensor, temb: torch.Tensor, geometry: list[torch.Tensor], recorded: torch.Tensor,
                  norm2_stats: torch.Tensor, norm2_maps: torch.Tensor) -> torch.Tensor:
    """region() in the static form: what each row gets alone, from fixed-size tensors and no host
    value. `geometry` (resnet_geometry's, for this grid and the bucket's box size) places each row's
    box on the grid.

    The box's work is one operator (easel::resnet_box), opaque to torch.compile: its output has
    the grid's shape whatever the box, so a compile of the reusing halves never reasons about a
    box's sides. Traced through, with the sides symbolic, SDXL's reusing encoder took 476 s to
    compile on an H200 host against 112 s without boxes, past a server's start timeout."""
    t = temb if block.skip_time_act else F.silu(temb)
    shortcut = block.conv_shortcut
    return torch.ops.easel.resnet_box(
        x, block.time_emb_proj(t), geometry, recorded, norm2_stats, norm2_maps,
        block.norm1.weight, block.norm1.bias, block.conv1.weight, block.conv1.bias,
        block.norm2.weight, block.norm2.bias, block.conv2.weight, block.conv2.bias,
        None if shortcut is None else shortcut.weight, None if shortcut is None else shortcut.bias,
        block.norm1.num_groups, block.norm2.num_groups, block.norm1.eps, block.norm2.eps,
        float(block.output_scale_factor))


def resnet_geometry(tokens: torch.Tensor, height: int, width: int, box_h: int, box_w: int) -> list[torch.Tensor]:
    """Where each row's box of `box_h` x `box_w` lies on a `height` x `width` grid, placed within the
    grid over the row's own box (its computed `tokens`, [rows, n], widened by MARGIN): the box
    widened by 2, clamped onto the grid (gather indices [rows, box_h + 4] and [rows, box_w + 4]) and
    which of it lies on the grid ([rows, box_h + 4, box_w + 4]); widened by 1, clamped, and which of
    it lies on the grid within the row's own box widened by 1; the box itself (on the grid) and which
    of it lies in the row's own box. The same for every ResNet block at a grid in a step: made
    before the graphs run, when a step's rows change (StaticSubsets.fill), not in every block's
    operator."""
    own_top, own_bottom, own_left, own_right = _own_box(tokens, height, width)
    top, left = own_top.clamp_max(height - box_h), own_left.clamp_max(width - box_w)

    def places(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top[:, None] + _reach(box_h, pad, tokens.device), left[:, None] + _reach(box_w, pad, tokens.device)

    gr, gc = places(2)
    out = [gr.clamp(0, height - 1), gc.clamp(0, width - 1), _on(gr, gc, height, width)]
    gr, gc = places(1)
    out += [gr.clamp(0, height - 1), gc.clamp(0, width - 1), _on(gr, gc, height, width)
            & _within(gr, gc, own_top - 1, own_bottom + 1, own_left - 1, own_right + 1)]
    gr, gc = places(0)
    return out + [gr, gc, _within(gr, gc, own_top, own_bottom, own_left, own_right)]


def resnet_box_body(x, temb_proj, geometry, recorded, norm2_stats, norm2_maps, norm1_weight, norm1_bias, conv1_weight,
                    conv1_bias, norm2_weight, norm2_bias, conv2_weight, conv2_bias, shortcut_weight, shortcut_bias,
                    groups1, groups2, eps1, eps2, scale):
    """static_region's box: a plain ResNet block's tensors and settings, its time embedding projected
    (easel::resnet_box's body on every device but CUDA, where plugins/resnet_box_kernel.py's Triton
    kernels run it; apart from the operator so that tests and bench/micro/box_kernels.py can run it
    on a GPU too). In place where a tensor is the body's own: each pass over a window is a kernel."""
    rows2, cols2, on2, rows1, cols1, window1, rows0, cols0, own0 = geometry
    height, width = x.shape[-2:]
    rows = _rows(x)
    a1 = _group_normed(_window(x, _at(rows, rows2, cols2)), _stats(x, groups1), eps1, norm1_weight, norm1_bias)
    F.silu(a1, inplace=True).mul_(on2[:, None])
    h = F.conv2d(a1, conv1_weight, conv1_bias).add_(temb_proj[:, :, None, None])  # the box widened by 1
    # norm2's statistics corrected on the row's own window (its box widened by 1, on the grid)
    new = _window_sums(h, norm2_stats[:, 0], groups2, window1)
    old = (_window(norm2_maps, _at(rows, rows1, cols1), layout=False) * window1[:, None, None]).sum((-1, -2))
    stats = _swapped(norm2_stats, new, old, h.shape[1] // groups2 * height * width)
    a2 = _group_normed(h, stats, eps2, norm2_weight, norm2_bias)
    F.silu(a2, inplace=True).mul_(window1[:, None])
    y = F.conv2d(a2, conv2_weight, conv2_bias)
    at = _at(rows, rows0, cols0)
    shortcut = _window(x, at)
    if shortcut_weight is not None:
        shortcut = F.conv2d(shortcut, shortcut_weight, shortcut_bias)
    y.add_(shortcut)
    if scale != 1.0:
        y.div_(scale)
    return _put_window(recorded, at, torch.where(own0[:, None], y, _window(recorded, at)))


# (the body stays a plain function beside its operator)
_resnet_box = torch.library.custom_op("easel::resnet_box", mutates_args=(), schema=(
    "(Tensor x, Tensor temb_proj, Tensor[] geometry, Tensor recorded, Tensor norm2_stats, Tensor norm2_maps, "
    "Tensor? norm1_weight, Tensor? norm1_bias, Tensor conv1_weight, Tensor? conv1_bias, Tensor? norm2_weight, "
    "Tensor? norm2_bias, Tensor conv2_weight, Tensor? conv2_bias, Tensor? shortcut_weight, Tensor? shortcut_bias, "
    "int groups1, int groups2, float eps1, float eps2, float scale) -> Tensor"))(resnet_box_body)


@_resnet_box.register_fake
def _(x, temb_proj, geometry, recorded, *rest):
    return torch.empty_like(recorded)


@_resnet_box.register_kernel("cuda")
def _(*args):  # (the operator's arguments, in its schema's order)
    from plugins import resnet_box_kernel  # (Triton: imported at a GPU's first box)

    return resnet_box_kernel.resnet_box(*args)


def upsample_side(fraction: float, side: int) -> int:
    """The static form's box side at an upsampler's output grid, for a box of `fraction` of its input
    grid's side `side`: the input box doubled and a token either side (the convolution's reach)."""
    return min(2 * side, 2 * box_side(fraction, side) + 2)


def static_upsample(block, x: torch.Tensor, geometry: list[torch.Tensor], recorded: torch.Tensor) -> torch.Tensor:
    """The upsampler `block` on each row's box of its output grid (`geometry`: upsample_geometry's),
    the rest `recorded` ([rows, C, 2H, 2W]): the box is the input grid's widened box (what the
    ResNet blocks computed), doubled and widened by a token, beyond which the input is the
    recording's and so is the output: no deviation beyond the ResNet blocks'. One operator
    (easel::upsample_box), as static_region's box."""
    return torch.ops.easel.upsample_box(x, geometry, recorded, block.conv.weight, block.conv.bias)


def upsample_geometry(tokens: torch.Tensor, height: int, width: int, box_h: int, box_w: int) -> list[torch.Tensor]:
    """Where each row's box of `box_h` x `box_w` lies on an upsampler's output grid (2 x `height` by
    2 x `width`), over the row's own box (its `tokens` on the input grid, widened by MARGIN, doubled
    and widened by 1 either side): the input positions the box widened by 1 reads ([rows, box_h +
    2], [rows, box_w + 2]: nearest-neighbour doubling, output p reads input p // 2) and which of it
    lies on the output grid; the box itself and which of it lies in the row's own box."""
    out_h, out_w = 2 * height, 2 * width
    top, bottom, left, right = _own_box(tokens, height, width)
    top, bottom = (2 * top - 1).clamp_min(0), (2 * bottom + 1).clamp_max(out_h)
    left, right = (2 * left - 1).clamp_min(0), (2 * right + 1).clamp_max(out_w)
    gr = top.clamp_max(out_h - box_h)[:, None] + _reach(box_h, 1, tokens.device)
    gc = left.clamp_max(out_w - box_w)[:, None] + _reach(box_w, 1, tokens.device)
    inner_r, inner_c = gr[:, 1:-1], gc[:, 1:-1]
    return [gr.clamp(0, out_h - 1) // 2, gc.clamp(0, out_w - 1) // 2, _on(gr, gc, out_h, out_w), inner_r, inner_c,
            _within(inner_r, inner_c, top, bottom, left, right)]


def upsample_box_body(x, geometry, recorded, weight, bias):
    """static_upsample's box (easel::upsample_box's body on every device but CUDA)."""
    source_rows, source_cols, on, box_rows, box_cols, own = geometry
    rows = _rows(x)
    cut = _window(x, _at(rows, source_rows, source_cols)).mul_(on[:, None])
    y = F.conv2d(cut, weight, bias)
    at = _at(rows, box_rows, box_cols)
    return _put_window(recorded, at, torch.where(own[:, None], y, _window(recorded, at)))


_upsample_box = torch.library.custom_op("easel::upsample_box", mutates_args=(), schema=(
    "(Tensor x, Tensor[] geometry, Tensor recorded, Tensor weight, Tensor? bias) -> Tensor"))(upsample_box_body)


@_upsample_box.register_fake
def _(x, geometry, recorded, weight, bias):
    return torch.empty_like(recorded)


@_upsample_box.register_kernel("cuda")
def _(*args):
    from plugins import resnet_box_kernel

    return resnet_box_kernel.upsample_box(*args)


def _own_box(tokens: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, ...]:
    """Each row's box of its computed `tokens` ([rows, n] on a height x width grid), widened by
    MARGIN within the grid: (top, bottom, left, right), each [rows] (widened(), on the device)."""
    r, c = tokens // width, tokens % width
    return ((r.amin(1) - MARGIN).clamp_min(0), (r.amax(1) + 1 + MARGIN).clamp_max(height),
            (c.amin(1) - MARGIN).clamp_min(0), (c.amax(1) + 1 + MARGIN).clamp_max(width))


def _reach(side, pad: int, device: torch.device) -> torch.Tensor:
    """arange(-pad, side + pad): a box side's offsets, widened by `pad` either way."""
    return torch.arange(-pad, side + pad, device=device)


def _on(gr: torch.Tensor, gc: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[rows, len(gr), len(gc)]: whether each (row, column) of a window lies on the grid."""
    return ((gr >= 0) & (gr < height))[:, :, None] & ((gc >= 0) & (gc < width))[:, None, :]


def _within(gr: torch.Tensor, gc: torch.Tensor, top, bottom, left, right) -> torch.Tensor:
    """[rows, len(gr), len(gc)]: whether each (row, column) of a window lies in [top, bottom) x
    [left, right) (each [rows])."""
    return (((gr >= top[:, None]) & (gr < bottom[:, None]))[:, :, None]
            & ((gc >= left[:, None]) & (gc < right[:, None]))[:, None, :])


def _channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


def zeros_as(x: torch.Tensor, shape: tuple) -> torch.Tensor:
    """Zeros of `shape` in x's dtype, device and memory format."""
    fmt = torch.channels_last if _channels_last(x) else torch.contiguous_format
    return torch.zeros(shape, dtype=x.dtype, device=x.device).contiguous(memory_format=fmt)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x's row numbers [rows, 1, 1], the first of a window's indices (`_at`)."""
    return torch.arange(x.shape[0], device=x.device)[:, None, None]


def _at(rows: torch.Tensor, gr: torch.Tensor, gc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The indices of each row's window of grid rows `gr` [rows, h] and columns `gc` [rows, w] (on
    the grid), for `_window` and `_put_window`. In two dimensions: no product of the window's sides
    is unflattened, which a compile with the sides symbolic would have to prove divisible."""
    return rows, gr[:, :, None], gc[:, None, :]


def _window(x: torch.Tensor, at: tuple[torch.Tensor, ...], layout: bool = True) -> torch.Tensor:
    """x [rows, ..., H, W] on each row's window `at`: [rows, ..., h, w], in x's layout (`layout`:
    else in whichever the gather gives, for a window only summed)."""
    rows, gr, gc = at
    # advanced indices around the middle dimensions: [rows, h, w, ...], then the grid moved back
    y = x[rows, ..., gr, gc].movedim((1, 2), (-2, -1))
    return y if not layout or _channels_last(x) else y.contiguous()


def _put_window(x: torch.Tensor, at: tuple[torch.Tensor, ...], y: torch.Tensor) -> torch.Tensor:
    """x [rows, C, H, W] with `y` [rows, C, h, w] on each row's window `at` (each position once),
    in x's layout."""
    grid = x.permute(0, 2, 3, 1)  # (a view: index_put keeps its strides, so x's layout)
    return grid.index_put(at, y.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _cut(x: torch.Tensor, window: Box, fn) -> torch.Tensor:
    """fn(x) on `window` of x's grid (which may reach past it), zero past the grid."""
    top, bottom, left, right = window
    height, width = x.shape[-2:]
    inner = fn(x[..., max(0, top):min(height, bottom), max(0, left):min(width, right)])
    return F.pad(inner, (max(0, -left), max(0, right - width), max(0, -top), max(0, bottom - height)))


def _deviation_sums(h: torch.Tensor, mean: torch.Tensor, groups: int) -> torch.Tensor:
    """Per position, each group's sum of h's deviations from `mean` ([rows, groups]) and of their
    squares: [rows, 2, groups, H, W], fp32."""
    d = h.float().unflatten(1, (groups, h.shape[1] // groups)) - mean.reshape(*mean.shape, 1, 1, 1)
    return torch.stack([d.sum(2), (d * d).sum(2)], dim=1)


def _window_sums(h: torch.Tensor, mean: torch.Tensor, groups: int, window: torch.Tensor) -> torch.Tensor:
    """Each group's sums of h's deviations from `mean` ([rows, groups]) and of their squares over the
    positions `window` ([rows, H, W], bool) holds: [rows, 2, groups], fp32 (the window's part of
    _deviation_sums' maps, without making them)."""
    rows, channels = h.shape[:2]
    d = (h - _per_channel(mean, channels)).mul_(window[:, None])  # fp32: the mean's dtype
    d = d.unflatten(1, (groups, channels // groups))
    dims = tuple(range(2, d.dim()))
    return torch.stack([d.sum(dims), torch.linalg.vector_norm(d, 2, dims).square()], dim=1)


def _per_channel(values: torch.Tensor, channels: int) -> torch.Tensor:
    """[rows, groups] -> [rows, channels, 1, 1]: each channel its group's value."""
    return values.repeat_interleave(channels // values.shape[1], dim=1)[:, :, None, None]


def _stats(h: torch.Tensor, groups: int) -> torch.Tensor:
    """GroupNorm's statistics per row: [rows, 2, groups] (mean, biased variance), in fp32 (over a
    view of the groups: in channels_last, a reshape to [rows, groups, -1] would copy)."""
    g = h.float().unflatten(1, (groups, h.shape[1] // groups))
    var, mean = torch.var_mean(g, dim=tuple(range(2, g.dim())), correction=0)
    return torch.stack([mean, var], dim=1)


def _normed(t: torch.Tensor, norm: torch.nn.GroupNorm, stats: torch.Tensor) -> torch.Tensor:
    """`norm` applied to `t` (a cut of the grid) with the whole grid's statistics."""
    return _group_normed(t, stats, norm.eps, norm.weight, norm.bias)


def _group_normed(t: torch.Tensor, stats: torch.Tensor, eps: float, weight: torch.Tensor | None,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """GroupNorm of `t` with the statistics `stats` ([rows, 2, groups]) and the affine `weight`
    and `bias` (None: none): one scale and shift per row and channel (fp32), applied in one pass
    that writes t's dtype and layout."""
    channels = t.shape[1]
    scale = _per_channel(torch.rsqrt(stats[:, 1] + eps), channels)
    shift = -_per_channel(stats[:, 0], channels) * scale
    if weight is not None:
        w = weight.reshape(1, channels, 1, 1)
        scale, shift = scale * w, shift * w + bias.reshape(1, channels, 1, 1)
    return torch.addcmul(shift, t, scale, out=torch.empty_like(t))


def run_rows(block, layout, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """Every row of the step (a TokenLayout) through the ResNet block `block`: REUSE rows whose
    recording holds it on their shared box, the others whole (RECORD rows' outputs and norm2
    statistics kept)."""
    from diffusers.models.resnet import ResnetBlock2D

    from backends.core.runtime.token_subsets import RECORD, REUSE

    context = block._subset_context
    out_key, stats_key, maps_key = keys(block._resnet_index)
    height, width = x.shape[-2:]
    tokens = height * width
    rows = layout.rows
    reuse = tuple(i for i, r in enumerate(rows) if r.role == REUSE and r.boxes is not None
                  and r.boxes.get(tokens) is not None and r.activations.holds(r.step, out_key))
    rest = tuple(i for i in range(len(rows)) if i not in reuse)
    own = [widened([rows[i].boxes[tokens]], height, width) for i in reuse]
    box = (min(b[0] for b in own), max(b[1] for b in own), min(b[2] for b in own), max(b[3] for b in own)) \
        if own else None  # (the union of the rows' widened boxes)
    reusing = sum(r.role == REUSE for r in rows)
    context.conv_computed += len(reuse) * ((box[1] - box[0]) * (box[3] - box[2]) if box else 0) \
        + (reusing - len(reuse)) * tokens
    context.conv_all += reusing * tokens
    record = [i for i in rest if rows[i].role == RECORD]
    if not reuse and not record:
        return ResnetBlock2D.forward(block, x, temb)
    kept_keys = (out_key, stats_key, maps_key)
    if not reuse:
        return _kept(rows, rest, record, kept_keys, whole(block, x, temb, stats=True))
    out = None
    if rest:
        idx = layout.index(rest, x.device)
        y = _kept(rows, rest, record, kept_keys,
                  whole(block, x.index_select(0, idx), temb.index_select(0, idx), stats=bool(record)))
        out = y.new_empty((x.shape[0], *y.shape[1:]))
        out.index_copy_(0, idx, y)
    idx = layout.index(reuse, x.device)
    recorded, stats, maps = (torch.stack([rows[i].activations.get(rows[i].step, key, rows[i].row) for i in reuse])
                             for key in kept_keys)
    # One box for the step (one call per convolution); each row keeps only its own, so that what it
    # gets does not depend on the rows beside it.
    y = region(block, x.index_select(0, idx), temb.index_select(0, idx), box, recorded, stats, maps,
               None if all(b == box for b in own) else own)
    if out is None:
        return y
    out.index_copy_(0, idx, y)
    return out


def upsample_rows(block, layout, x: torch.Tensor) -> torch.Tensor:
    """Every row of the step through the upsampler `block`, whole (a REUSE row's output outside its
    box is the recording's anyway: static_upsample), RECORD rows' outputs kept."""
    from diffusers.models.upsampling import Upsample2D

    from backends.core.runtime.token_subsets import RECORD

    y = Upsample2D.forward(block, x)
    for k, r in enumerate(layout.rows):
        if r.role == RECORD:
            r.activations.put(r.step, upsample_key(block._upsample_index), r.row, y[k])
    return y


def _kept(rows, positions, record, keys_, outputs) -> torch.Tensor:
    """whole()'s `outputs` (the block's output, norm2's statistics and maps) of the rows at
    `positions`, kept for those in `record`; the output."""
    for k, i in enumerate(positions):
        if i in record:
            r = rows[i]
            for key, t in zip(keys_, outputs):
                r.activations.put(r.step, key, r.row, t[k])
    return outputs[0]
