"""The fast runtime's FP8 mode (RuntimeConfig.fp8, backends/core/runtime/fp8.py) on a GPU: an
approximate mode, so its error against the exact fp16 step is bounded, not zero.

Bounds, as relative RMS errors: FP8 against fp16 <= 10% (e4m3 rounds each operand by up to 6.25%;
the tiny UNet's noise moved by 4.4% on a CPU, tests/unit/test_fp8.py) and > 0.1% (FP8 really ran);
a graph replayed against the same FP8 modules run eager: the fp16 tolerance of
tests/gpu/test_fast_runtime.py (2e-3 of the largest magnitude). Run with `tests/gpu/run.sh`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.core.adapters.lora import LoraMerger, load_lora
from backends.core.adapters.store import AdapterStore
from backends.core.engine.builder import build_runtime
from backends.core.runtime.artifacts import UNET_DIR, load_unet_halves
from backends.core.runtime.base import LoraSegment
from backends.core.runtime.config import FP8_PARTS, RuntimeConfig
from backends.core.runtime.fp8 import CALIBRATION_FILE, Fp8Linear
from backends.core.runtime.placement import Placement
from backends.core.runtime.torch_eager import EagerUNetRuntime
from clients.bench.common import rel_rms
from export.repository import ExportOptions, export_repository
from tests.gpu.test_fast_runtime import TOL, batch, rel_err, step

pytestmark = pytest.mark.gpu
CONFIG = RuntimeConfig(kind="graphs", row_buckets=(2,), fp8=FP8_PARTS)


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    repo = export_repository(tiny_model, tmp_path_factory.mktemp("fp8") / "repo",
                             ExportOptions(device="cuda", gpus=(0,), runtime="graphs", fp8=FP8_PARTS))
    folder = repo / "denoiser_gpu0" / "1"
    assert (folder / UNET_DIR / CALIBRATION_FILE).is_file()  # export wrote the calibration data
    return folder


def runtimes(folder, config=CONFIG):
    where = Placement("cuda:0", "fp16")
    return EagerUNetRuntime(*load_unet_halves(folder, where)), build_runtime(folder, where, config)


@pytest.mark.parametrize("fast_accum", [False, True])
def test_fp8_graphs_stay_near_the_fp16_step(folder, fast_accum):
    exact, fp8 = runtimes(folder, dataclasses.replace(CONFIG, fp8_fast_accum=fast_accum))
    assert fp8.fp8_layers and all(float(layer.x_scale) > 0 for layer in fp8.fp8_layers)
    assert all(layer.fast_accum == fast_accum for layer in fp8.fp8_layers)
    for rows in (1, 2):
        b = batch(exact.weights_module, rows, seed=rows)
        error = rel_rms(step(fp8, b), step(exact, b))
        assert 1e-3 < error <= 0.10, f"{rows} rows: relative RMS error {error:.4f}"
    assert fp8.stats.graph_steps == 2


def test_a_lora_merge_reaches_the_fp8_copies_in_the_graphs(folder, tiny_model):
    """The merge writes the fp16 weights; weights_written() requantizes their e4m3 copies in place,
    which the captured graph reads. Compared with the same FP8 modules run eager."""
    _, fp8 = runtimes(folder)
    b = batch(fp8.weights_module, 2)
    before = step(fp8, b)  # captured on the base weights
    lora = load_lora("papercut", AdapterStore(tiny_model / "adapters").lora("papercut").path)
    LoraMerger(fp8.weights_module).merge([(lora, 1.0)])
    stale = step(fp8, b)
    fp8.weights_written()
    got = step(fp8, b)
    want = step(fp8.eager, b)
    assert rel_err(got, want) <= TOL[torch.float16]
    assert rel_err(got, before) > 10 * TOL[torch.float16]
    assert rel_err(stale, got) > 10 * TOL[torch.float16]  # before requantizing, the graph read the old copies


def test_unmerged_lora_terms_hook_onto_the_fp8_layers(folder, tiny_model):
    """A batch that mixes LoRAs runs eager with each request's low-rank terms hooked onto the
    layers: in FP8 mode those are the Fp8Linear modules, so the terms must still apply."""
    _, fp8 = runtimes(folder)
    assert any(isinstance(m, Fp8Linear) for m in fp8.eager.layers.modules.values())
    lora = load_lora("papercut", AdapterStore(tiny_model / "adapters").lora("papercut").path)
    b = batch(fp8.weights_module, 2)
    base = step(fp8.eager, b)
    unmerged = step(fp8, dataclasses.replace(b, lora_segments=(LoraSegment(slice(0, 2), ((lora, 1.0),)),)))  # (runs eager: a batch with segments has no bucket)
    LoraMerger(fp8.weights_module).merge([(lora, 1.0)])
    fp8.weights_written()
    merged = step(fp8.eager, b)
    assert rel_err(unmerged, base) > 10 * TOL[torch.float16]  # the terms applied
    # FP8(base) + exact terms against FP8(base + terms): the two round differently.
    assert rel_rms(unmerged, merged) <= 0.10


def test_a_compiled_fp8_runtime_after_a_compiled_fp16_one_in_the_same_process(folder, tmp_path):
    """Two compiled runtimes of different modules in one process (dynamo keeps compiled code per
    function, not per module): the FP8 one, compiled after an fp16 one was dropped, runs its own
    modules. The graph replayed against the same FP8 modules run eager. (Suspected of the probe's
    127-131% in bench/results/2026-11-23h-h200; that was a race between streams:
    bench/results/2026-11-23i-h200/notes.md.)"""
    where = Placement("cuda:0", "fp16")

    def compiled(fp8):
        runtime = build_runtime(folder, where, RuntimeConfig(kind="compiled", row_buckets=(2,), fp8=fp8,
                                                            compile_cache=str(tmp_path / "compile_cache")))
        runtime.warmup(batch(runtime.weights_module, 1), [(8, 8)])
        return runtime

    fp16 = compiled(())
    b = batch(fp16.weights_module, 2, seed=5)
    exact = step(fp16, b)
    fp16 = None  # as the probe did: its modules' memory goes back before the next runtime is built
    torch.cuda.empty_cache()
    fp8 = compiled(FP8_PARTS)
    got = step(fp8, b)
    assert fp8.stats.graph_steps == 1
    # Inductor skips fp16 roundings eager makes, so some inputs round to the neighbouring e4m3
    # value: a few percent, where another module's compiled code would be far off.
    assert rel_rms(got, step(fp8.eager, b)) <= 0.05
    assert 1e-3 < rel_rms(got, exact) <= 0.10
