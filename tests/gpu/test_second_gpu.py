"""CUDA graphs of work placed on GPU 1, captured and replayed from a thread whose current device is
GPU 0, as a Triton stub's threads are whatever its instance's GPU: a generic graph set, the
ControlNet service's graphs (plain and compiled), the text encoders' and the VAE's. Each call, with
new inputs every time, equals the same work run eagerly on GPU 1 (tolerances: test_fast_runtime.py's,
fp16 2e-3 and compiled 1e-2 of the largest magnitude, fp32 1e-5), and the thread's current device
is left as it was. Needs two GPUs (`tests/gpu/run.sh` on such a machine); skipped elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.core.adapters.controlnet import ControlCall, run_controlnet
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.adapters.controlnet_graphs import ControlNetGraphs
from backends.core.adapters.store import AdapterStore
from backends.core.request.params import Limits, validate
from backends.core.runtime.cuda_graphs import GraphSet
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from backends.core.stages.vae_decoding import LatentDecoder
from export.repository import ExportOptions, export_repository
from tests.gpu.test_fast_runtime import COMPILED_TOL, TOL, rel_err
from tests.unit.test_controlnet_graphs import random_call

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]

OTHER = torch.device("cuda:1")


@pytest.fixture(autouse=True)
def thread_on_gpu0():
    """The test's thread starts on GPU 0 and must end there: nothing may move it."""
    torch.cuda.set_device(0)
    yield
    assert torch.cuda.current_device() == 0


def on_other(call: ControlCall) -> ControlCall:
    return ControlCall(call.name, call.scale, *(t.to(OTHER, torch.float16 if t.is_floating_point() and t.dim() > 1
                                                     else None) for t in (call.image, call.sample, call.timestep,
                                                                          call.embeds, call.pooled, call.time_ids)))


def test_graph_set_replays_on_its_inputs_gpu():
    conv = torch.nn.Conv2d(4, 8, 3, padding=1).to(OTHER)
    graphs = GraphSet()
    with torch.inference_mode():
        for seed in range(3):
            x = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(seed)).to(OTHER)
            got = graphs("x", lambda t: torch.relu(conv(t)), x)
            assert got.device == OTHER
            assert rel_err(got, torch.relu(conv(x))) <= TOL[torch.float32], seed
    assert len(graphs) == 1


@pytest.mark.parametrize("compiled", [False, True], ids=["graphs", "compiled"])
def test_controlnet_graphs_on_gpu1_equal_eager(tiny_model, tmp_path, compiled):
    if compiled:
        from backends.core.runtime.compile_cache import use_compile_cache

        use_compile_cache(tmp_path / "compile_cache")
        torch._dynamo.reset()
    cache = ControlNetCache(AdapterStore(tiny_model / "adapters"), Placement(str(OTHER), "fp16"), budget_bytes=2**30)
    graphs = ControlNetGraphs(compiled=compiled)
    tol = COMPILED_TOL if compiled else TOL[torch.float16]
    model = cache.acquire("canny")
    try:
        for rows, scale, seed in ((2, 0.7, 0), (2, 1.0, 1), (2, 0.5, 2), (1, 0.8, 3)):
            call = on_other(random_call(model, rows=rows, scale=scale, seed=seed))
            want_down, want_mid = run_controlnet(model, call)
            down, mid = graphs.run(model, call)
            assert mid.device == OTHER
            assert rel_err(mid, want_mid) <= tol, (rows, seed)
            assert max(rel_err(a, b) for a, b in zip(down, want_down)) <= tol, (rows, seed)
    finally:
        cache.release("canny")
    assert graphs.captures == 2 and graphs.replays == 4
    if compiled:
        torch._dynamo.reset()


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("second") / "repo", ExportOptions())


def test_text_encoder_graphs_on_gpu1_equal_eager(repo):
    folder, where = repo / "text_encoder" / "1", Placement(str(OTHER), "fp16")
    graphed, eager = PromptEncoder(folder, where, graphs=True), PromptEncoder(folder, where)
    for prompt in ("a lighthouse", "a red boat at dawn", "a lighthouse"):
        params = validate({"prompt": prompt, "negative_prompt": "fog"}, Limits())
        for got, want in zip(graphed.encode(params), eager.encode(params)):
            assert np.abs(got.astype(np.float32) - want.astype(np.float32)).max() \
                <= TOL[torch.float16] * np.abs(want.astype(np.float32)).max(), prompt


def test_vae_graphs_on_gpu1_equal_eager(repo):
    folder, where = repo / "vae_decoder" / "1", Placement(str(OTHER), "fp32")
    graphed, eager = LatentDecoder(folder, where, graphs=True), LatentDecoder(folder, where)
    rng = np.random.default_rng(0)
    for _ in range(3):
        latents = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
        got, want = graphed.decode(latents), eager.decode(latents)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # uint8: a last-bit flip may round across
