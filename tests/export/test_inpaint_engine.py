"""The inpaint workflow (backends/core/engine/workflows/inpaint.py) with the VAE encoding stage
(backends/core/stages/vae_encoding.py), in process, against diffusers' own
StableDiffusionXLInpaintPipeline (and its ControlNet variant) on the tiny models (CPU fp32, same seed), a base UNet (4 input
channels: blended after each step) and an inpainting UNet (9): the final latents within 1e-4 of
the pipeline's (max abs; they are ~1-10 in size), for each scheduler, at strength 1 and below,
and unchanged beside a text-to-image request of the same size in the same loop."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob, EditInputs
from backends.core.request.params import InvalidInput, Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from backends.core.request.edit_inputs import check_edit_images
from backends.core.stages.vae_encoding import encode_edit
from export.repository import ExportOptions, export_repository
from tests.unit.test_denoise_loop import run

TOL = 1e-4
SIZE, STEPS = 64, 5


@pytest.fixture(scope="module", params=["base-unet", "inpainting-unet"])
def setup(request, tiny_model, tmp_path_factory):
    from diffusers import StableDiffusionXLInpaintPipeline

    from export.tiny import write_tiny_pipeline

    folder = tmp_path_factory.mktemp("inpaint")
    model = tiny_model if request.param == "base-unet" else write_tiny_pipeline(folder / "model", variant="inpaint")
    repo = export_repository(model, folder / "repo", ExportOptions())
    engine = TorchDenoiser(repo / "denoiser" / "1", Placement())
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(model, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.base_scheduler = pipe.scheduler  # the model's own: each test's scheduler is made from it
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    return engine, encoder, pipe, image, mask


def diffusers_latents(pipe, image, mask, scheduler, strength, seed):
    from backends.core.engine.diffusers_schedulers import make_scheduler

    pipe.scheduler = make_scheduler(scheduler, pipe.base_scheduler) if scheduler else pipe.base_scheduler
    out = pipe("a red house", image=Image.fromarray(image), mask_image=Image.fromarray(mask), height=SIZE,
               width=SIZE, num_inference_steps=STEPS, guidance_scale=5.0, strength=strength,
               generator=torch.Generator("cpu").manual_seed(seed), output_type="latent")
    return out.images.numpy()


def edit_job(setup, rid, scheduler, strength, seed):
    engine, encoder, pipe, image, mask = setup
    params = validate({"prompt": "a red house", "steps": STEPS, "width": SIZE, "height": SIZE, "seed": seed,
                       "guidance_scale": 5.0, "scheduler": scheduler}, Limits())
    embeds, pooled = encoder.encode(params)
    arrays = encode_edit(pipe.vae, image, mask, pipe.vae_scale_factor)
    edit = EditInputs(**arrays, scaling_factor=pipe.vae.config.scaling_factor, strength=strength)
    return DenoiseJob(request_id=rid, params=params, prompt_embeds=embeds, pooled_embeds=pooled,
                      workflow="inpaint", edit=edit)


@pytest.mark.parametrize("scheduler", [None, "euler", "euler_a", "dpmpp_2m_karras", "ddim"])
@pytest.mark.parametrize("strength", [1.0, 0.6])
@pytest.mark.parametrize("sampler", ["vectorized", "diffusers"])
def test_inpainting_matches_diffusers(setup, scheduler, strength, sampler, monkeypatch):
    """`vectorized`: the request's sampler plan from the step strength starts at (the blend's
    add_noise from its tables); `diffusers`: the fallback for a scheduler that has no plan, its
    begin index set."""
    from backends.core.engine.workflows import txt2img

    engine, encoder, pipe, image, mask = setup
    if sampler == "diffusers":
        monkeypatch.setattr(txt2img, "vectorizable", lambda sched: False)  # (Txt2Img.sampler decides)
    job = edit_job(setup, "edit", scheduler, strength, seed=3)
    state = engine.start(job)
    assert (state.plan is not None) == (sampler == "vectorized")
    if state.plan is not None:  # the steps strength leaves out: the plan starts after them
        assert state.plan.start == STEPS - int(STEPS * strength) and state.plan.num_steps == len(state.timesteps)
    want = diffusers_latents(pipe, image, mask, scheduler, strength, seed=3)
    (got,) = run(engine, [job])
    assert got.error is None, got.error
    assert got.latents.shape == want.shape
    assert np.abs(got.latents - want).max() <= TOL


def test_an_edit_beside_text_to_image_is_unchanged(setup):
    engine, encoder, pipe, image, mask = setup
    (alone,) = run(engine, [edit_job(setup, "edit", "euler", 1.0, seed=5)])
    params = validate({"prompt": "a cat", "steps": STEPS, "width": SIZE, "height": SIZE, "seed": 1}, Limits())
    embeds, pooled = encoder.encode(params)
    text = DenoiseJob(request_id="t2i", params=params, prompt_embeds=embeds, pooled_embeds=pooled)
    edit, other = run(engine, [edit_job(setup, "edit", "euler", 1.0, seed=5), text])
    assert edit.error is None
    if engine.unet.config.in_channels == 4:  # the two shared their steps: each equals itself alone
        (text_alone,) = run(engine, [text])
        assert other.error is None and edit.max_batch == other.max_batch == 2
        assert np.abs(edit.latents - alone.latents).max() <= TOL
        assert np.abs(other.latents - text_alone.latents).max() <= TOL
    else:  # an inpainting UNet cannot make an image from text alone
        assert other.latents is None and other.error.startswith("image: this model's UNet takes 9 input channels")


def test_bad_edits_fail_naming_the_field(setup):
    engine, encoder, pipe, image, mask = setup
    with pytest.raises(InvalidInput, match="image: is 32x64 pixels of uint8, not the request's 64x64 uint8"):
        check_edit_images(image[:, :32], mask, SIZE, SIZE)
    with pytest.raises(InvalidInput, match="mask_image: is not binary"):
        check_edit_images(image, np.full((SIZE, SIZE), 128, np.uint8), SIZE, SIZE)
    job = edit_job(setup, "bad", "euler", 1.0, seed=1)
    for change, field in ((dict(strength=0.0), "strength"), (dict(strength=0.05), "strength"),
                          (dict(mask=job.edit.mask * 0.5), "mask_image"), (dict(image_mean=job.edit.mask), "image")):
        bad = dataclasses.replace(job, edit=dataclasses.replace(job.edit, **change))
        (result,) = run(engine, [bad])
        assert result.latents is None and result.error.startswith(f"{field}: "), result.error
    (missing,) = run(engine, [dataclasses.replace(job, edit=None)])
    assert missing.error.startswith("image: inpainting needs an image and a mask_image")


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_inpainting_with_a_controlnet_matches_diffusers(setup, tiny_model, strength):
    """StableDiffusionXLControlNetInpaintPipeline: the ControlNet sees the 4 latent channels (an
    inpainting UNet's input adds the mask and the masked template after them), its window counts
    the steps that strength leaves."""
    from diffusers import ControlNetModel, StableDiffusionXLControlNetInpaintPipeline

    from backends.core.adapters.controlnet import ControlInput, LocalControlNets
    from backends.core.adapters.controlnet_cache import ControlNetCache
    from backends.core.adapters.store import AdapterStore

    engine, encoder, pipe, image, mask = setup
    store = AdapterStore(tiny_model / "adapters")
    engine.controls.provider = LocalControlNets(ControlNetCache(store, Placement(), budget_bytes=2**30))
    control = Image.fromarray(np.random.default_rng(7).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))
    net = ControlNetModel.from_pretrained(store.controlnet("canny").folder, use_safetensors=True)
    ref = StableDiffusionXLControlNetInpaintPipeline(**{**pipe.components, "scheduler": pipe.base_scheduler},
                                                     controlnet=net)
    ref.set_progress_bar_config(disable=True)
    want = ref("a red house", image=Image.fromarray(image), mask_image=Image.fromarray(mask), control_image=control,
               height=SIZE, width=SIZE, num_inference_steps=STEPS, guidance_scale=5.0, strength=strength,
               controlnet_conditioning_scale=0.7, control_guidance_end=0.8,
               generator=torch.Generator("cpu").manual_seed(3), output_type="latent").images.numpy()
    job = edit_job(setup, "edit", None, strength, seed=3)
    job = dataclasses.replace(job, controls=[ControlInput("canny", control, 0.7, 0.0, 0.8)])
    try:
        (got,) = run(engine, [job])
    finally:
        engine.controls.provider = None
    assert got.error is None, got.error
    assert np.abs(got.latents - want).max() <= TOL
