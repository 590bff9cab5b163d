"""Seeded requests through the real server reproduce diffusers' StableDiffusionXLPipeline.

Tolerance: decoded uint8 pixels within 1/255 (max abs), CPU fp32. Our result differs from
diffusers' only by float summation order (batched UNet rows), which stays far below one level.
"""

from __future__ import annotations

import numpy as np
import pytest

from clients.client import EaselClient
from tests.reference import diffusers_pixels, max_abs_diff
from tests.server.conftest import start_server

TOLERANCE = 1  # uint8 levels


def pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB"))


@pytest.mark.parametrize("scheduler", ["default", "euler", "euler_a", "dpmpp_2m_karras", "ddim"])
def test_every_scheduler_matches_diffusers(client, tiny_model, scheduler):
    req = dict(seed=7, steps=5, width=64, height=64, guidance_scale=6.0, scheduler=scheduler)
    ours = client.generate("a yellow car on a mountain road", **req)
    assert ours.info["scheduler"] == scheduler and ours.info["seed"] == 7
    ref = diffusers_pixels(tiny_model, "a yellow car on a mountain road", **req)
    assert max_abs_diff(pixels(ours), ref) <= TOLERANCE


@pytest.mark.parametrize("negative", [None, "", "blurry, low quality"])
@pytest.mark.parametrize("size", [(64, 96), (104, 72)])
def test_non_square_and_negative_prompts(http_client, tiny_model, negative, size):
    width, height = size
    req = dict(seed=11, steps=4, width=width, height=height, guidance_scale=5.0, negative_prompt=negative)
    ours = http_client.generate("portrait of a cat", **req)
    assert ours.image().size == (width, height)
    assert max_abs_diff(pixels(ours), diffusers_pixels(tiny_model, "portrait of a cat", **req)) <= TOLERANCE


def test_no_guidance_runs_without_cfg(http_client, tiny_model):
    req = dict(seed=5, steps=3, width=64, height=64, guidance_scale=1.0)
    ours = http_client.generate("sunset", **req)
    assert max_abs_diff(pixels(ours), diffusers_pixels(tiny_model, "sunset", **req)) <= TOLERANCE


def test_defaults_come_from_the_model(http_client, tiny_model):
    ours = http_client.generate("a photo", seed=3)
    info = ours.info
    # tiny: unet sample_size 16 x vae factor 8; export default_steps=4 (tests/server/conftest.py)
    assert (info["width"], info["height"], info["steps"]) == (128, 128, 4)
    ref = diffusers_pixels(tiny_model, "a photo", seed=3, steps=4, width=128, height=128, guidance_scale=5.0)
    assert max_abs_diff(pixels(ours), ref) <= TOLERANCE


def test_other_model_configuration(alt_model, tmp_path):
    """A folder with another architecture and scheduler class (not `easel tiny`'s default) serves exactly."""
    server = start_server(alt_model, tmp_path / "repo")
    try:
        server.wait_ready()
        with EaselClient(server.url_http) as c:
            for scheduler in ("default", "dpmpp_2m_karras"):
                req = dict(seed=2, steps=4, width=72, height=64, guidance_scale=4.0, scheduler=scheduler)
                ours = c.generate("a red boat", **req)
                ref = diffusers_pixels(alt_model, "a red boat", **req)
                assert max_abs_diff(pixels(ours), ref) <= TOLERANCE
    finally:
        server.stop()
