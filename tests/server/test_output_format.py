"""`output_format` and `quality` through the real server: PNG (default, lossless), JPEG, WebP."""

from __future__ import annotations

import numpy as np
import pytest

from clients.client import EaselError
from tests.server.test_exact import pixels

GOOD = dict(seed=3, steps=2, width=64, height=72)
MAGIC = {"png": lambda b: b.startswith(b"\x89PNG\r\n\x1a\n"),
         "jpeg": lambda b: b.startswith(b"\xff\xd8\xff"),
         "webp": lambda b: b[:4] == b"RIFF" and b[8:12] == b"WEBP"}


@pytest.fixture(scope="module")
def default_pixels(server):
    """The pixels of GOOD with no output_format sent (PNG, the default)."""
    from clients.client import EaselClient

    with EaselClient(server.url_http, protocol="http") as c:
        result = c.generate("a red bicycle", **GOOD)
    assert MAGIC["png"](result.png)
    assert (result.info["output_format"], result.info["quality"]) == ("png", None)
    return pixels(result)


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_each_format(client, default_pixels, fmt):
    result = client.generate("a red bicycle", output_format=fmt, **GOOD)
    assert MAGIC[fmt](result.png)
    image = result.image()
    assert image.format == {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}[fmt]
    assert image.size == (GOOD["width"], GOOD["height"])
    assert result.info["output_format"] == fmt
    assert result.info["quality"] == (None if fmt == "png" else 90)
    assert "postprocess_s" in result.info["stages_s"]
    ours = pixels(result)
    if fmt == "png":
        assert np.array_equal(ours, default_pixels)  # lossless: the very pixels of the default request
    else:
        assert np.abs(ours.astype(np.int16) - default_pixels).mean() < 30  # lossy, but the same image


def test_quality_changes_the_size(http_client):
    low, high = (http_client.generate("a red bicycle", output_format="jpeg", quality=q, **GOOD) for q in (10, 95))
    assert len(low.png) < len(high.png)
    assert (low.info["quality"], high.info["quality"]) == (10, 95)


@pytest.mark.parametrize("overrides, expected", [
    (dict(output_format="gif"), "output_format: unknown format 'gif'; allowed: png, jpeg, webp"),
    (dict(quality=80), "quality: only for jpeg and webp, not png"),
    (dict(output_format="webp", quality=101), "quality: 101 is outside [1, 100]"),
])
def test_bad_values_are_named(client, overrides, expected):
    with pytest.raises(EaselError) as err:
        client.generate("a red bicycle", **{**GOOD, **overrides})
    assert expected in str(err.value)
    assert client.is_ready()
    assert MAGIC["png"](client.generate("a red bicycle", **GOOD).png)  # and serves on
