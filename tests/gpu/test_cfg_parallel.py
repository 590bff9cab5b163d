"""Latent parallelism on two GPUs (backends/core/runtime/cfg_parallel.py): each side a graphed or
compiled runtime on its own GPU, against the one-GPU runtime.

Tolerances as in test_fast_runtime.py, relative to the largest magnitude: fp32 1e-5 a step with
TF32 off, fp16 2e-3 (each GPU runs a sub-batch of the rows, whose kernels may be picked for
another row count), compiled 1e-2; whole requests 1e-4 in fp32. Needs two GPUs: run with
`tests/gpu/run.sh` on a host with two GPUs; skipped elsewhere.
"""

from __future__ import annotations

import threading

import pytest
import torch

from backends.core.adapters.lora import load_lora
from backends.core.adapters.store import AdapterStore
from backends.core.engine.builder import build_denoiser, build_runtime
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.base import StepBatch
from backends.core.runtime.cfg_parallel import CfgParallelRuntime
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository
from tests.gpu.test_fast_runtime import TOL, batch, no_tf32, rel_err, step  # noqa: F401 (autouse fixture)
from tests.unit.test_cfg_parallel import run_requests

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="latent parallelism needs two GPUs")]


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("cfgp-gpu") / "repo", ExportOptions())


@pytest.fixture(scope="module")
def folder(repo):
    return repo / "denoiser" / "1"


def pair(folder, dtype: str, kind: str = "graphs") -> CfgParallelRuntime:
    runtime = build_runtime(folder, Placement("cuda:0", dtype), RuntimeConfig(kind=kind, row_buckets=(1, 2, 4)),
                            cfg_parallel_device="cuda:1")
    assert next(runtime.secondary.weights_module.parameters()).device == torch.device("cuda:1")
    return runtime


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_split_step_on_two_gpus_equals_one_gpu(folder, dtype):
    tdtype = Placement(dtype=dtype).torch_dtype
    one = build_runtime(folder, Placement("cuda:0", dtype), RuntimeConfig())  # eager: the reference
    two = pair(folder, dtype)
    b = batch(one.weights_module, 5, dtype=tdtype)
    b = StepBatch(**{**b.__dict__, "rows_per_request": (2, 1, 2)})
    enc = one.encode(b)
    g = torch.Generator("cpu").manual_seed(7)
    residuals = ([torch.randn(s.shape, generator=g).to(s) for s in enc.skips],
                 torch.randn(enc.mid.shape, generator=g).to(enc.mid))
    for res in (None, residuals):
        want = step(one, b, res)
        for _ in range(2):  # capture, then replay
            got = step(two, b, res)
            assert got.device == torch.device("cuda:0") and rel_err(got, want) <= TOL[tdtype], res is None
    assert two.primary.stats.graph_steps == 4 and two.secondary.stats.graph_steps == 4


def test_denoiser_on_two_gpus_reproduces_one_gpu_with_a_merged_lora(repo, folder, tiny_model):
    """Whole requests, fp32 graphs: one with guidance (its halves on both GPUs), one without (one
    GPU), sharing a LoRA merged into both GPUs' weights after the graphs were captured."""
    where = Placement("cuda:0", "fp32")
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    store = AdapterStore(tiny_model / "adapters")
    lora = ((load_lora("papercut", store.lora("papercut").path), 0.8),)
    one = TorchDenoiser(folder, where, runtime=build_runtime(folder, where, RuntimeConfig(kind="graphs")))
    two = TorchDenoiser(folder, where, runtime=pair(folder, "fp32"))
    for loras in ((), lora):
        jobs = []
        for i, guidance in enumerate((5.0, 1.0)):
            params = validate({"prompt": f"a red fox {i}", "steps": 5, "width": 64, "height": 64, "seed": i,
                               "guidance_scale": guidance}, Limits())
            jobs.append(DenoiseJob(f"r{i}", params, *encoder.encode(params), loras=loras))
        want, got = run_requests(one, jobs), run_requests(two, jobs)
        for g, w in zip(got, want):
            assert rel_err(g, w) <= 1e-4, loras
    assert two.runtime.secondary.stats.graph_steps > 0


def test_builder_warms_both_gpus_and_serves_compiled(repo, folder):
    """The wiring a deployment runs: compiled halves on both GPUs, warmed at load."""
    config = DenoiserConfig(runtime=RuntimeConfig(kind="compiled", row_buckets=(1, 2), warmup_sizes=((8, 8),)),
                            cfg_parallel_device="cuda:1", max_running=2, max_batch_rows=4)
    done, event = [], threading.Event()

    def on_done(result):
        done.append(result)
        event.set()

    where = Placement("cuda:0", "fp16")
    denoiser = build_denoiser(config, folder, where, on_done)
    runtime = denoiser.engine.runtime
    assert runtime.caps.name == "cfg-parallel compiled" and runtime.secondary.stats.captures == 4
    params = validate({"prompt": "a boat", "steps": 3, "width": 64, "height": 64, "seed": 2}, Limits())
    denoiser.loop.start()
    try:
        denoiser.loop.submit(DenoiseJob("r1", params, *PromptEncoder(repo / "text_encoder" / "1", where).encode(params)))
        assert event.wait(300)
    finally:
        denoiser.shutdown()
    (result,) = done
    assert result.error is None and result.latents.shape == (1, 4, 8, 8)
    assert runtime.secondary.stats.graph_steps == 3 and runtime.secondary.stats.eager_steps == 0


def test_controlnets_split_over_two_gpus(repo, folder, tiny_model):
    """ControlNets called once per row, each row's residuals made for its GPU, the ControlNets as
    CUDA graphs: fp32 latents against the one-GPU denoiser calling them eagerly on both rows."""
    import numpy as np
    from PIL import Image

    from backends.core.adapters.controlnet import ControlInput, LocalControlNets
    from backends.core.adapters.controlnet_cache import ControlNetCache

    where = Placement("cuda:0", "fp32")
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    hint = Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    jobs = []
    for i, guidance in enumerate((5.0, 1.0)):
        params = validate({"prompt": f"a house {i}", "steps": 4, "width": 64, "height": 64, "seed": i,
                           "guidance_scale": guidance}, Limits())
        jobs.append(DenoiseJob(f"r{i}", params, *encoder.encode(params), controls=[ControlInput("canny", hint, 0.8)]))
    cache = ControlNetCache(AdapterStore(tiny_model / "adapters"), where, budget_bytes=2**30)
    one = TorchDenoiser(folder, where, LocalControlNets(cache))
    provider = LocalControlNets(cache, graphs=True)
    two = TorchDenoiser(folder, where, provider, runtime=pair(folder, "fp32"))
    for g, w in zip(run_requests(two, jobs), run_requests(one, jobs)):
        assert rel_err(g, w) <= 1e-4
    assert provider.graphs.captures == 1 and provider.graphs.replays == 12  # 4 steps x 3 rows, one shape
