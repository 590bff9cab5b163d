"""The fast torch runtime on a GPU (backends/core/runtime/torch_fast.py), against the eager one.

Tiny models, so that the tier runs in minutes. Tolerances, relative to the largest magnitude of
the eager output: fp32 1e-5 with TF32 off (graph replay runs the same kernels, but cuBLAS/cuDNN
may pick other algorithms while capturing; with torch's default, cuDNN convolutions in TF32, eager
and graphs differed by 1.7e-4 on the H200), fp16 2e-3 (half a dozen fp16 ulps), compiled fp16
1e-2 (inductor fuses and reorders reductions). Run with `tests/gpu/run.sh` on the GPU machine;
skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from backends.core.adapters.lora import LoraMerger, load_lora
from backends.core.adapters.store import AdapterStore
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.base import StepBatch
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.runtime.torch_eager import EagerUNetRuntime
from backends.core.runtime.torch_fast import FastUNetRuntime
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
COMPILED_TOL = 1e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 comparisons in full fp32: cuDNN's TF32 convolutions (torch's default) pick per algorithm."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("fast") / "repo", ExportOptions())


def runtimes(repo, dtype: str, config: RuntimeConfig):
    where = Placement("cuda:0", dtype)
    folder = repo / "denoiser" / "1"
    eager = EagerUNetRuntime(*load_unet_halves(folder, where))
    fast = FastUNetRuntime(EagerUNetRuntime(*load_unet_halves(folder, where)), config, cache_root=folder)
    return eager, fast


def batch(unet, rows: int, h: int = 8, w: int = 8, seed: int = 0, dtype=torch.float16) -> StepBatch:
    cfg = unet.config
    g = torch.Generator("cpu").manual_seed(seed)
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to("cuda", dtype)

    return StepBatch(rnd(rows, cfg.in_channels, h, w), torch.linspace(900, 10, rows).cuda(),
                     rnd(rows, 77, cfg.cross_attention_dim), rnd(rows, pooled),
                     torch.tensor([[8.0 * h, 8.0 * w, 0, 0, 8.0 * h, 8.0 * w]]).repeat(rows, 1).to("cuda", dtype))


def step(runtime, b: StepBatch, residuals=None) -> torch.Tensor:
    enc = runtime.encode(b)
    return runtime.decode(b, enc, residuals)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_graphs_equal_eager_for_every_row_count(repo, dtype):
    eager, fast = runtimes(repo, dtype, RuntimeConfig(kind="graphs", row_buckets=(2, 4)))
    tdtype = Placement(dtype=dtype).torch_dtype
    for rows in (1, 2, 3, 4):
        b = batch(eager.weights_module, rows, dtype=tdtype, seed=rows)
        want = step(eager, b)
        for _ in range(2):  # the second replay reuses the captured graph
            assert rel_err(step(fast, b), want) <= TOL[tdtype], rows
    assert fast.stats.captures == 4 and fast.stats.graph_steps == 8  # 2 buckets x (encoder + decoder)
    b = batch(eager.weights_module, 5, dtype=tdtype)  # more rows than the largest bucket: eager
    assert rel_err(step(fast, b), step(eager, b)) <= TOL[tdtype]
    assert fast.stats.eager_steps == 1


def test_graphs_with_controlnet_residuals_equal_eager(repo):
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,)))
    b = batch(eager.weights_module, 2)
    enc = eager.encode(b)
    g = torch.Generator("cpu").manual_seed(7)
    residuals = ([torch.randn(s.shape, generator=g).to(s) for s in enc.skips], torch.randn(enc.mid.shape, generator=g).to(enc.mid))
    want = eager.decode(b, enc, residuals)
    assert rel_err(step(fast, b, residuals), want) <= TOL[torch.float16]
    assert rel_err(step(fast, b), step(eager, b)) <= TOL[torch.float16]  # both decoder graphs coexist
    assert rel_err(want, step(eager, b)) > 10 * TOL[torch.float16]  # the residuals mattered


def test_lora_merge_is_seen_by_captured_graphs(repo, tiny_model):
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,)))
    b = batch(eager.weights_module, 2)
    before = step(fast, b)  # captured on the base weights
    store = AdapterStore(tiny_model / "adapters")
    lora = load_lora("papercut", store.lora("papercut").path)
    for runtime in (eager, fast):
        LoraMerger(runtime.weights_module).merge([(lora, 1.0)])
    want = step(eager, b)
    got = step(fast, b)  # the same graph, replayed after the in-place merge
    assert fast.stats.captures == 2
    assert rel_err(got, want) <= TOL[torch.float16]
    assert rel_err(got, before) > 10 * TOL[torch.float16]


def test_packed_text_projections_follow_the_text_key(repo):
    """The text's cross-attention K/V are computed when the batch's text_key changes and reused
    while it stays (the key promises the same text); a refit makes them anew. Unpacked: equal."""
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,)))
    assert fast.text_projections is not None
    a, b = batch(eager.weights_module, 2, seed=1), batch(eager.weights_module, 2, seed=2)
    a.text_key, b.text_key = ("a",), ("b",)
    want_a, want_b = step(eager, a), step(eager, b)
    assert rel_err(step(fast, a), want_a) <= TOL[torch.float16]
    assert rel_err(step(fast, b), want_b) <= TOL[torch.float16]
    stale = batch(eager.weights_module, 2, seed=2)
    stale.text = a.text.clone()
    stale.text_key = ("b",)  # a broken promise shows that the projections were reused, not recomputed
    assert rel_err(step(fast, stale), want_b) <= TOL[torch.float16]
    for runtime in (eager, fast):
        params = dict(runtime.weights_module.named_parameters())
        runtime.refit({n: 4 * p for n, p in params.items() if n.endswith(("attn2.to_k.weight", "attn2.to_v.weight"))})
    assert rel_err(step(fast, b), step(eager, b)) <= TOL[torch.float16]
    assert rel_err(step(eager, b), want_b) > 10 * TOL[torch.float16]  # the refit mattered
    _, unpacked = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,), packed_attention=False))
    assert unpacked.text_projections is None
    assert rel_err(step(unpacked, a), want_a) <= TOL[torch.float16]


def test_denoiser_batches_that_change_reuse_no_stale_text(repo, tiny_model):
    """Requests joining and leaving a batch (the text rows change) and a LoRA merged for one of
    them, through the engine on graphs, against the eager engine stepping the same batches. fp32."""
    where = Placement("cuda:0", "fp32")
    folder = repo / "denoiser" / "1"
    lora = load_lora("papercut", AdapterStore(tiny_model / "adapters").lora("papercut").path)
    _, fast_runtime = runtimes(repo, "fp32", RuntimeConfig(kind="graphs"))
    engines = (TorchDenoiser(folder, where), TorchDenoiser(folder, where, runtime=fast_runtime))
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    jobs = []
    for rid, prompt, seed, steps in (("a", "a red fox", 3, 5), ("b", "a blue bird", 4, 4)):
        params = validate({"prompt": prompt, "steps": steps, "width": 64, "height": 64, "seed": seed}, Limits())
        jobs.append((rid, params, *encoder.encode(params)))
    out = []
    for engine in engines:
        with engine.on_stream():
            a = engine.start(DenoiseJob(*jobs[0]))
            engine.step([a])
            engine.step([a])
            b = engine.start(DenoiseJob(*jobs[1], loras=((lora, 1.0),)))
            engine.step([b, a])  # b joins, with its own LoRA: a mixed batch (eager, unmerged terms)
            engine.step([b, a])
            engine.step([a])  # base weights again, a alone
            engine.step([b])  # b alone: its LoRA merged, in the same 2-row bucket as a
            engine.step([b])
        out.append([torch.from_numpy(engine.result(s)) for s in (a, b)])
    for got, want in zip(out[1], out[0]):
        assert rel_err(got, want) <= 1e-4
    assert fast_runtime.stats.graph_steps == 5  # the two mixed steps ran eager


def test_bucket_miss_runs_eager_or_captures(repo):
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,), capture_on_miss=False))
    b = batch(eager.weights_module, 2, h=9, w=13)  # no bucket for 9x13 and misses are not captured
    assert rel_err(step(fast, b), step(eager, b)) <= TOL[torch.float16]
    assert fast.stats.misses == {(9, 13): 1} and fast.stats.captures == 0
    fast.warmup(batch(eager.weights_module, 1), [(9, 13)])
    assert fast.stats.captures == 2 and fast.stats.warmup_s > 0
    assert rel_err(step(fast, b), step(eager, b)) <= TOL[torch.float16]
    assert fast.stats.graph_steps == 1


def eager_and_graphs_denoisers(repo, config: RuntimeConfig = RuntimeConfig(kind="graphs")):
    """fp32 on cuda:0: a denoiser on the eager runtime, one on a fast runtime (graphs unless
    `config` says) and that runtime, and the prompt encoder."""
    where = Placement("cuda:0", "fp32")
    folder = repo / "denoiser" / "1"
    _, fast_runtime = runtimes(repo, "fp32", config)
    return (TorchDenoiser(folder, where), TorchDenoiser(folder, where, runtime=fast_runtime), fast_runtime,
            PromptEncoder(repo / "text_encoder" / "1", where))


def test_denoiser_on_graphs_reproduces_the_eager_denoiser(repo):
    """A whole request through the engine, fp32: the fast runtime's latents against eager's. (In
    fp16 the tiny random model amplifies per-step rounding differences to 8% over 6 steps.)"""
    eager, fast, fast_runtime, encoder = eager_and_graphs_denoisers(repo)
    params = validate({"prompt": "a red fox", "steps": 6, "width": 64, "height": 64, "seed": 3}, Limits())
    embeds, pooled = encoder.encode(params)
    out = []
    for engine in (eager, fast):
        # start() on the loop's stream too, as the loop admits requests: the stream does not wait
        # for the default one, so latents made there could still be in flight at the first step.
        with engine.on_stream():
            state = engine.start(DenoiseJob("r", params, embeds, pooled))
            while state.index < len(state.timesteps):
                engine.step([state])
        out.append(torch.from_numpy(engine.result(state)))
    assert rel_err(out[1], out[0]) <= 1e-4  # 6 steps of fp32 differences compound
    assert fast_runtime.stats.graph_steps == 6


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "dpmpp_2m_karras"])
def test_admission_does_not_wait_for_the_gpu(repo, scheduler):
    """A request admitted while others' steps are queued: start() makes no synchronizing call (a
    pageable copy would idle the GPU until the queue drains), and its first step sees its noise."""
    where = Placement("cuda:0", "fp16")
    engine = TorchDenoiser(repo / "denoiser" / "1", where)
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    params = validate({"prompt": "a red fox", "steps": 4, "width": 64, "height": 64, "seed": 3,
                       "scheduler": scheduler}, Limits())
    embeds, pooled = encoder.encode(params)
    with engine.on_stream():
        reference = engine.start(DenoiseJob("a", params, embeds, pooled))
        torch.cuda._sleep(100_000_000)  # the GPU is busy when the next request arrives
        torch.cuda.set_sync_debug_mode("error")
        try:
            state = engine.start(DenoiseJob("b", params, embeds, pooled))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(state.latents, reference.latents)
    assert torch.equal(state.embeds, reference.embeds) and torch.equal(state.time_ids, reference.time_ids)


def test_the_engines_stream_waits_for_what_the_caller_queued_on_the_same_graphs(repo):
    """A caller queues a step on the runtime's graphs on its own stream, then hands the engine a
    step on the same bucket: the engine's stream must not write the bucket's buffers before the
    caller's step has read them. A GPU sleep between the caller's two halves holds its step
    back, so without the wait the engine's encoder replay lands in between every time (what made
    bench/micro/fp8_probe.py report FP8 127% away from fp16: bench/results/2026-11-23i-h200)."""
    where = Placement("cuda:0", "fp16")
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,)))
    engine = TorchDenoiser(repo / "denoiser" / "1", where, runtime=fast)
    mine, theirs = batch(eager.weights_module, 2, seed=1), batch(eager.weights_module, 2, seed=2)
    want = step(fast, mine)
    with torch.inference_mode():
        enc = fast.encode(mine)
        encoded = torch.cuda.Event()
        encoded.record()
        torch.cuda._sleep(100_000_000)  # about 50 ms of the caller's stream
        got = fast.decode(mine, enc, None)
        encoded.synchronize()  # the caller's encoder half has run; its decoder half waits behind the sleep
        with engine.on_stream():
            fast.decode(theirs, fast.encode(theirs), None)
    torch.cuda.synchronize()
    assert torch.equal(got, want)


def test_compiled_equals_eager(repo):
    import dataclasses

    from torch._dynamo.utils import counters

    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="compiled", row_buckets=(2,)))
    b = batch(eager.weights_module, 2)
    assert rel_err(step(fast, b), step(eager, b)) <= COMPILED_TOL  # no bucket yet: a miss runs eager
    assert fast.stats.misses == {(8, 8): 1} and fast.stats.captures == 0  # compiling is for warm-up only
    fast.warmup(batch(eager.weights_module, 1), [(8, 8)])
    compiles = counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"]
    fast.config = dataclasses.replace(fast.config, row_buckets=(4,))
    fast.warmup(batch(eager.weights_module, 1), [(8, 8)])
    # The row count is dynamic for the compiler: the second bucket reuses the first one's compile.
    assert counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_hit"] == compiles
    for rows in (2, 3):
        b = batch(eager.weights_module, rows, seed=rows)
        assert rel_err(step(fast, b), step(eager, b)) <= COMPILED_TOL
    assert fast.caps.compiled and fast.stats.captures == 4 and fast.stats.graph_steps == 2


_COLD_START = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.runtime.torch_eager import EagerUNetRuntime
from backends.core.runtime.torch_fast import FastUNetRuntime
from backends.core.engine.builder import template_batch
from pathlib import Path
folder = Path(sys.argv[1])
start = time.perf_counter()
where = Placement("cuda:0", "fp16")
eager = EagerUNetRuntime(*load_unet_halves(folder, where))
fast = FastUNetRuntime(eager, RuntimeConfig(kind="compiled", row_buckets=(2,), compile_cache=sys.argv[2]), folder)
fast.warmup(template_batch(eager.weights_module, torch.device("cuda:0"), torch.float16), [(8, 8)])
print(json.dumps({"seconds": time.perf_counter() - start, "hits": counters["inductor"]["fxgraph_cache_hit"],
                  "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def test_restart_loads_compiled_halves_from_the_disk_cache(repo, tmp_path):
    """Two processes on one cache folder: the second compiles nothing (inductor's FX graph cache
    hits for every graph). Whether that makes it faster is the benchmark's business."""
    cache = tmp_path / "compile_cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR")}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _COLD_START, str(repo / "denoiser" / "1"), str(cache)],
                             env=env, capture_output=True, text=True, timeout=600, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["misses"] > 0 and first["hits"] == 0, first
    assert second["misses"] == 0 and second["hits"] >= first["misses"], second
    assert any(cache.rglob("*")), "nothing was written to the compile cache"


def test_runtime_refit_writes_in_place(repo):
    eager, fast = runtimes(repo, "fp16", RuntimeConfig(kind="graphs", row_buckets=(2,)))
    b = batch(eager.weights_module, 2)
    before = step(fast, b)
    name, param = next((n, p) for n, p in fast.weights_module.named_parameters() if n.endswith("conv_out.weight"))
    ptr = param.data_ptr()
    fast.refit({name: torch.zeros_like(param)})
    assert param.data_ptr() == ptr and not param.any()
    after = step(fast, b)
    assert not torch.equal(after, before)
    with pytest.raises(KeyError, match="no weight 'nope'"):
        fast.refit({"nope": torch.zeros(1)})


def test_vae_graphs_equal_eager(repo):
    import numpy as np

    from backends.core.stages.vae_decoding import HalfPrecisionAttention, LatentDecoder

    folder = repo / "vae_decoder" / "1"
    eager = LatentDecoder(folder, Placement("cuda:0", "fp16"))
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    want = eager.decode(latents)
    for options in ({}, {"channels_last": True}, {"fused_kernels": True}, {"fused_kernels": True, "channels_last": True}):
        fast = LatentDecoder(folder, Placement("cuda:0", "fp16"), graphs=True, **options)
        for _ in range(2):
            got = fast.decode(latents)
            assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, options  # within 1/255
        assert len(fast._graphs) == 1
    for dtype in (torch.bfloat16, torch.float16):  # the attention product in half precision (approximate)
        fast = LatentDecoder(folder, Placement("cuda:0", "fp16"), graphs=True, fused_kernels=True,
                             attention_dtype=dtype)
        assert isinstance(fast.vae.decoder.mid_block.attentions[0].processor, HalfPrecisionAttention)
        assert np.abs(fast.decode(latents).astype(int) - want.astype(int)).max() <= 2, dtype


def test_text_encoder_graphs_equal_eager(repo):
    """Both CLIP encoders as CUDA graphs: the same kernels, so the same embeddings (fp16, bit for
    bit on the H200; the tolerance allows a capture's other cuBLAS algorithm); a negative prompt
    replays the graphs again without overwriting the prompt's outputs."""
    folder = repo / "text_encoder" / "1"
    eager = PromptEncoder(folder, Placement("cuda:0", "fp16"))
    fast = PromptEncoder(folder, Placement("cuda:0", "fp16"), graphs=True)
    for prompt, negative in (("a lighthouse", None), ("a red car", "blurry"), ("a yellow boat", "")):
        params = validate({"prompt": prompt, "negative_prompt": negative, "width": 64, "height": 64},
                          Limits())
        (want, want_pooled), (got, got_pooled) = eager.encode(params), fast.encode(params)
        scale = max(np.abs(want).max(), 1e-6)
        assert np.abs(got - want).max() / scale <= TOL[torch.float16], prompt
        assert np.abs(got_pooled - want_pooled).max() / max(np.abs(want_pooled).max(), 1e-6) <= TOL[torch.float16]
    assert len(fast._graphs) == 2  # one per encoder, reused by every prompt
