"""The static form of the ResNet blocks' and upsamplers' boxes (runtime/conv_subsets.static_region
and static_upsample, served by StaticSubsets under CUDA graphs) against the eager form
(conv_subsets.run_rows; upsamplers whole) on random diffusers blocks and the tiny UNet on the CPU
(fp32): each row's output within 1e-5 of its largest magnitude for a block, 1e-4 for the UNet (the
same math; the statistics' sums run in another order), in either memory layout, near the grid's
edges too; one compile serves every box size, token share and row count."""

from __future__ import annotations

import pytest
import torch

from backends.core.runtime.conv_subsets import (BOX_SIDES, box_side, graph_box, keys, masked_boxes, static_upsample,
                                                upsample_geometry, upsample_side, whole)
from backends.core.runtime.token_subsets import (REUSE, RecordedBuffers, StaticSubsets, TemplateActivations,
                                                 TokenLayout, TokenRow, computed_tokens, graph_share, install)

HEIGHT, WIDTH = 10, 12
TEMB = 12


def mask(rows: slice, cols: slice) -> torch.Tensor:
    m = torch.zeros(1, 1, HEIGHT, WIDTH)
    m[..., rows, cols] = 1
    return m


@pytest.fixture
def block():
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    b = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=TEMB, groups=4).eval()
    return b, install(b, convs=True)


def recording(block, g: torch.Generator) -> TemplateActivations:
    rec = TemplateActivations(2)
    with torch.inference_mode():
        outputs = whole(block, torch.randn(2, 8, HEIGHT, WIDTH, generator=g), torch.randn(2, TEMB, generator=g),
                        stats=True)
    for key, t in zip(keys(block._resnet_index), outputs):
        for r in range(2):
            rec.put(0, key, r, t[r])
    return rec


def layout_of(template, *windows) -> TokenLayout:
    return TokenLayout(tuple(TokenRow(REUSE, template, 0, k % 2, computed_tokens(mask(*w), 1),
                                      masked_boxes(mask(*w), 1)) for k, w in enumerate(windows)))


def test_a_box_holds_every_rows_widened_box_at_every_grid():
    template = TemplateActivations(1)
    template.put(0, keys(0)[0], 0, torch.zeros(1))
    small = layout_of(template, (slice(2, 4), slice(3, 6)))  # 2 x 3 tokens, widened: 4 x 5
    assert graph_box(small, HEIGHT, WIDTH) == (1 / 8, 2 / 8)
    assert (box_side(1 / 8, HEIGHT), box_side(1 / 8, WIDTH), box_side(2 / 8, WIDTH)) == (4, 4, 5)  # 2 + 2, 2 + 2, 3 + 2
    tall = layout_of(template, (slice(2, 4), slice(3, 6)), (slice(0, 10), slice(11, 12)))  # at the edge: 10 x 2
    assert graph_box(tall, HEIGHT, WIDTH) == (6 / 8, 2 / 8)  # 8 + 2 = 10: the grid's height
    assert box_side(BOX_SIDES[-1], HEIGHT) == HEIGHT
    unrecorded = layout_of(TemplateActivations(1), (slice(2, 4), slice(3, 6)))  # no ResNet block recorded
    assert graph_box(unrecorded, HEIGHT, WIDTH) is None


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
@pytest.mark.parametrize("bucket_rows", [3, 4])  # one spare row: dropped, whatever it computes
def test_the_static_boxes_give_the_eager_forms_outputs(block, channels_last, bucket_rows):
    block, context = block
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    block.to(memory_format=fmt)
    g = torch.Generator().manual_seed(1)
    template = recording(block, g)
    x = torch.randn(bucket_rows, 8, HEIGHT, WIDTH, generator=g).contiguous(memory_format=fmt)
    temb = torch.randn(bucket_rows, TEMB, generator=g)
    layout = layout_of(template, (slice(1, 4), slice(2, 5)), (slice(6, 10), slice(9, 12)), (slice(0, 1), slice(0, 2)))
    box = graph_box(layout, HEIGHT, WIDTH)
    assert box == (2 / 8, 2 / 8)  # 5 x 5 at most, widened; their union would be the whole grid
    with torch.inference_mode():
        context.layout = layout
        want = block(x[:3], temb[:3])
        static = StaticSubsets(bucket_rows, graph_share(layout), None, context, RecordedBuffers(), box)
        context.layout = static
        block(x, temb)  # the first run makes the buffers (a capture's warm-up)
        before = (context.conv_computed, context.conv_all)
        static.fill(layout)
        got = block(x, temb)
        context.layout = None
    assert got.shape == (bucket_rows, 16, HEIGHT, WIDTH) and got.is_contiguous(memory_format=fmt)
    for k in range(3):
        assert (got[k] - want[k]).abs().max() <= 1e-5 * want[k].abs().max(), k
    outside = mask(slice(0, 5), slice(1, 6))[0, 0] == 0  # row 0's box, widened by a token
    recorded = template.get(0, keys(0)[0], 0)  # (row 0 reuses the recording's row 0)
    assert torch.equal(got[0][:, outside], recorded[:, outside])  # the recording outside its box
    assert context.conv_computed - before[0] == 3 * box_side(box[0], HEIGHT) * box_side(box[1], WIDTH)
    assert context.conv_all - before[1] == 3 * HEIGHT * WIDTH
    # Other rows in the same bucket (other masks, the box's sides alike): the boxes' places are made
    # again at the fill, and each row gets what it gets alone again
    moved = layout_of(template, (slice(5, 8), slice(0, 3)), (slice(0, 2), slice(4, 7)), (slice(7, 10), slice(8, 11)))
    assert graph_box(moved, HEIGHT, WIDTH) == box
    with torch.inference_mode():
        context.layout = moved
        want = block(x[:3], temb[:3])
        context.layout = static
        static.fill(moved)
        got = block(x, temb)
        static.fill(moved)  # (the same rows again: their places kept)
        again = block(x, temb)
        context.layout = None
    for k in range(3):
        assert (got[k] - want[k]).abs().max() <= 1e-5 * want[k].abs().max(), k
    assert torch.equal(again, got)


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "channels-last"])
def test_an_upsampler_on_its_box_gives_its_whole_output(channels_last):
    """An input that differs from the recorded one only on each row's widened box (what the ResNet
    blocks computed there): the upsampler on its box over the recording equals it run whole, so
    its box adds no deviation."""
    from diffusers.models.upsampling import Upsample2D

    from backends.core.runtime.conv_subsets import MARGIN, widened

    torch.manual_seed(5)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    block = Upsample2D(8, use_conv=True).eval().to(memory_format=fmt)
    g = torch.Generator().manual_seed(6)
    template = torch.randn(3, 8, HEIGHT, WIDTH, generator=g).contiguous(memory_format=fmt)
    windows = ((slice(1, 4), slice(2, 5)), (slice(6, 10), slice(9, 12)), (slice(0, 1), slice(0, 2)))
    x = template.clone()
    for k, (rows, cols) in enumerate(windows):
        top, bottom, left, right = widened([(rows.start, rows.stop, cols.start, cols.stop)], HEIGHT, WIDTH)
        x[k, :, top:bottom, left:right] = torch.randn(8, bottom - top, right - left, generator=g)
    assert MARGIN == 1
    layout = layout_of(TemplateActivations(1), *windows)
    tokens = torch.stack([torch.cat([r.computed[HEIGHT * WIDTH], r.computed[HEIGHT * WIDTH][-1:].expand(
        40 - r.computed[HEIGHT * WIDTH].numel())]) for r in layout.rows])  # (padded by repeating)
    box = graph_box(layout, HEIGHT, WIDTH, recorded=())
    sides = tuple(upsample_side(f, side) for f, side in zip(box, (HEIGHT, WIDTH)))
    assert sides[0] < 2 * HEIGHT and sides[1] < 2 * WIDTH
    with torch.inference_mode():
        want = Upsample2D.forward(block, x)
        got = static_upsample(block, x, upsample_geometry(tokens, HEIGHT, WIDTH, *sides),
                              Upsample2D.forward(block, template))
    assert got.is_contiguous(memory_format=fmt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_upsamplers_take_their_box_only_where_every_resnet_block_takes_its_own():
    from diffusers.models.upsampling import Upsample2D

    from plugins.patch import FusedResnetBlock2D

    plain, fused = ResnetThenUpsampler(), ResnetThenUpsampler()
    fused.resnet.__class__ = FusedResnetBlock2D  # (as plugins.use_fused_kernels swaps it)
    assert len(install(plain, convs=True).box_keys) == 2 and type(plain.up) is not Upsample2D
    assert install(fused, convs=True).box_keys == () and type(fused.up) is Upsample2D  # both run whole


def test_without_a_box_the_static_form_runs_the_block_whole(block):
    from diffusers.models.resnet import ResnetBlock2D

    block, context = block
    g = torch.Generator().manual_seed(2)
    template = recording(block, g)
    x, temb = torch.randn(2, 8, HEIGHT, WIDTH, generator=g), torch.randn(2, TEMB, generator=g)
    layout = layout_of(template, (slice(1, 4), slice(2, 5)), (slice(1, 4), slice(2, 5)))
    static = StaticSubsets(2, graph_share(layout), None, context, RecordedBuffers())
    with torch.inference_mode():
        context.layout = static
        block(x, temb)
        static.fill(layout)
        got = block(x, temb)
        context.layout = None
        want = ResnetBlock2D.forward(block, x, temb)
    assert torch.equal(got, want) and not static.buffers.outputs


class ResnetThenUpsampler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.upsampling import Upsample2D

        self.resnet = ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=TEMB, groups=4)
        self.up = Upsample2D(16, use_conv=True)

    def forward(self, x, temb):
        return self.up(self.resnet(x, temb))


def test_one_compile_serves_every_box_size_token_share_and_row_count():
    """Under `compiled` the reusing halves are compiled once per latent size: the boxes' sides (the
    sizes of their places' buffers), like the rows and token counts, are dynamic, so a new box size
    is a new graph, not a compile.
    The box's work is one opaque operator in the compiled graph (a compile that traced it, with the
    sides symbolic, took minutes at SDXL size)."""
    from torch._dynamo import maybe_mark_dynamic, reset

    from backends.core.runtime.token_subsets import RECORD

    torch.manual_seed(0)
    model = ResnetThenUpsampler().eval()
    context = install(model, convs=True)
    g = torch.Generator().manual_seed(3)
    template = TemplateActivations(2)
    with torch.inference_mode():  # the eager form records the ResNet block's and the upsampler's outputs
        context.layout = TokenLayout((TokenRow(RECORD, template, 0, 0), TokenRow(RECORD, template, 0, 1)))
        model(torch.randn(2, 8, HEIGHT, WIDTH, generator=g), torch.randn(2, TEMB, generator=g))
        context.layout = None
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    reset()
    compiled = torch.compile(model, backend=backend)
    buffers, boxes = {}, set()
    try:
        for bucket_rows, windows in ((3, ((slice(1, 4), slice(2, 5)),)),
                                     (3, ((slice(0, 8), slice(0, 4)), (slice(2, 3), slice(2, 3)))),
                                     (4, ((slice(5, 6), slice(0, 1)), (slice(4, 10), slice(3, 12))))):
            layout = layout_of(template, *windows)
            box = graph_box(layout, HEIGHT, WIDTH, context.box_keys)
            boxes.add(box)
            static = StaticSubsets(bucket_rows, graph_share(layout), None, context,
                                   buffers.setdefault(bucket_rows, RecordedBuffers()), box)
            x = torch.randn(bucket_rows, 8, HEIGHT, WIDTH, generator=g)
            temb = torch.randn(bucket_rows, TEMB, generator=g)
            for t in (x, temb):  # (as cuda_graphs.capture marks a compiled capture's inputs)
                maybe_mark_dynamic(t, 0)
            with torch.inference_mode():
                context.layout = static
                model(x, temb)  # the buffers, made eager (as the runtime does)
                static.fill(layout)
                want = model(x, temb)
                got = compiled(x, temb)
                context.layout = None
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert len(boxes) == 3 and len(graphs) == 1
        ops = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
        assert ops.count(torch.ops.easel.resnet_box) == 1 and ops.count(torch.ops.easel.upsample_box) == 1
        assert torch.nn.functional.conv2d not in ops  # (nothing of the box traced)
    finally:
        context.layout = None
        reset()


def test_a_whole_unets_static_step_gives_the_eager_steps_outputs(tiny_model):
    """The tiny UNet's two halves (ResNet and transformer blocks at every level) in a reusing step:
    the static form (token shares and boxes, as the graphs capture it, run eager here) against the
    eager form, three masks in a bucket of four rows, within 1e-4 of the largest magnitude (the
    statistics' sums in another order, through every block)."""
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.token_subsets import RECORD
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.unet_split import split_unet

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet").float().eval()
    runtime = EagerUNetRuntime(unet, *split_unet(unet), conv_subsets=True)
    cfg = unet.config
    side, levels = 16, len(cfg.block_out_channels)
    g = torch.Generator().manual_seed(4)

    def inputs(rows: int) -> tuple:
        pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        return (torch.randn(rows, cfg.in_channels, side, side, generator=g), torch.full((rows,), 501.0),
                torch.randn(rows, 7, cfg.cross_attention_dim, generator=g), torch.randn(rows, pooled, generator=g),
                torch.tensor([[128.0, 128, 0, 0, 128, 128]]).expand(rows, -1))

    def step(layout, args, fill: TokenLayout | None = None) -> torch.Tensor:
        with torch.inference_mode(), runtime.token_layout(layout):
            if fill is not None:  # (as the fast runtime fills a bucket before its replay)
                layout.fill(fill)
            emb, mid, skips = runtime.encoder(*args)
            return runtime.decoder(emb, mid, skips, args[2])

    template = TemplateActivations(2)
    recorded_inputs = inputs(2)
    step(TokenLayout((TokenRow(RECORD, template, 0, 0), TokenRow(RECORD, template, 0, 1))), recorded_inputs)
    masks = []
    for rows, cols in ((slice(2, 6), slice(3, 8)), (slice(10, 16), slice(12, 16)), (slice(0, 3), slice(0, 16))):
        m = torch.zeros(1, 1, side, side)
        m[..., rows, cols] = 1
        masks.append(m)
    layout = TokenLayout(tuple(TokenRow(REUSE, template, 0, k % 2, computed_tokens(m, levels), masked_boxes(m, levels))
                               for k, m in enumerate(masks)))
    args = inputs(4)
    args = (args[0], args[1], torch.cat([recorded_inputs[2], recorded_inputs[2]]), *args[3:])  # the template's text
    want = step(layout, tuple(a[:3] for a in args))
    box = graph_box(layout, side, side, runtime.subsets.box_keys)
    assert box is not None and box != (1.0, 1.0) and len(runtime.subsets.box_keys) == 2  # ResNet blocks, upsamplers
    static = StaticSubsets(4, graph_share(layout), None, runtime.subsets, RecordedBuffers(), box)
    step(static, args)  # the buffers (a capture's warm-up)
    got = step(static, args, fill=layout)[:3]
    # the upsamplers' boxes: part of their output grids (the eager form runs them whole)
    upsampled = [args for (kind, _), (_, args, _) in static.geometry.items() if kind == "upsample"]
    assert upsampled and any(box_h < 2 * height for height, _, box_h, _ in upsampled)
    print("whole UNet, static boxes against eager:", float((got - want).abs().max() / want.abs().max()))
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    unboxed = StaticSubsets(4, graph_share(layout), None, runtime.subsets, RecordedBuffers())
    step(unboxed, args)
    assert (step(unboxed, args, fill=layout)[:3] - want).abs().max() > 1e-3 * want.abs().max()  # (the boxes are what it runs)
