"""The static form of template edits' token subsets (runtime/token_subsets.StaticSubsets), which the
fast runtimes capture into CUDA graphs, against the dynamic form the eager runtime runs, on a
small transformer block on the CPU (fp32): the same outputs within 1e-5 of their largest magnitude
(a different count of padded queries changes the products' blocking, not the math)."""

from __future__ import annotations

import pytest
import torch

from backends.core.runtime.token_subsets import (FULL, GRAPH_SHARES, RECORD, REUSE, RecordedBuffers, StaticSubsets,
                                                 TemplateActivations, TokenLayout, TokenRow, computed_tokens,
                                                 graph_share, install)

SIDE = 8  # an 8x8 token grid


def mask(rows: slice, cols: slice) -> torch.Tensor:
    m = torch.zeros(1, 1, SIDE, SIDE)
    m[..., rows, cols] = 1
    return m


@pytest.fixture
def block():
    from diffusers.models.attention import BasicTransformerBlock

    torch.manual_seed(0)
    b = BasicTransformerBlock(32, 2, 16, cross_attention_dim=24).eval()
    return b, install(b)


def recording(block, x, text) -> TemplateActivations:
    from diffusers.models.attention import BasicTransformerBlock

    rec = TemplateActivations(2)
    with torch.inference_mode():
        out = BasicTransformerBlock.forward(block, x, encoder_hidden_states=text)
    for r in range(2):
        rec.put(0, block._subset_index, r, out[r])
    return rec


def test_graph_share_is_the_smallest_bucket_that_holds_every_row():
    small, half = computed_tokens(mask(slice(0, 2), slice(0, 4)), 1), computed_tokens(mask(slice(0, 4), slice(0, 8)), 1)
    rec = TemplateActivations(1)
    assert graph_share(TokenLayout((TokenRow(REUSE, rec, 0, 0, small),))) == 2 / 16  # 8 of 64 tokens
    assert graph_share(TokenLayout((TokenRow(REUSE, rec, 0, 0, small), TokenRow(REUSE, rec, 0, 0, half)))) == 8 / 16
    assert graph_share(TokenLayout((TokenRow(REUSE, rec, 0, 0, small), TokenRow(RECORD, rec, 0, 0)))) is None
    assert graph_share(TokenLayout((TokenRow(FULL),))) is None
    empty = computed_tokens(torch.zeros(1, 1, SIDE, SIDE), 1)  # computes nothing: takes the recording whole
    assert graph_share(TokenLayout((TokenRow(REUSE, rec, 0, 0, empty),))) is None
    assert GRAPH_SHARES[-1] == 1.0 and list(GRAPH_SHARES) == sorted(GRAPH_SHARES)


@pytest.mark.parametrize("bucket_rows", [3, 4])  # one spare row: dropped, whatever it computes
def test_the_static_form_gives_the_dynamic_forms_outputs(block, bucket_rows):
    block, context = block
    g = torch.Generator().manual_seed(1)
    x = torch.randn(bucket_rows, SIDE * SIDE, 32, generator=g)
    text = torch.randn(bucket_rows, 5, 24, generator=g)
    template = recording(block, torch.randn(2, SIDE * SIDE, 32, generator=g), text[:2])
    rows = (TokenRow(REUSE, template, 0, 1, computed_tokens(mask(slice(1, 4), slice(2, 5)), 1)),
            TokenRow(REUSE, template, 0, 0, computed_tokens(mask(slice(0, 8), slice(6, 8)), 1)),
            TokenRow(REUSE, template, 0, 1, computed_tokens(mask(slice(5, 6), slice(0, 1)), 1)))
    layout = TokenLayout(rows)
    share = graph_share(layout)
    assert share == 4 / 16  # the widest row: 16 of 64 tokens
    with torch.inference_mode():
        context.layout = layout
        want = block(x[:3], encoder_hidden_states=text[:3])
        static = StaticSubsets(bucket_rows, share, None, context, RecordedBuffers())
        context.layout = static
        block(x, encoder_hidden_states=text)  # the first run makes the buffers (a capture's warm-up)
        before = (context.computed_tokens, context.all_tokens)
        static.fill(layout)
        got = block(x, encoder_hidden_states=text)
        context.layout = None
    assert got.shape == x.shape
    assert (got[:3] - want).abs().max() <= 1e-5 * want.abs().max()
    assert context.computed_tokens - before[0] == 9 + 16 + 1 and context.all_tokens - before[1] == 3 * 64
    keep = computed_tokens(mask(slice(1, 4), slice(2, 5)), 1)[64]
    outside = torch.ones(64, dtype=torch.bool)
    outside[keep] = False
    assert torch.equal(got[0][outside], template.get(0, 0, 1)[outside])  # the recording outside its mask


def test_a_block_the_plan_leaves_whole_runs_every_token(block):
    from diffusers.models.attention import BasicTransformerBlock

    block, context = block
    g = torch.Generator().manual_seed(2)
    x, text = torch.randn(2, SIDE * SIDE, 32, generator=g), torch.randn(2, 5, 24, generator=g)
    template = recording(block, x, text)
    layout = TokenLayout((TokenRow(REUSE, template, 0, 0, computed_tokens(mask(slice(0, 2), slice(0, 2)), 1)),),
                         cached=frozenset())
    static = StaticSubsets(2, graph_share(layout), layout.cached, context, RecordedBuffers())
    with torch.inference_mode():
        context.layout = static
        block(x, encoder_hidden_states=text)
        static.fill(layout)
        got = block(x, encoder_hidden_states=text)
        context.layout = None
        want = BasicTransformerBlock.forward(block, x, encoder_hidden_states=text)
    assert torch.equal(got, want) and not static.buffers.outputs


def test_one_compile_serves_every_token_share_and_row_count(block):
    """The compiled runtime captures its reusing steps from compiled halves: the buffers' row and
    token counts are dynamic, so a new share or row bucket is a new graph, not a new compile."""
    from torch._dynamo import maybe_mark_dynamic, reset
    from torch._dynamo.testing import CompileCounterWithBackend

    block, context = block
    g = torch.Generator().manual_seed(3)
    text = torch.randn(4, 5, 24, generator=g)
    template = recording(block, torch.randn(2, SIDE * SIDE, 32, generator=g), text[:2])
    counter = CompileCounterWithBackend("aot_eager")
    reset()
    compiled = torch.compile(block, backend=counter)
    buffers = {}
    try:
        for bucket_rows, window in ((3, (slice(1, 4), slice(2, 5))), (3, (slice(0, 8), slice(0, 4))),
                                    (4, (slice(5, 6), slice(0, 1)))):
            layout = TokenLayout(tuple(TokenRow(REUSE, template, 0, r % 2, computed_tokens(mask(*window), 1))
                                       for r in range(bucket_rows)))
            static = StaticSubsets(bucket_rows, graph_share(layout), None, context,
                                   buffers.setdefault(bucket_rows, RecordedBuffers()))
            x, rows_text = torch.randn(bucket_rows, SIDE * SIDE, 32, generator=g), text[:bucket_rows]
            for t in (x, rows_text):  # (as cuda_graphs.capture marks a compiled capture's inputs)
                maybe_mark_dynamic(t, 0)
            with torch.inference_mode():
                context.layout = static
                block(x, encoder_hidden_states=rows_text)  # the buffers, made eager (as the runtime does)
                static.fill(layout)
                want = block(x, encoder_hidden_states=rows_text)
                got = compiled(x, encoder_hidden_states=rows_text)
                context.layout = None
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        assert counter.frame_count == 1
    finally:
        context.layout = None
        reset()
