"""ControlNets as CUDA graphs on the GPU (backends/core/adapters/controlnet_graphs.py) against the
eager ControlNet. Tolerance: fp16 2e-3 of the largest magnitude (test_fast_runtime.py's; the
replay runs the same kernels, whose algorithms may be picked anew at capture)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from backends.core.adapters.controlnet import ControlCall, run_controlnet
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.adapters.controlnet_graphs import ControlNetGraphs
from backends.core.adapters.store import AdapterStore
from backends.core.runtime.placement import Placement
from tests.gpu.test_fast_runtime import COMPILED_TOL, TOL, rel_err
from tests.unit.test_controlnet_graphs import random_call

pytestmark = pytest.mark.gpu


def on_gpu(call: ControlCall) -> ControlCall:
    return ControlCall(call.name, call.scale, *(t.to("cuda:0", torch.float16 if t.is_floating_point() and t.dim() > 1
                                                     else None) for t in (call.image, call.sample, call.timestep,
                                                                          call.embeds, call.pooled, call.time_ids)))


def test_graphs_equal_eager_and_follow_scale_shape_and_eviction(tiny_model):
    store = AdapterStore(tiny_model / "adapters")
    cache = ControlNetCache(store, Placement("cuda:0", "fp16"), budget_bytes=2**30)
    graphs = ControlNetGraphs()
    model = cache.acquire("canny")
    cache.budget_bytes = cache.resident["canny"] + 1  # room for one ControlNet
    for rows, scale, seed in ((2, 1.0, 0), (2, 0.5, 1), (1, 0.8, 2)):
        call = on_gpu(random_call(model, rows=rows, scale=scale, seed=seed))
        want_down, want_mid = run_controlnet(model, call)
        down, mid = graphs.run(model, call)
        assert rel_err(mid, want_mid) <= TOL[torch.float16], (rows, scale)
        assert max(rel_err(a, b) for a, b in zip(down, want_down)) <= TOL[torch.float16], (rows, scale)
    assert graphs.captures == 2 and graphs.replays == 3 and graphs.graphs_of(model) == 2  # one per shape
    cache.release("canny")
    del model
    cache.acquire("depth")  # evicts canny: its graphs go with it
    gc.collect()
    assert graphs._graphs == {}


def test_compiled_graphs_equal_eager_for_two_controlnets(tiny_model, tmp_path):
    """Graphs of compiled code over the service's models (`fast`: channels_last and packed
    attention projections), given the control image or its kept embedding: each ControlNet's
    residuals within the compiled tolerance of diffusers' eager model's (inductor fuses and
    reorders fp16 sums: test_fast_runtime.py's COMPILED_TOL; an SDXL-size ControlNet was 2.0e-3
    from eager on an H200, bench/micro/controlnet_micro.py), with the code compiled once for both
    (the second is captured, not compiled)."""
    from backends.core.adapters.controlnet import embed_image
    from backends.core.runtime.compile_cache import use_compile_cache
    from backends.core.runtime.packed_attention import PackedSelfAttnProcessor

    use_compile_cache(tmp_path / "compile_cache")
    torch._dynamo.reset()
    store = AdapterStore(tiny_model / "adapters")
    cache = ControlNetCache(store, Placement("cuda:0", "fp16"), budget_bytes=2**30, fast=True)
    stock = ControlNetCache(store, Placement("cuda:0", "fp16"), budget_bytes=2**30)
    graphs = ControlNetGraphs(compiled=True)
    compiled = []  # dynamo's count of graphs it compiled, after each ControlNet
    for name in ("canny", "depth"):
        model, reference = cache.acquire(name), stock.acquire(name)
        assert any(isinstance(getattr(m, "processor", None), PackedSelfAttnProcessor) for m in model.modules())
        for rows, scale, seed, kept in ((2, 0.7, 0, False), (2, 0.7, 0, True), (4, 1.0, 1, True)):
            call = on_gpu(random_call(model, rows=rows, scale=scale, seed=seed))
            want_down, want_mid = run_controlnet(reference, call)
            if kept:
                with torch.inference_mode():
                    call = dataclasses.replace(call, image=embed_image(model, call.image))
            down, mid = graphs.run(model, call)
            assert rel_err(mid, want_mid) <= COMPILED_TOL, (name, rows, kept)
            assert max(rel_err(a, b) for a, b in zip(down, want_down)) <= COMPILED_TOL, (name, rows, kept)
        cache.release(name)
        stock.release(name)
        compiled.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs.captures == 6
    assert compiled[0] >= 1 and compiled[1] == compiled[0]  # the second ControlNet compiled nothing
    torch._dynamo.reset()
