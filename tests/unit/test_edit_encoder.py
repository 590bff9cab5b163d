"""The edit's VAE encoder stage (stages/vae_encoding.py) on the tiny pipeline's VAE (CPU fp32): a
template's distribution kept and reused bit for bit, the masked template encoded only for a UNet
that reads it, and the kept templates within their byte budget."""

from __future__ import annotations

import numpy as np
import pytest

from backends.core.runtime.placement import Placement
from backends.core.stages.vae_encoding import EditEncoder

SIZE = 64


def images(seed: int):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[8 + seed:40, 16:48] = 255
    return image, mask


@pytest.fixture(scope="module")
def fresh(tiny_model):
    return EditEncoder(tiny_model, Placement())  # encodes every time: no template is kept yet


def test_a_template_is_encoded_once_for_every_edit_of_it(fresh, tiny_model):
    encoder = EditEncoder(tiny_model, Placement())
    image, mask = images(0)
    first = encoder.encode(image, mask)
    _, other_mask = images(1)
    second = encoder.encode(image.copy(), other_mask)  # the same pixels, another array and mask
    assert encoder.template_hits == 1 and len(encoder.templates) == 1
    assert second["image_mean"] is first["image_mean"] and not second["image_mean"].flags.writeable
    fresh.templates.clear()
    want = fresh.encode(image, other_mask)
    for name in ("image_mean", "image_std", "masked_mean", "masked_std", "mask"):
        assert np.array_equal(second[name], want[name]), name
    assert not np.array_equal(second["masked_mean"], first["masked_mean"])  # the mask's own


def test_a_unet_of_four_channels_gets_no_masked_template(fresh, tiny_model):
    image, mask = images(2)
    four = EditEncoder(tiny_model, Placement(), masked_image=False).encode(image, mask)
    fresh.templates.clear()
    nine = fresh.encode(image, mask)
    assert np.array_equal(four["image_mean"], nine["image_mean"]) and np.array_equal(four["mask"], nine["mask"])
    for name in ("masked_mean", "masked_std"):  # its draw keeps the generator's order; its values are unused
        assert four[name].shape == nine[name].shape and not four[name].any() and nine[name].any()


def test_kept_templates_stay_within_their_bytes(tiny_model):
    encoder = EditEncoder(tiny_model, Placement())
    side = SIZE // encoder.vae_scale_factor
    encoder.template_bytes = 2 * (2 * encoder.vae.config.latent_channels * side * side * 4)  # two: mean, std in fp32
    for seed in (3, 4, 5):
        encoder.encode(*images(seed))
    assert len(encoder.templates) == 2
    encoder.encode(*images(3))  # the least recently used: out, encoded again
    assert encoder.template_hits == 0
    encoder.encode(*images(5))
    assert encoder.template_hits == 1
