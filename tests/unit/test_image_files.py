"""backends/core/stages/image_files.py: pixels -> PNG/JPEG/WebP bytes."""

from __future__ import annotations

import io
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image, features

from backends.core.request.output_format import DEFAULT_QUALITY, FORMATS, MIME_TYPES
from backends.core.stages.image_files import PNG_COMPRESS_LEVEL, encode_image
from backends.core.stages import png_encoding
from backends.core.stages.png_encoding import adler32_combine, encode_png

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
    # ISA-L's level 1 (its levels are 0-3), not its slowest
    pixels = photo_like(256, 256)
    assert PNG_COMPRESS_LEVEL == 1
    assert encode_image(pixels, "png", None) == encode_png(pixels, 1) != encode_png(pixels, 3)
    with pytest.raises(ValueError, match=r"level: 6 is not one of ISA-L's deflate levels \[0, 1, 2, 3\]"):
        encode_png(pixels, 6)


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


@pytest.mark.parametrize("shape", [(1, 1), (1, 700), (300, 2), (1024, 1024), (997, 613)])
def test_png_strips_decode_to_the_same_pixels(shape):
    """png_encoding deflates strips of rows on several threads; sizes that give one strip, many
    strips, and a last strip of a single row must all decode exactly, CRCs and Adler-32 checked
    (PIL verifies the chunk CRCs, zlib the stream's Adler-32)."""
    pixels = np.random.default_rng(1).integers(0, 256, (*shape, 3), dtype=np.uint8)
    data = encode_png(pixels, PNG_COMPRESS_LEVEL)
    assert np.array_equal(np.asarray(decode(data)), pixels)
    idat = data.index(b"IDAT")
    length = int.from_bytes(data[idat - 4:idat], "big")
    raw = zlib.decompress(data[idat + 4:idat + 4 + length])  # raises on a bad Adler-32
    assert len(raw) == shape[0] * (shape[1] * 3 + 1)


def test_png_bytes_do_not_depend_on_the_thread_count(monkeypatch):
    pixels = photo_like(640, 512)
    first = encode_png(pixels, PNG_COMPRESS_LEVEL)
    monkeypatch.setattr(png_encoding, "_pool", ThreadPoolExecutor(1))
    assert encode_png(pixels, PNG_COMPRESS_LEVEL) == first


def test_adler32_combine_equals_adler32_of_the_concatenation():
    rng = np.random.default_rng(2)
    for n1, n2 in [(0, 5), (5, 0), (1, 1), (70000, 123457), (3, 400000)]:
        x, y = rng.bytes(n1), rng.bytes(n2)
        assert adler32_combine(zlib.adler32(x), zlib.adler32(y), n2) == zlib.adler32(x + y)


def test_png_is_about_as_small_as_pils_at_the_same_level():
    """Up filter on every row and a fresh dictionary per strip against PIL's per-row choice."""
    pixels = photo_like(512, 512)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    assert len(encode_png(pixels, PNG_COMPRESS_LEVEL)) < 1.1 * len(buf.getvalue())
