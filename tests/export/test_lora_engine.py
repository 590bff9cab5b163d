"""LoRAs in the denoiser engine: a merged request reproduces diffusers (load_lora_weights +
set_adapters + fuse_lora, latents, CPU fp32, 1e-4), and a batch mixing LoRA sets (computed
unmerged, per request's rows) gives each request what it gets alone (1e-4)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from backends.core.adapters.store import AdapterStore
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.adapters.lora import load_lora
from backends.core.request.params import Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    repo = export_repository(tiny_model, tmp_path_factory.mktemp("lora") / "repo", ExportOptions())
    engine = TorchDenoiser(repo / "denoiser" / "1", Placement())
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    store = AdapterStore(tiny_model / "adapters")
    return tiny_model, store, engine, encoder


def job(setup, rid, loras, seed=1, steps=3):
    _, store, _, encoder = setup
    params = validate({"prompt": "a fox", "seed": seed, "steps": steps, "width": 64, "height": 64}, Limits())
    embeds, pooled = encoder.encode(params)
    sets = tuple((load_lora(n, store.lora(n).path), s) for n, s in loras)
    return DenoiseJob(rid, params, embeds, pooled, loras=sets)


def run(engine, jobs):
    states = [engine.start(j) for j in jobs]
    while any(s.index < len(s.timesteps) for s in states):
        engine.step([s for s in states if s.index < len(s.timesteps)])
    return [engine.result(s) for s in states]


@pytest.mark.parametrize("loras", [[("papercut", 0.9)], [("papercut", 0.6), ("inkwash", 1.0)]], ids=["one", "two"])
def test_merged_lora_matches_diffusers(setup, loras):
    model, store, engine, _ = setup
    (ours,) = run(engine, [job(setup, "a", loras)])
    pipe = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
    for name, _ in loras:
        pipe.load_lora_weights(str(store.lora(name).path), adapter_name=name)
    pipe.set_adapters([n for n, _ in loras], adapter_weights=[s for _, s in loras])
    pipe.fuse_lora(adapter_names=[n for n, _ in loras])
    ref = pipe("a fox", width=64, height=64, num_inference_steps=3, guidance_scale=5.0,
               generator=torch.Generator("cpu").manual_seed(1), output_type="latent").images.numpy()
    assert np.abs(ours - ref).max() <= TOLERANCE


def test_batch_mixing_lora_sets_equals_each_alone(setup):
    _, _, engine, _ = setup
    sets = [[("papercut", 1.0)], [("inkwash", 0.5)], []]
    alone = [run(engine, [job(setup, f"r{i}", s, seed=i)])[0] for i, s in enumerate(sets)]
    together = run(engine, [job(setup, f"r{i}", s, seed=i) for i, s in enumerate(sets)])
    for a, b in zip(alone, together):
        assert np.abs(a - b).max() <= TOLERANCE
    assert engine.loras.merged == ()  # mixed batches leave the weights at base


def test_base_weights_come_back_after_lora_requests(setup):
    _, _, engine, _ = setup
    (plain_before,) = run(engine, [job(setup, "p", [])])
    run(engine, [job(setup, "l", [("papercut", 1.0)])])
    (plain_after,) = run(engine, [job(setup, "p", [])])
    assert np.array_equal(plain_before, plain_after)
