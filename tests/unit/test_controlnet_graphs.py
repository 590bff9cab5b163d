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
    got_down, got_mid = local.submit(call).result()
    assert torch.equal(got_mid, want_mid)
