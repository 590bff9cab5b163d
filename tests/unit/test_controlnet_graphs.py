"""ControlNetGraphs (backends/core/adapters/controlnet_graphs.py) on CPU: without CUDA it runs the
ControlNet eagerly, so its residuals equal run_controlnet's bit for bit (the GPU tier compares the
graphs, tests/gpu/test_controlnet_graphs.py)."""

from __future__ import annotations

import torch

from backends.core.adapters.controlnet import ControlCall, LocalControlNets, run_controlnet
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.adapters.controlnet_graphs import ControlNetGraphs
from backends.core.adapters.store import AdapterStore
from backends.core.runtime.placement import Placement


def random_call(model, rows=2, scale=0.7, seed=0) -> ControlCall:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return ControlCall("canny", scale, torch.rand(rows, 3, 64, 64, generator=g),
                       torch.randn(rows, cfg.in_channels, 8, 8, generator=g), torch.full((rows,), 500.0),
                       torch.randn(rows, 77, cfg.cross_attention_dim, generator=g), torch.randn(rows, pooled, generator=g),
                       torch.tensor([[64.0, 64, 0, 0, 64, 64]]).repeat(rows, 1))


def test_cpu_calls_run_eagerly_and_exactly(tiny_model):
    cache = ControlNetCache(AdapterStore(tiny_model / "adapters"), Placement(), budget_bytes=2**30)
    model = cache.acquire("canny")
    call = random_call(model)
    graphs = ControlNetGraphs()
    down, mid = graphs.run(model, call)
    want_down, want_mid = run_controlnet(model, call)
    assert torch.equal(mid, want_mid) and all(torch.equal(a, b) for a, b in zip(down, want_down))
    assert graphs.captures == 0 and graphs.graphs_of(model) == 0
    local = LocalControlNets(cache, graphs=True)
    got_down, got_mid = local.submit(call).result().residuals
    assert torch.equal(got_mid, want_mid)


def test_compiled_forward_is_shared_by_controlnets_of_one_architecture(tiny_model):
    """The forward the graphs capture is compiled once for every ControlNet of one architecture
    (dynamo lifts their parameters to inputs): a second ControlNet, or a new row count, compiles
    nothing more, and each still computes its own residuals. CPU, with a counting backend in
    place of inductor: the same tracing, no code generation."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    graphs = ControlNetGraphs(compiled=True, backend=counter)
    cache = ControlNetCache(AdapterStore(tiny_model / "adapters"), Placement(), budget_bytes=2**30)
    canny, depth = cache.acquire("canny"), cache.acquire("depth")
    assert any(not torch.equal(a, b) for a, b in zip(canny.parameters(), depth.parameters()))
    for model in (canny, depth):
        for rows in (2, 3):
            call = random_call(model, rows=rows, scale=1.0, seed=rows)
            inputs = (call.sample, call.timestep, call.embeds, call.image, call.pooled, call.time_ids)
            if rows == 2:
                for t in inputs:  # as cuda_graphs.capture marks them
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            down, mid = graphs.forward(model, *inputs)
            want_down, want_mid = run_controlnet(model, call)
            # Re-traced ops: same kernels on CPU, but not promised bit for bit.
            torch.testing.assert_close(mid, want_mid, rtol=1e-5, atol=1e-5)
            for got, want in zip(down, want_down):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_a_kept_image_embedding_gives_the_residuals_of_the_image(tiny_model):
    """The cache's ControlNets take their control image's embedding in place of the image (the
    service embeds once per session): the residuals equal diffusers' own model's on the image, bit
    for bit, and the weights keep diffusers' names. A `bgr` ControlNet keeps taking the image."""
    import dataclasses

    from diffusers import ControlNetModel

    from backends.core.adapters.controlnet import embed_image, keep_embedding

    store = AdapterStore(tiny_model / "adapters")
    model = ControlNetCache(store, Placement(), budget_bytes=2**30).acquire("canny")
    stock = ControlNetModel.from_pretrained(store.controlnet("canny").folder, use_safetensors=True).eval()
    call = random_call(model)
    with torch.inference_mode():
        want_down, want_mid = run_controlnet(stock, call)
        embedded = embed_image(model, call.image)
        assert embedded.shape == (2, model.config.block_out_channels[0], 8, 8)
        for image in (call.image, embedded):
            down, mid = run_controlnet(model, dataclasses.replace(call, image=image))
            assert torch.equal(mid, want_mid) and all(torch.equal(a, b) for a, b in zip(down, want_down))
    assert model.state_dict().keys() == stock.state_dict().keys()

    bgr = ControlNetModel.from_config({**stock.config, "controlnet_conditioning_channel_order": "bgr"})
    keep_embedding(bgr)
    assert embed_image(bgr, call.image) is call.image


def test_packed_attention_projections_keep_a_controlnets_residuals(tiny_model):
    """The service's fast models pack a ControlNet's attention projections as the UNet's fast
    runtime does (on a GPU, beside channels_last): the same dot products in other GEMMs, so the
    residuals stay within fp32 rounding of the stock model's (1e-5 of the largest magnitude)."""
    from backends.core.runtime.packed_attention import PackedSelfAttnProcessor, pack_attention

    store = AdapterStore(tiny_model / "adapters")
    stock = ControlNetCache(store, Placement(), budget_bytes=2**30).acquire("canny")
    packed = ControlNetCache(store, Placement(), budget_bytes=2**30).acquire("canny")
    pack_attention(packed)
    assert any(isinstance(getattr(m, "processor", None), PackedSelfAttnProcessor) for m in packed.modules())
    call = random_call(stock)
    with torch.inference_mode():
        (want_down, want_mid), (down, mid) = run_controlnet(stock, call), run_controlnet(packed, call)
    for got, want in zip([*down, mid], [*want_down, want_mid]):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
