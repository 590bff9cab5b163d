"""Decoded pixels -> the image file a request asked for: PNG (default), JPEG or WebP.

Torch-free, and PIL is imported only when an image is encoded. The formats a request may ask for
are the request's vocabulary (backends/core/request/output_format.py). The encode runs on the
critical path in the pipeline (backends/triton/bls_pipeline.py), hence settings chosen for speed over the last few percent of size.

Measured with Pillow 13.0.0 (zlib 1.2.13, libwebp 1.6.0, libjpeg-turbo) on a 1024x1024 RGB
photo-like image (smooth colour field + mid-frequency texture + edges + Gaussian noise sigma 3),
CPU seconds of one core (best of 5), on the 2-core AMD EPYC CPU dev machine while it was loaded:

    PNG compress_level  0: 0.064 s 3074 KiB (stored, no compression)
                        1: 0.117 s 1897 KiB   <- PNG_COMPRESS_LEVEL
                        2: 0.127 s 1884 KiB
                        3: 0.154 s 1875 KiB
                     4..9: 0.28-0.37 s 1643 KiB
       PIL default (6):    0.31 s  1643 KiB;   optimize=True: 0.45 s 1581 KiB
    (with noise sigma 1: level 1 0.096 s 1482 KiB, default 0.76 s 1259 KiB)

so level 1 encodes 3-8x faster than PIL's default for 15-18 % more bytes. PNG is written by
png_encoding.py, which deflates strips of rows on several cores (PIL deflates on one) with ISA-L's
deflate, whose level 1 is 4x zlib's speed and writes fewer bytes (png_encoding.py). JPEG quality 90:
0.004 s 180 KiB. WebP quality 90 by `method` (speed/size knob, PIL's default 4):
0: 0.044 s 149 KiB, 1: 0.057 s 147 KiB, 2: 0.068 s 140 KiB, 4: 0.12 s 137 KiB, 6: 0.24 s 112 KiB;
method 0 takes a third of the default's time for 9 % more bytes.
"""

from __future__ import annotations

import io

import numpy as np

from backends.core.request.output_format import DEFAULT_FORMAT, DEFAULT_QUALITY, check_format, check_quality
from backends.core.stages.png_encoding import encode_png

PNG_COMPRESS_LEVEL = 1
WEBP_METHOD = 0
_PIL_FORMATS = {"jpeg": "JPEG", "webp": "WEBP"}


def encode_image(pixels: np.ndarray, fmt: str = DEFAULT_FORMAT, quality: int | None = None) -> bytes:
    """[H, W, 3] uint8 RGB pixels -> the bytes of a `fmt` file (one of FORMATS).

    `quality` (jpeg, webp only) defaults to DEFAULT_QUALITY[fmt]; ValueError on a bad value."""
    check_format(fmt)
    check_quality(fmt, quality)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3:
        raise ValueError(f"pixels: expected [H, W, 3] uint8, got {list(pixels.shape)} {pixels.dtype}")
    if fmt == "png":
        return encode_png(pixels, PNG_COMPRESS_LEVEL)
    options = dict(quality=DEFAULT_QUALITY[fmt] if quality is None else quality)
    if fmt == "webp":
        options["method"] = WEBP_METHOD
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buf, format=_PIL_FORMATS[fmt], **options)
    return buf.getvalue()
