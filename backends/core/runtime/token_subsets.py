"""Token subsets (InstGenIE's mask-aware editing): edits of a template compute only their masked
tokens in the UNet's transformer blocks and take the rest from the template's recorded activations.

An edit's first run records, per step and per transformer block, the block's output for every
token (`TemplateActivations`); a later edit of the same template (the same key: engine/workflows/
inpaint.py says what it covers) runs each block on its masked tokens only:

    x = the block's input (masked tokens computed, the others the previous block's recording)
    q = norm1(x)[masked];  k, v from norm1(x), every token        (self-attention)
    h = x[masked] + attn1(q, k, v);  h += attn2(norm2(h), text);  h += ff(norm3(h))
    y = the recorded output, with h in the masked tokens

So the products that grow with the tokens (Q, attention, the output projection, cross-attention,
the feed-forward) shrink to the masked share, while K and V cover every token from the block's
actual input. What is cached is the block's output Y, not K and V: InstGenIE measured both and Y
is half the bytes for a latency within 10% (its Fig. 7). The transformer models' norms and
projections around the blocks run on every token; the ResNet blocks too, or, where the runtime asks
for it (SubsetContext.convs), on the mask's bounding box (runtime/conv_subsets.py).

Reusing a recording is exact when nothing differs from the recorded run but the masked tokens'
values were the same (the same request again); otherwise the unmasked tokens' outputs are the
template's, not the edit's, and the deviation is measured, not assumed (tests/export/
test_template_cache.py).

The layout of a step (`TokenLayout`) is built from per-request indices made once at admission:
no host sync per step. Runtimes that cannot serve it refuse it (`RuntimeCaps.token_subsets`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

RECORD, REUSE, FULL = "record", "reuse", "full"


@dataclass
class TemplateActivations:
    """One template's recording: each transformer block's output at each step, every token of
    every row of the recording request. Complete once the recording request has run all its steps."""

    rows: int
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (step, block) -> [rows, L, C]
    complete: bool = False
    # On a GPU: an event after its last write on the engine's stream, which a copy made on another
    # thread's stream (the cache moving it between tiers) waits for.
    written: torch.cuda.Event | None = None
    # Kept in host memory (the template cache's lower tier): an edit reads it step by step
    # (engine/template_stream.py).
    host: bool = False
    # The host block its outputs are views of (engine/host_block.py), where the cache made one.
    block: torch.Tensor | None = None

    def put(self, step: int, block: int, row: int, output: torch.Tensor) -> None:
        kept = self.outputs.get((step, block))
        if kept is None:
            kept = self.outputs[(step, block)] = output.new_empty((self.rows, *output.shape))
        kept[row].copy_(output)

    def get(self, step: int, block: int, row: int) -> torch.Tensor:
        return self.outputs[(step, block)][row]

    def holds(self, step: int, key: int) -> bool:
        return (step, key) in self.outputs

    @property
    def nbytes(self) -> int:
        if self.block is not None:  # (its outputs and the padding between them)
            return self.block.numel()
        return sum(t.numel() * t.element_size() for t in self.outputs.values())


@dataclass(frozen=True)
class TokenRow:
    """One UNet row of a step: what it does with a template, at which step of its recording."""

    role: str  # RECORD (run every token, keep the outputs), REUSE (masked tokens only), FULL
    activations: TemplateActivations | None = None
    step: int = 0
    row: int = 0  # its row in the recording request (unconditional first, as the batch's)
    # REUSE: per token count L of a level, the [n] indices of the tokens it computes
    computed: dict[int, torch.Tensor] | None = None
    # REUSE: per token count, the bounding box of those tokens (runtime/conv_subsets.py), or None
    boxes: dict | None = None


@dataclass(frozen=True)
class TokenLayout:
    """The rows of a step, in batch order (StepBatch.tokens)."""

    rows: tuple[TokenRow, ...]
    # The blocks (their install index) in which REUSE rows take the recording; in the others they
    # run whole, exactly. None: every block (runtime/cache_plan.py decides).
    cached: frozenset[int] | None = None
    # The device indices the blocks gather with, made at their first use in the step and shared by
    # every block after it: one copy from pinned memory each, never a wait for the device.
    _indices: dict = field(default_factory=dict, compare=False, repr=False)

    def whole(self) -> "TokenLayout":
        """Every row run whole, RECORD rows still recording: for a step that cannot split its rows
        (unmerged LoRA terms are added by row ranges)."""
        return TokenLayout(tuple(TokenRow(FULL) if r.role == REUSE else r for r in self.rows), self.cached)

    @staticmethod
    def join(parts: list["TokenLayout"]) -> "TokenLayout":
        """One step's layout from its parts in batch order (one per workflow). The blocks that
        reuse: the union of the plans of the parts with REUSE rows (every block where one plans none)."""
        plans = [p.cached for p in parts if any(r.role == REUSE for r in p.rows)]
        cached = None if not plans or any(c is None for c in plans) else frozenset().union(*plans)
        return TokenLayout(tuple(r for p in parts for r in p.rows), cached)

    def split(self, cached: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(rows run whole, REUSE rows on their masked tokens) in a block where the recording is
        taken (`cached`) or not."""
        reuse = tuple(i for i, r in enumerate(self.rows) if r.role == REUSE) if cached else ()
        return tuple(i for i in range(len(self.rows)) if i not in reuse), reuse

    def index(self, positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
        key = ("rows", positions, device)
        if key not in self._indices:
            self._indices[key] = _device_index(positions, device)
        return self._indices[key]

    def masked(self, positions: tuple[int, ...], tokens: int, device: torch.device):
        """For the REUSE rows at `positions`, at a level of `tokens` tokens: each one's count of
        computed tokens, those of them that compute any (places in `positions`), their device index,
        and their tokens' indices [live, n], padded to the longest by repeating each row's last (a
        token computed twice gives the same value twice)."""
        key = ("masked", positions, tokens)
        if key not in self._indices:
            rows = [self.rows[i] for i in positions]
            counts = [r.computed[tokens].numel() for r in rows]
            live = tuple(k for k, n in enumerate(counts) if n)
            sel = idx = None
            if live:
                n = max(counts)
                idx = torch.stack([_padded(rows[k].computed[tokens], n) for k in live])
                sel = self.index(live, device)
            self._indices[key] = counts, live, sel, idx
        return self._indices[key]


def _device_index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)  # a pageable copy would wait for the stream


def computed_tokens(mask: torch.Tensor, levels: int) -> dict[int, torch.Tensor]:
    """A latent-size mask [1, 1, h, w] (1: repaint) -> per level of the UNet (the latents halved
    `level` times: the token grids its transformer blocks may run at), keyed by its token count,
    the indices of the tokens that cover any masked latent (max-pooled: a token partly masked is
    computed). Built once at admission, on the mask's device."""
    out = {}
    for h, w in ((mask.shape[-2] >> i, mask.shape[-1] >> i) for i in range(levels)):
        pooled = F.adaptive_max_pool2d(mask.float(), (h, w)).reshape(-1)
        out[h * w] = torch.nonzero(pooled > 0).reshape(-1)
    return out


def token_share(computed: dict[int, torch.Tensor]) -> float:
    """The share of tokens computed over every level of computed_tokens' (a proxy of a step's
    share of block work, which engine/step_cost.py's fit scales to time). Host-side: read once at
    admission."""
    return sum(int(indices.numel()) for indices in computed.values()) / sum(computed)


class SubsetContext:
    """What the blocks of one runtime read while it runs a step: the step's layout, or None."""

    def __init__(self, convs: bool = False):
        self.layout: TokenLayout | None = None
        self.computed_tokens = 0  # tokens the REUSE rows computed in blocks, summed (a test's and a metric's)
        self.all_tokens = 0  # the tokens those blocks would have computed
        # ResNet blocks on the REUSE rows' masked boxes (runtime/conv_subsets.py), and their positions
        # computed against those they would have
        self.convs = convs
        self.conv_computed = 0
        self.conv_all = 0
        # The recording keys a step's rows must hold for the static form's boxes
        # (conv_subsets.graph_box): the first ResNet block's and upsampler's, set at install
        self.box_keys: tuple[int, ...] = ()


def install(module: torch.nn.Module, convs: bool = False) -> SubsetContext:
    """Let every plain transformer block of `module` (a UNet, or its halves) serve token subsets,
    and with `convs` every plain ResNet block and upsampler its masked box (runtime/conv_subsets.py;
    ResNet blocks that plugins/ fused run whole, and then the upsamplers too); returns their shared
    context. Nothing else changes (only the blocks' class: weights and names stay
    diffusers')."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.resnet import ResnetBlock2D

    from backends.core.runtime import conv_subsets

    context = SubsetContext(convs)
    cls, resnet_cls, upsample_cls = _subset_block_class(), _subset_resnet_class(), _subset_upsample_class()
    index = resnets = upsamplers = 0
    # An upsampler's box holds its output's change only where every ResNet block took its box (one
    # fused by plugins/ runs whole, changing tokens beyond it)
    boxed_upsamplers = convs and all(conv_subsets.plain(b) for b in module.modules() if isinstance(b, ResnetBlock2D))
    for block in module.modules():
        if type(block) is BasicTransformerBlock and _plain(block):
            block.__class__ = cls
            block._subset_context, block._subset_index = context, index
            index += 1
        elif convs and conv_subsets.plain(block):
            block.__class__ = resnet_cls
            block._subset_context, block._resnet_index = context, resnets
            resnets += 1
        elif boxed_upsamplers and conv_subsets.plain_upsampler(block):
            block.__class__ = upsample_cls
            block._subset_context, block._upsample_index = context, upsamplers
            upsamplers += 1
    context.box_keys = ((conv_subsets.keys(0)[0],) if resnets else ()) + \
        ((conv_subsets.upsample_key(0),) if upsamplers else ())
    return context


def _plain(block) -> bool:
    """SDXL's blocks: layer norms, self- then cross-attention, a feed-forward; nothing else."""
    return (block.norm_type == "layer_norm" and block.pos_embed is None and not block.only_cross_attention
            and block.attn2 is not None and block._chunk_size is None and not hasattr(block, "fuser"))


@functools.cache  # one class: its instances share torch.compile's code
def _subset_block_class():
    from diffusers.models.attention import BasicTransformerBlock

    class SubsetBlock(BasicTransformerBlock):
        def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                    timestep=None, cross_attention_kwargs=None, class_labels=None, added_cond_kwargs=None):
            layout = self._subset_context.layout
            if layout is None or attention_mask is not None or encoder_attention_mask is not None \
                    or cross_attention_kwargs:
                return super().forward(hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask,
                                       timestep, cross_attention_kwargs, class_labels, added_cond_kwargs)
            if isinstance(layout, StaticSubsets):
                return layout.run(self, hidden_states, encoder_hidden_states)
            return _run_rows(self, layout, hidden_states, encoder_hidden_states)

    return SubsetBlock


@functools.cache
def _subset_resnet_class():
    from diffusers.models.resnet import ResnetBlock2D

    from backends.core.runtime import conv_subsets

    class SubsetResnet(ResnetBlock2D):
        def forward(self, input_tensor, temb, *args, **kwargs):
            layout = self._subset_context.layout
            if args or kwargs:
                return super().forward(input_tensor, temb, *args, **kwargs)
            if isinstance(layout, TokenLayout):
                return conv_subsets.run_rows(self, layout, input_tensor, temb)
            if isinstance(layout, StaticSubsets) and layout.boxed:
                return layout.run_resnet(self, input_tensor, temb)
            return super().forward(input_tensor, temb)  # (a static form without boxes runs it whole)

    return SubsetResnet


@functools.cache
def _subset_upsample_class():
    from diffusers.models.upsampling import Upsample2D

    from backends.core.runtime import conv_subsets

    class SubsetUpsample(Upsample2D):
        def forward(self, hidden_states, output_size=None, *args, **kwargs):
            layout = self._subset_context.layout
            if output_size is not None or args or kwargs:
                return super().forward(hidden_states, output_size, *args, **kwargs)
            if isinstance(layout, TokenLayout):
                return conv_subsets.upsample_rows(self, layout, hidden_states)
            # (under a load plan REUSE rows run some blocks whole, whose output differs from the
            # recording beyond the box too: the upsampler runs whole, as in the eager form)
            if isinstance(layout, StaticSubsets) and layout.boxed and layout.cached is None:
                return layout.run_upsample(self, hidden_states)
            return super().forward(hidden_states)

    return SubsetUpsample


def _run_rows(block, layout: TokenLayout, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Every row of the step through `block`: REUSE rows together on their masked tokens (where
    the layout takes this block from the recording), the others whole (RECORD rows' outputs kept)."""
    from diffusers.models.attention import BasicTransformerBlock

    cached = _takes(layout.cached, block._subset_index)
    whole, reuse = layout.split(cached)
    if not cached:  # REUSE rows run this block whole: every token computed
        n = sum(r.role == REUSE for r in layout.rows) * x.shape[1]
        block._subset_context.computed_tokens += n
        block._subset_context.all_tokens += n
    if not reuse:  # every row whole: nothing to gather
        return _recorded(block, layout, whole, BasicTransformerBlock.forward(block, x, encoder_hidden_states=text))
    out = torch.empty_like(x)
    if whole:
        idx = layout.index(whole, x.device)
        y = BasicTransformerBlock.forward(block, x.index_select(0, idx),
                                          encoder_hidden_states=text.index_select(0, idx))
        out.index_copy_(0, idx, _recorded(block, layout, whole, y))
    idx = layout.index(reuse, x.device)
    out.index_copy_(0, idx, masked_rows(block, layout, reuse, x.index_select(0, idx), text.index_select(0, idx)))
    return out


def _recorded(block, layout: TokenLayout, positions: tuple[int, ...], y: torch.Tensor) -> torch.Tensor:
    """`y`, the block's output for the rows at `positions`, kept for those that record."""
    for k, i in enumerate(positions):
        r = layout.rows[i]
        if r.role == RECORD:
            r.activations.put(r.step, block._subset_index, r.row, y[k])
    return y


def masked_rows(block, layout: TokenLayout, positions: tuple[int, ...], x: torch.Tensor,
                text: torch.Tensor) -> torch.Tensor:
    """The REUSE rows at `positions` of the layout ([R, L, C] each of `x` and `text`) through
    `block` at once, each computing its masked tokens only, a row with none taking the recording
    whole."""
    tokens, width = x.shape[1], x.shape[2]
    counts, live, sel, idx = layout.masked(positions, tokens, x.device)
    context = block._subset_context
    context.computed_tokens += sum(counts)
    context.all_tokens += tokens * len(positions)
    rows = [layout.rows[i] for i in positions]
    y = torch.stack([r.activations.get(r.step, block._subset_index, r.row) for r in rows])
    if not live:
        return y
    at = idx.unsqueeze(-1).expand(-1, -1, width)
    if len(live) < len(positions):
        x, text = x.index_select(0, sel), text.index_select(0, sel)
    h = _masked_tokens(block, x, text, at)
    if len(live) == len(positions):
        return y.scatter_(1, at, h)
    return y.index_copy_(0, sel, y.index_select(0, sel).scatter_(1, at, h))


def _masked_tokens(block, x: torch.Tensor, text: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """`block` on the tokens `at` ([R, n, C] gather indices) of `x`: queries, attention,
    cross-attention and feed-forward on those tokens, keys and values on every token."""
    norm = block.norm1(x)
    h = x.gather(1, at) + block.attn1(norm.gather(1, at), encoder_hidden_states=norm)
    h = h + block.attn2(block.norm2(h), encoder_hidden_states=text)
    return h + block.ff(block.norm3(h))


def _takes(cached: frozenset[int] | None, block: int) -> bool:
    """Whether REUSE rows take `block` from the recording under the plan `cached` (None: all)."""
    return cached is None or block in cached


# The token shares a reusing step is padded up to under CUDA graphs: one graph pair per share and
# row bucket (captured at first use, no compile), so padding stays within 1/16 of a level up to
# half, 1/8 above. Coarser steps above half (8/16, 12/16) padded a 35% mask's 39% of tokens to half
# and a 51% mask's 56% to three quarters, where reusing was slowest on an H200 (0.86x and 0.78x).
GRAPH_SHARES = tuple(n / 16 for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16))


def graph_share(layout: TokenLayout) -> float | None:
    """The smallest of GRAPH_SHARES that holds, at every level, every row's computed tokens (as
    ceil(share x tokens)), for a step whose rows all REUSE; None where the static form cannot
    serve it (another role, or a row computing no token at a level: it takes the recording whole,
    which only the eager form does)."""
    if not layout.rows or any(r.role != REUSE for r in layout.rows):
        return None
    counts = [(tokens, indices.numel()) for r in layout.rows for tokens, indices in r.computed.items()]
    if any(n == 0 for _, n in counts):
        return None
    return next(share for share in GRAPH_SHARES if all(n <= share_tokens(share, tokens) for tokens, n in counts))


def share_tokens(share: float, tokens: int) -> int:
    """The tokens a level of `tokens` computes per row under `share` (rounded up)."""
    return min(tokens, math.ceil(share * tokens - 1e-6))


@dataclass
class RecordedBuffers:
    """What the static forms of one row count and size share: each block's buffer of recorded
    outputs [rows, tokens, width] (and with boxes each ResNet block's, under conv_subsets.keys),
    each block's token count and each ResNet block's grid (learned at their first run)."""

    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    grids: dict[int, tuple[int, int]] = field(default_factory=dict)


class StaticSubsets:
    """A reusing step's token subsets in fixed buffers, which CUDA graphs read: per level, each
    row's token indices [rows, ceil(share x tokens)] (padded by repeating its last); per block,
    each row's recorded output (`RecordedBuffers`). The buffers are made at the first run (a
    capture's warm-up, eager); then `fill(layout)` copies a step's into them on the stream, and
    the blocks read nothing else. With `box` (conv_subsets.graph_box's fractions) the ResNet
    blocks run on boxes of those sides (conv_subsets.static_region), else whole; where each row's
    box lies at each grid is among the buffers, made again by `fill` when the rows change."""

    def __init__(self, rows: int, share: float, cached: frozenset[int] | None, context: SubsetContext,
                 buffers: RecordedBuffers, box: tuple[float, float] | None = None):
        self.rows, self.share, self.cached, self.context, self.buffers = rows, share, cached, context, buffers
        # (a flag for the blocks to test: a compile guards on what it reads, and the sides are data)
        self.box, self.boxed = box, box is not None
        self.indices: dict[int, torch.Tensor] = {}  # tokens -> [rows, n]
        # (kind, tokens) -> the boxes' places at that grid (conv_subsets.resnet_geometry's or
        # upsample_geometry's), the maker's arguments beside the indices, and its buffers, read by every
        # block at the grid: made again by `fill` when a step's rows change (sizes dynamic in a compile)
        self.geometry: dict[tuple[str, int], tuple[object, tuple, list[torch.Tensor]]] = {}
        self._placed: tuple = ()  # the rows' computed tokens the geometry was last made for

    def takes(self, block: int) -> bool:
        """Whether the recording of `block` (an install index, or a ResNet block's key) is read."""
        from backends.core.runtime.conv_subsets import is_block_key

        return _takes(self.cached, block) if is_block_key(block) else self.box is not None

    def _indices(self, tokens: int, device: torch.device) -> torch.Tensor:
        idx = self.indices.get(tokens)
        if idx is None:
            idx = self.indices[tokens] = _dynamic(torch.zeros((self.rows, share_tokens(self.share, tokens)),
                                                              dtype=torch.long, device=device), 0, 1)
        return idx

    def _buffer(self, key: int, make) -> torch.Tensor:
        """The recorded buffer of `key`, made by `make()` at its first run."""
        buf = self.buffers.outputs.get(key)
        if buf is None:
            buf = self.buffers.outputs[key] = _dynamic(make(), 0)
        return buf

    def run(self, block, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        from diffusers.models.attention import BasicTransformerBlock

        index, (tokens, width) = block._subset_index, x.shape[1:]
        self.buffers.tokens[index] = tokens
        if not self.takes(index):
            return BasicTransformerBlock.forward(block, x, encoder_hidden_states=text)
        y = self._buffer(index, lambda: torch.zeros_like(x))
        at = self._indices(tokens, x.device).unsqueeze(-1).expand(-1, -1, width)
        return y.scatter(1, at, _masked_tokens(block, x, text, at))

    def run_resnet(self, block, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """The ResNet block `block` on each row's box (conv_subsets.static_region), the rest recorded."""
        from backends.core.runtime import conv_subsets

        height, width = x.shape[-2:]
        self.buffers.grids[block._resnet_index] = (height, width)
        geometry = self._geometry("resnet", conv_subsets.resnet_geometry, conv_subsets.box_side, height, width,
                                  x.device)
        out_key, stats_key, maps_key = conv_subsets.keys(block._resnet_index)
        rows, groups = x.shape[0], block.norm2.num_groups
        recorded = self._buffer(out_key, lambda: conv_subsets.zeros_as(x, (rows, block.conv2.out_channels, height, width)))
        stats = self._buffer(stats_key, lambda: torch.zeros((rows, 2, groups), device=x.device))
        maps = self._buffer(maps_key, lambda: torch.zeros((rows, 2, groups, height, width), device=x.device))
        return conv_subsets.static_region(block, x, temb, geometry, recorded, stats, maps)

    def run_upsample(self, block, x: torch.Tensor) -> torch.Tensor:
        """The upsampler `block` on each row's box of its output grid (conv_subsets.static_upsample)."""
        from backends.core.runtime import conv_subsets

        height, width = x.shape[-2:]
        geometry = self._geometry("upsample", conv_subsets.upsample_geometry, conv_subsets.upsample_side, height, width,
                                  x.device)
        recorded = self._buffer(conv_subsets.upsample_key(block._upsample_index), lambda: conv_subsets.zeros_as(
            x, (x.shape[0], block.conv.out_channels, 2 * height, 2 * width)))
        return conv_subsets.static_upsample(block, x, geometry, recorded)

    def _geometry(self, kind: str, make, side, height: int, width: int, device: torch.device) -> list[torch.Tensor]:
        """The boxes' places of `kind` on a `height` x `width` grid, the box's sides `side(fraction,
        grid side)`, made from the indices at their first use (eager: a compile reads only the
        buffers, never the box); `fill` makes them again for each step's rows."""
        entry = self.geometry.get((kind, height * width))
        if entry is None:
            args = (height, width, *(side(f, n) for f, n in zip(self.box, (height, width))))
            # every dimension dynamic: rows, and the box's sides
            entry = self.geometry[(kind, height * width)] = (make, args, [
                _dynamic(t.contiguous(), *range(t.dim())) for t in make(self._indices(height * width, device), *args)])
        return entry[2]

    def fill(self, layout: TokenLayout) -> None:
        """The step's indices and recorded outputs into the buffers (rows past the layout's keep
        what they hold: a graph's spare rows are dropped), and its tokens counted."""
        dst, src = [], []
        for r, row in enumerate(layout.rows):
            for tokens, buf in self.indices.items():
                dst.append(buf[r])
                src.append(_padded(row.computed[tokens], buf.shape[1]))
            for block, buf in self.buffers.outputs.items():
                if self.takes(block):
                    dst.append(buf[r])
                    src.append(row.activations.get(row.step, block, row.row))
        if dst:  # (none where the plan leaves every block whole)
            torch._foreach_copy_(dst, src)
        placed = tuple(row.computed for row in layout.rows)
        if self.geometry and (len(placed) != len(self._placed)
                              or any(a is not b for a, b in zip(placed, self._placed))):
            # The boxes' places follow from the rows' tokens (just copied): made again only when the
            # rows change.
            dst, src = [], []
            for make, args, buffers in self.geometry.values():
                values = make(self.indices[args[0] * args[1]][:len(placed)], *args)
                dst += [buffer[:len(placed)] for buffer in buffers]
                src += values
            torch._foreach_copy_(dst, src)
            self._placed = placed
        context, rows = self.context, len(layout.rows)
        for block, tokens in self.buffers.tokens.items():
            taken = self.takes(block)
            context.computed_tokens += sum(r.computed[tokens].numel() for r in layout.rows) if taken else rows * tokens
            context.all_tokens += rows * tokens
        if context.convs:
            from backends.core.runtime.conv_subsets import box_side

            for height, width in self.buffers.grids.values():
                context.conv_all += rows * height * width
                context.conv_computed += rows * (height * width if self.box is None else
                                                 box_side(self.box[0], height) * box_side(self.box[1], width))


def _dynamic(buffer: torch.Tensor, *dims: int) -> torch.Tensor:
    """`buffer`, its `dims` (rows, computed tokens) marked dynamic for torch.compile: one compile of
    the reusing halves serves every row bucket and token share, each still its own CUDA graph."""
    from torch._dynamo import maybe_mark_dynamic

    for dim in dims:
        maybe_mark_dynamic(buffer, dim)
    return buffer


def _padded(indices: torch.Tensor, n: int) -> torch.Tensor:
    return torch.cat([indices, indices[-1:].expand(n - indices.numel())])
