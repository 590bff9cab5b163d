"""backends/core/stages/image_encoding.py: pixels -> PNG/JPEG/WebP bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, features

from backends.core.stages.image_encoding import (DEFAULT_QUALITY, FORMATS, MIME_TYPES, PNG_COMPRESS_LEVEL,
                                                 encode_image)

MAGIC = {"png": lambda b: b.startswith(b"\x89PNG\r\n\x1a\n"),
         "jpeg": lambda b: b.startswith(b"\xff\xd8\xff"),
         "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP"}


def photo_like(height=96, width=160, seed=0) -> np.ndarray:
    """A smooth gradient plus noise, not square so that a swapped width/height shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255.0 / width, y * 255.0 / height, (x + y) * 127.0 / (width + height)], -1)
    return np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8)


def decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_webp_is_compiled_in():
    assert features.check("webp")


def test_every_format_has_a_mime_type_and_quality_goes_with_the_lossy_ones():
    assert set(MIME_TYPES) == set(FORMATS) == {"png", "jpeg", "webp"}
    assert set(DEFAULT_QUALITY) == {"jpeg", "webp"}
    assert 0 <= PNG_COMPRESS_LEVEL <= 9


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_decodes_to_the_right_size(fmt):
    pixels = photo_like()
    data = encode_image(pixels, fmt, None)
    assert MAGIC[fmt](data)
    image = decode(data)
    assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
    assert Image.MIME[image.format] == MIME_TYPES[fmt]
    assert image.size == (160, 96) and image.mode == "RGB"
    if fmt != "png":  # lossy, but close
        diff = np.abs(np.asarray(image, dtype=np.int16) - pixels.astype(np.int16))
        assert diff.mean() < 8, diff.mean()


def test_png_is_lossless():
    pixels = photo_like()
    assert np.array_equal(np.asarray(decode(encode_image(pixels, "png", None))), pixels)


def test_png_default_is_the_fast_level():
    # the fast zlib level, not PIL's default (6), which takes 3-8x as long at 1024 px
    pixels = photo_like(256, 256)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    assert encode_image(pixels, "png", None) == buf.getvalue()


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_quality_changes_the_size(fmt):
    pixels = photo_like(128, 128)
    sizes = [len(encode_image(pixels, fmt, q)) for q in (10, 50, 95)]
    assert sizes[0] < sizes[1] < sizes[2], sizes
    assert encode_image(pixels, fmt, None) == encode_image(pixels, fmt, DEFAULT_QUALITY[fmt])
    assert MAGIC[fmt](encode_image(pixels, fmt, 1)) and MAGIC[fmt](encode_image(pixels, fmt, 100))


@pytest.mark.parametrize("fmt, quality, message", [
    ("gif", None, "output_format: unknown format 'gif'; allowed: png, jpeg, webp"),
    ("PNG", None, "allowed: png, jpeg, webp"),
    ("jpg", None, "allowed: png, jpeg, webp"),
    ("png", 90, "quality: only for jpeg and webp, not png"),
    ("jpeg", 0, "quality: 0 is outside [1, 100]"),
    ("webp", 101, "quality: 101 is outside [1, 100]"),
])
def test_bad_values_are_refused(fmt, quality, message):
    with pytest.raises(ValueError) as info:
        encode_image(photo_like(8, 8), fmt, quality)
    assert message in str(info.value)


@pytest.mark.parametrize("pixels", [np.zeros((8, 8), np.uint8), np.zeros((8, 8, 4), np.uint8),
                                    np.zeros((8, 8, 3), np.float32)])
def test_bad_pixels_are_refused(pixels):
    with pytest.raises(ValueError, match="pixels: expected"):
        encode_image(pixels, "png", None)
