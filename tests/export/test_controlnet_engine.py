"""The denoiser's ControlNet path reproduces StableDiffusionXLControlNetPipeline (latents, CPU fp32).

Engine level, in process: the ControlNet service and its request inputs build on this.
Tolerance: 1e-4 max abs on the final latents; batching with other requests: 1e-4 as well.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import (ControlNetModel, MultiControlNetModel, StableDiffusionXLControlNetPipeline,
                       StableDiffusionXLPipeline)
from PIL import Image

from backends.core.adapters.store import AdapterStore
from backends.core.adapters.controlnet import ControlInput, LocalControlNets
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository
from export.tiny_adapters import write_tiny_adapter_store

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("cn")
    store = AdapterStore(write_tiny_adapter_store(tiny_model, root / "adapters"))
    repo = export_repository(tiny_model, root / "repo", ExportOptions())
    engine = TorchDenoiser(repo / "denoiser" / "1", Placement(),
                           LocalControlNets(ControlNetCache(store, Placement(), budget_bytes=2**30)))
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    return tiny_model, store, engine, encoder


def hint(seed, size=(80, 48)):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def ours(engine, encoder, controls, **req):
    params = validate({"prompt": "a house", **req}, Limits())
    embeds, pooled = encoder.encode(params)
    state = engine.start(DenoiseJob("r", params, embeds, pooled, controls=controls))
    while state.index < len(state.timesteps):
        engine.step([state])
    return state, engine.result(state)


def reference(model, store, controls, **req):
    base = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
    nets = [ControlNetModel.from_pretrained(store.controlnet(c.name).folder, use_safetensors=True) for c in controls]
    pipe = StableDiffusionXLControlNetPipeline(**base.components, add_watermarker=False,
                                               controlnet=nets[0] if len(nets) == 1 else MultiControlNetModel(nets))
    images = [c.image for c in controls]
    out = pipe("a house", image=images[0] if len(nets) == 1 else images, width=req["width"], height=req["height"],
               num_inference_steps=req["steps"], guidance_scale=req.get("guidance_scale", 5.0),
               controlnet_conditioning_scale=[c.scale for c in controls] if len(nets) > 1 else controls[0].scale,
               control_guidance_start=[c.guidance_start for c in controls],
               control_guidance_end=[c.guidance_end for c in controls],
               generator=torch.Generator("cpu").manual_seed(req["seed"]), output_type="latent")
    return out.images.numpy()


@pytest.mark.parametrize("controls", [
    [ControlInput("canny", hint(1), 0.8)],
    [ControlInput("canny", hint(1), 1.0, 0.0, 0.5), ControlInput("depth", hint(2), 0.6, 0.25, 1.0)],
    [ControlInput("depth", hint(3), 1.2), ControlInput("canny", hint(4), 0.5),
     ControlInput("depth", hint(5), 0.3, 0.5, 1.0)],
], ids=["one", "two-windows", "three"])
def test_controlnets_match_diffusers(setup, controls):
    model, store, engine, encoder = setup
    req = dict(seed=9, steps=4, width=64, height=72)
    _, latents = ours(engine, encoder, controls, **req)
    assert np.abs(latents - reference(model, store, controls, **req)).max() <= TOLERANCE


def test_batch_mixing_controlled_and_plain_requests_changes_nothing(setup):
    _, _, engine, encoder = setup
    controls = [ControlInput("canny", hint(7), 0.9)]
    alone_cn = ours(engine, encoder, controls, seed=1, steps=3, width=64, height=64)[1]
    alone_plain = ours(engine, encoder, [], seed=2, steps=3, width=64, height=64)[1]
    states = []
    for seed, c in ((1, controls), (2, [])):
        params = validate({"prompt": "a house", "seed": seed, "steps": 3, "width": 64, "height": 64}, Limits())
        embeds, pooled = encoder.encode(params)
        states.append(engine.start(DenoiseJob(str(seed), params, embeds, pooled, controls=c)))
    for _ in range(3):
        engine.step(states)
    assert np.abs(engine.result(states[0]) - alone_cn).max() <= TOLERANCE
    assert np.abs(engine.result(states[1]) - alone_plain).max() <= TOLERANCE


def test_unknown_controlnet_is_refused_by_name(setup):
    _, _, engine, encoder = setup
    with pytest.raises(ValueError, match="controlnets: unknown ControlNet 'nope'"):
        ours(engine, encoder, [ControlInput("nope", hint(0))], seed=1, steps=2, width=64, height=64)


def test_pipelined_mode_uses_the_previous_steps_residuals(setup):
    _, _, engine, encoder = setup
    controls = [ControlInput("canny", hint(1), 1.0)]
    req = dict(seed=5, steps=4, width=64, height=64)
    try:
        engine.controls.mode = "pipelined"
        first_step, _ = ours(engine, encoder, controls, **{**req, "steps": 1})
        _, pipelined = ours(engine, encoder, controls, **req)
    finally:
        engine.controls.mode = "sync"
    sync_first, _ = ours(engine, encoder, controls, **{**req, "steps": 1})
    _, sync = ours(engine, encoder, controls, **req)
    assert torch.equal(first_step.latents, sync_first.latents)  # the first step waits for its own
    deviation = np.abs(pipelined - sync).max()
    assert 0 < deviation < 0.5 * np.abs(sync).max()  # stale residuals move the result, a little


def test_unknown_controlnet_mode_is_refused(setup):
    _, _, engine, _ = setup
    with pytest.raises(ValueError, match="controlnet_mode: 'async' is not one of"):
        TorchDenoiser(engine.folder, Placement(), controlnet_mode="async")
