"""Latent parallelism (backends/core/runtime/cfg_parallel.py) on CPU: both sides eager on the CPU,
each over its own copy of the weights, against the one-device runtime.

Tolerance: 1e-5 of the largest magnitude (fp32). Each side runs a sub-batch of the rows, and
oneDNN may block a convolution or product differently for another row count, so equality to the
last bit is not promised; the split itself moves no value (index copies only). The GPU tier
(tests/gpu/test_cfg_parallel.py) runs the two sides on two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from backends.core.adapters.controlnet import ControlInput, LocalControlNets
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.adapters.lora import load_lora
from backends.core.adapters.store import AdapterStore
from backends.core.engine.builder import build_runtime, template_batch
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.base import LoraSegment, StepBatch
from backends.core.runtime.cfg_parallel import CfgParallelRuntime, split_rows
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("cfgp") / "repo", ExportOptions())


@pytest.fixture(scope="module")
def folder(repo):
    return repo / "denoiser" / "1"


@pytest.fixture(scope="module")
def store(tiny_model):
    return AdapterStore(tiny_model / "adapters")


def test_split_puts_each_guided_half_on_its_own_side_and_balances_the_rest():
    split = split_rows((2, 1, 2, 1, 1))
    # rows: [u0 c0] [x1] [u2 c2] [x3] [x4]
    assert split.primary == (1, 2, 4, 6) and split.secondary == (0, 3, 5)
    assert split_rows((1,)).secondary == ()  # one request without guidance: one device
    assert split_rows((1, 1)) == split_rows((1, 1)).__class__((0,), (1,))
    with pytest.raises(ValueError, match="1 or 2 UNet rows, not 3"):
        split_rows((3,))


def parallel(folder) -> CfgParallelRuntime:
    runtime = build_runtime(folder, Placement(), RuntimeConfig(), cfg_parallel_device="cpu")
    assert isinstance(runtime, CfgParallelRuntime)
    assert runtime.secondary.weights_module is not runtime.primary.weights_module
    return runtime


def mixed_batch(unet, rows_per_request, seed=0, **extra) -> StepBatch:
    t = template_batch(unet, torch.device("cpu"), torch.float32)
    rows = sum(rows_per_request)
    g = torch.Generator().manual_seed(seed)
    return StepBatch(torch.randn(rows, *t.sample.shape[1:], generator=g), torch.linspace(900, 20, rows),
                     torch.randn(rows, *t.text.shape[1:], generator=g), torch.randn(rows, *t.pooled.shape[1:], generator=g),
                     t.time_ids.repeat(rows, 1), rows_per_request=rows_per_request, **extra)


def test_a_split_step_equals_the_one_device_step(folder, store):
    """Guided and unguided rows, ControlNet residuals and per-row LoRAs (unmerged, a mixed batch)."""
    runtime = parallel(folder)
    one = runtime.secondary  # the same weights, all rows on one side
    lora = load_lora("papercut", store.lora("papercut").path)
    segments = (LoraSegment(slice(0, 2), ((lora, 1.0),)), LoraSegment(slice(3, 5), ((lora, 0.5),)))
    for extra in ({}, {"lora_segments": segments}):
        batch = mixed_batch(runtime.weights_module, (2, 1, 2, 1), **extra)
        want_enc = one.encode(batch)
        residuals = ([torch.randn_like(s) for s in want_enc.skips], torch.randn_like(want_enc.mid))
        for res in (None, residuals):
            want = one.decode(batch, one.encode(batch), res)
            got = runtime.decode(batch, runtime.encode(batch), res)
            assert got.shape == want.shape and rel_err(got, want) <= TOL, (extra.keys(), res is None)
    # Without rows_per_request the whole batch runs on the primary.
    batch = mixed_batch(runtime.weights_module, (2, 2))
    whole = StepBatch(**{**batch.__dict__, "rows_per_request": None})
    assert torch.equal(runtime.decode(whole, runtime.encode(whole), None),
                       runtime.primary.decode(whole, runtime.primary.encode(whole), None))
    bad = StepBatch(**{**batch.__dict__, "rows_per_request": (2, 1)})
    with pytest.raises(ValueError, match="does not add up to the batch's 4 rows"):
        runtime.encode(bad)


def test_text_goes_over_again_only_for_a_new_text_key(folder):
    runtime = parallel(folder)
    batch = mixed_batch(runtime.weights_module, (2, 2), text_key=("k", 1))
    first = runtime.decode(batch, runtime.encode(batch), None)
    sent = runtime._sent[1][1][0]
    again = runtime.decode(batch, runtime.encode(batch), None)
    assert runtime._sent[1][1][0] is sent and torch.equal(first, again)
    # New text under a new key is sent, and changes the step.
    other = StepBatch(**{**batch.__dict__, "text": batch.text.flip(0), "text_key": ("k", 2)})
    changed = runtime.decode(other, runtime.encode(other), None)
    assert runtime._sent[1][1][0] is not sent and not torch.equal(changed, first)


def run_requests(engine: TorchDenoiser, jobs) -> list[torch.Tensor]:
    with engine.on_stream():
        states = [engine.start(job) for job in jobs]
        while states[0].index < len(states[0].timesteps):
            engine.step(states)
    return [torch.from_numpy(engine.result(s)) for s in states]


def test_denoiser_on_two_sides_reproduces_one_side_with_a_merged_lora(repo, folder, store):
    """Whole requests through the engine: one with guidance, one without (its row on one side),
    sharing a LoRA that is merged into both copies of the weights."""
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    lora = ((load_lora("papercut", store.lora("papercut").path), 0.8),)
    jobs = []
    for i, guidance in enumerate((5.0, 1.0)):
        params = validate({"prompt": f"a red fox {i}", "steps": 4, "width": 64, "height": 64, "seed": i,
                           "guidance_scale": guidance, "loras": [{"name": "papercut", "scale": 0.8}]}, Limits())
        jobs.append(DenoiseJob(f"r{i}", params, *encoder.encode(params), loras=lora))
    one = TorchDenoiser(folder, Placement())
    two = TorchDenoiser(folder, Placement(), runtime=parallel(folder))
    want, got = run_requests(one, jobs), run_requests(two, jobs)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4  # four steps of fp32 differences compound
    merged = [dict(m.named_parameters()) for m in two.runtime.weight_copies]
    name = next(n for n in merged[0] if "to_q" in n)
    assert torch.equal(merged[0][name], merged[1][name])  # both copies carry the merge
    for engine in (one, two):
        engine.loras.merger.restore()
    assert torch.equal(merged[1][name], dict(one.unet.named_parameters())[name])  # both restored


def test_cfg_parallel_device_is_checked(folder):
    with pytest.raises(ValueError, match="cfg_parallel_device: 'gpu1' is not cpu or cuda:N"):
        DenoiserConfig(cfg_parallel_device="gpu1")
    with pytest.raises(ValueError, match="both halves run on GPUs, or both on the CPU"):
        build_runtime(folder, Placement(), RuntimeConfig(), cfg_parallel_device="cuda:1")


class CountingControlNets(LocalControlNets):
    """LocalControlNets that records each call's rows and where its residuals are to go."""

    def __init__(self, cache):
        super().__init__(cache)
        self.calls = []

    def submit(self, call):
        self.calls.append((call.sample.shape[0], call.device, call.session))
        return super().submit(call)


@pytest.mark.parametrize("mode", ["sync", "pipelined"])
def test_controlnets_split_with_the_rows(repo, folder, store, mode):
    """A guided request's ControlNets are called once per row, each side's residuals made for its
    rows; an unguided request's once. Latents equal the one-device denoiser's (which calls them
    on both rows at once) within tolerance, windows and two ControlNets included."""
    import numpy as np
    from PIL import Image

    def hint(seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 80, 3), dtype=np.uint8))

    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    jobs = []
    for i, guidance in enumerate((5.0, 1.0)):
        params = validate({"prompt": f"a house {i}", "steps": 4, "width": 64, "height": 64, "seed": i,
                           "guidance_scale": guidance}, Limits())
        controls = [ControlInput("canny", hint(1), 0.8), ControlInput("depth", hint(2), 0.6, 0.25, 1.0)]
        jobs.append(DenoiseJob(f"r{i}", params, *encoder.encode(params), controls=controls))
    cache = ControlNetCache(store, Placement(), budget_bytes=2**30)
    one = TorchDenoiser(folder, Placement(), LocalControlNets(cache), controlnet_mode=mode)
    provider = CountingControlNets(cache)
    two = TorchDenoiser(folder, Placement(), provider, controlnet_mode=mode, runtime=parallel(folder))
    for g, w in zip(run_requests(two, jobs), run_requests(one, jobs)):
        assert rel_err(g, w) <= 1e-4
    assert {rows for rows, _, _ in provider.calls} == {1}  # every call on one row
    # The guided request: its two rows' calls are separate sessions; the unguided one has one row.
    assert {session for *_, session in provider.calls} == {"r0/0/0", "r0/0/1", "r0/1/0", "r0/1/1", "r1/0", "r1/1"}


def test_a_row_split_calls_each_row_alone_in_one_place(repo, folder, store):
    """DenoiserConfig.controlnet_row_split without latent parallelism: a guided request's
    ControlNets are called per row (two instances of the service may then share the work), with
    the residuals put back together; latents equal the unsplit denoiser's within tolerance."""
    import numpy as np
    from PIL import Image

    hint = Image.fromarray(np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8))
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    jobs = []
    for i, guidance in enumerate((5.0, 1.0)):
        params = validate({"prompt": f"a boat {i}", "steps": 3, "width": 64, "height": 64, "seed": i,
                           "guidance_scale": guidance}, Limits())
        jobs.append(DenoiseJob(f"r{i}", params, *encoder.encode(params), controls=[ControlInput("canny", hint, 0.9)]))
    cache = ControlNetCache(store, Placement(), budget_bytes=2**30)
    provider = CountingControlNets(cache)
    split = TorchDenoiser(folder, Placement(), provider, controlnet_row_split=True)
    whole = TorchDenoiser(folder, Placement(), LocalControlNets(cache))
    for g, w in zip(run_requests(split, jobs), run_requests(whole, jobs)):
        assert rel_err(g, w) <= 1e-4
    assert {rows for rows, _, _ in provider.calls} == {1}
    assert {device for _, device, _ in provider.calls} == {None}  # (one place: the sample's device)
    assert {session for *_, session in provider.calls} == {"r0/0/0", "r0/0/1", "r1/0"}


def test_a_field_added_to_step_batch_reaches_both_sides(folder):
    """Runtimes derive a side's batch with StepBatch.map_rows, which carries every field: a field
    added to StepBatch later (here by a subclass) reaches both sides' runtimes as it was, and a
    per-row tensor is split with the rows."""
    from dataclasses import dataclass

    @dataclass
    class Tagged(StepBatch):
        tag: str | None = None

    runtime = parallel(folder)
    seen = []
    for side in (runtime.primary, runtime.secondary):
        encode = side.encode
        side.encode = lambda batch, encode=encode: (seen.append(batch), encode(batch))[1]
    batch = mixed_batch(runtime.weights_module, (2, 1, 2), seed=3)
    runtime.encode(Tagged(**{f.name: getattr(batch, f.name) for f in batch.__dataclass_fields__.values()},
                          tag="kept"))
    assert len(seen) == 2 and all(isinstance(b, Tagged) and b.tag == "kept" for b in seen)
    assert sorted(b.rows for b in seen) == [2, 3] and all(b.rows_per_request is None for b in seen)
    moved = batch.map_rows(lambda t: t[:1])
    assert moved.rows == 1 and moved.rows_per_request == batch.rows_per_request  # (the rest as it was)
