"""What `POST /v1/images/edits` (clients/openai_api.py) turns into an Easel edit: OpenAI's
multipart body read into fields and files, and OpenAI's mask into Easel's.

OpenAI's mask convention: the fully transparent pixels (alpha 0) of `mask`, or of `image` when
no mask is sent, are the ones to edit. Easel's `mask_image` is diffusers': 255 repaints, 0 keeps.
The template goes on as RGB. Errors are InvalidInput naming the `easel` input (`image`,
`mask_image`), which the API maps to the body's field.
"""

from __future__ import annotations

import io

import numpy as np

from backends.core.request.image_inputs import decode_image
from backends.core.request.params import InvalidInput, Limits

FILES = {"image": "image", "mask": "mask_image"}  # the body's file fields -> the `easel` inputs
MAX_FORM_FIELDS = 32  # more than the body model has fields: the rest are refused by name


async def read_form(request) -> tuple[dict[str, str], dict[str, bytes]]:
    """The body's text fields and its files (by the `easel` input they become); a file where a
    text field belongs, a field given twice or a file not in FILES is refused by name."""
    form = await request.form(max_files=len(FILES), max_fields=MAX_FORM_FIELDS)
    fields, files = {}, {}
    for key, value in form.multi_items():
        is_file = not isinstance(value, str)
        if key in fields or FILES.get(key) in files:
            raise InvalidInput(FILES.get(key, key), "is given twice")
        if is_file != (key in FILES):
            raise InvalidInput(FILES.get(key, key), "must be a file" if key in FILES else "must not be a file")
        if is_file:
            files[FILES[key]] = await value.read()
        else:
            fields[key] = value
    return fields, files


def easel_edit_files(image: bytes | None, mask: bytes | None, limits: Limits) -> tuple[bytes, bytes]:
    """OpenAI's image and mask (PNG/JPEG) -> Easel's `image` (RGB PNG) and `mask_image` (0/255 PNG)."""
    if image is None:
        raise InvalidInput("image", "is required")
    most = limits.max_width * limits.max_height
    template = decode_image(image, "image", most)
    source, field = (template, "image") if mask is None else (decode_image(mask, "mask_image", most), "mask_image")
    if "A" not in source.getbands() and "transparency" not in source.info:
        raise InvalidInput(field, "has no alpha channel: its fully transparent pixels are the ones to edit"
                                  + (" (or send a mask)" if mask is None else ""))
    alpha = np.asarray(source.convert("RGBA").getchannel("A"))
    return _png(np.asarray(template.convert("RGB"))), _png(np.where(alpha == 0, 255, 0).astype(np.uint8))


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG", compress_level=1)
    return buf.getvalue()
