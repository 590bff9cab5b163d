"""Template edits (runtime/token_subsets.py, engine/template_cache.py) on the tiny models, CPU fp32:
the first edit of a template records its blocks' outputs, a later one computes only its masked
tokens in the transformer blocks and takes the rest from the recording.

- The same request again reproduces the exact edit (1e-4, the inpainting tests' tolerance: the
  masked tokens' queries run as a subset, the same dot products) while computing fewer tokens.
- Another prompt reuses the recording: approximate; its deviation from its own exact edit is
  measured and bounded here (the final latents' largest difference within 25% of their largest
  magnitude on random tiny weights; real weights are measured on the GPU).
- Another seed is another key: it records instead, and equals its exact edit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.runtime.placement import Placement
from export.repository import ExportOptions, export_repository
from tests.export.test_inpaint_engine import SIZE, TOL, edit_job
from tests.unit.test_denoise_loop import run

APPROXIMATE = 0.25  # the deviation bound of a reused recording, of the exact latents' largest magnitude


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    import torch
    from diffusers import StableDiffusionXLInpaintPipeline

    from backends.core.stages.text_encoding import PromptEncoder

    folder = tmp_path_factory.mktemp("template")
    repo = export_repository(tiny_model, folder / "repo", ExportOptions())
    exact = TorchDenoiser(repo / "denoiser" / "1", Placement())
    cached = TorchDenoiser(repo / "denoiser" / "1", Placement())
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(tiny_model, torch_dtype=torch.float32)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    return exact, cached, encoder, pipe, image, mask


def job(setup, rid, seed=3, prompt=None, template="shop-front"):
    exact, cached, encoder, pipe, image, mask = setup
    j = edit_job((cached, encoder, pipe, image, mask), rid, "euler", 1.0, seed=seed)
    if prompt is not None:
        params = dataclasses.replace(j.params, prompt=prompt)
        j = dataclasses.replace(j, params=params, **dict(zip(("prompt_embeds", "pooled_embeds"), encoder.encode(params))))
    return dataclasses.replace(j, edit=dataclasses.replace(j.edit, template=template))


def latents(engine, j):
    (result,) = run(engine, [j])
    assert result.error is None, result.error
    return result.latents


def test_a_template_is_recorded_once_and_its_edits_compute_their_masked_tokens(setup):
    exact, cached, *_ = setup
    want = latents(exact, dataclasses.replace(job(setup, "x"), edit=dataclasses.replace(job(setup, "x").edit,
                                                                                       template=None)))
    recorded = latents(cached, job(setup, "record"))
    assert cached.templates.misses == 1 and cached.templates.nbytes > 0
    assert np.abs(recorded - want).max() <= TOL  # recording runs every token
    context = cached.runtime.subsets
    before = (context.computed_tokens, context.all_tokens)
    again = latents(cached, job(setup, "reuse"))
    assert cached.templates.hits == 1
    computed, whole = context.computed_tokens - before[0], context.all_tokens - before[1]
    assert 0 < computed < whole, (computed, whole)  # only the masked tokens ran in the blocks
    print(f"template reuse: {computed} of {whole} block tokens computed ({computed / whole:.0%})")
    assert np.abs(again - want).max() <= TOL


def test_another_prompt_reuses_the_recording_within_the_measured_deviation(setup):
    exact, cached, *_ = setup
    latents(cached, job(setup, "record", template="porch"))
    other = job(setup, "other", prompt="a green door", template="porch")
    want = latents(exact, dataclasses.replace(other, edit=dataclasses.replace(other.edit, template=None)))
    hits = cached.templates.hits
    got = latents(cached, other)
    assert cached.templates.hits == hits + 1
    deviation = np.abs(got - want).max() / np.abs(want).max()
    print(f"template reuse, another prompt: deviation {deviation:.4f} of the exact latents' largest magnitude")
    assert 0 < deviation <= APPROXIMATE, deviation


def test_another_seed_is_another_recording(setup):
    exact, cached, *_ = setup
    latents(cached, job(setup, "first", seed=11, template="gate"))
    misses = cached.templates.misses
    seeded = job(setup, "second", seed=12, template="gate")
    got = latents(cached, seeded)
    assert cached.templates.misses == misses + 1  # recorded, not reused
    want = latents(exact, dataclasses.replace(seeded, edit=dataclasses.replace(seeded.edit, template=None)))
    assert np.abs(got - want).max() <= TOL
