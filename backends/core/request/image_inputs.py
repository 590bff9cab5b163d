"""Image files a request sends (control images, an edit's template and mask), decoded with a
bound: torch-free, so that `preprocess` refuses a bad one before any GPU work."""

from __future__ import annotations

import io

from backends.core.request.params import InvalidInput


def decode_image(data: bytes, field: str, max_pixels: int):
    """PNG/JPEG bytes -> PIL image as stored, refusing what is over `max_pixels` before decoding
    it; errors name `field`."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:  # PIL's own, far higher, limit
        raise InvalidInput(field, f"is a decompression bomb, over the limit of {max_pixels} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidInput(field, f"is not a decodable image ({exc.__class__.__name__})") from None
    if image.format not in ("PNG", "JPEG"):
        raise InvalidInput(field, f"is {image.format}, not PNG or JPEG")
    width, height = image.size
    if width * height > max_pixels:  # a decompression bomb stops here, before the pixels exist
        raise InvalidInput(field, f"is {width}x{height}, over the limit of {max_pixels} pixels")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidInput(field, f"is not a decodable image ({exc})") from None
    return image
