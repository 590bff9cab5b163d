"""An edit's inputs (inpainting): the template `image`, its `mask_image` and `strength`, checked
as StableDiffusionXLInpaintPipeline would take them, torch-free.

The request's size is the template's unless the request names one; the template and the mask
must have it, and the mask must be binary (0 keeps a pixel, 255 repaints it). The pipeline
would resize and binarize: a server refuses rather than silently correct. A template's alpha
channel is dropped (RGB); a mask is read as grayscale, as the pipeline's mask processor does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from backends.core.request.image_inputs import decode_image
from backends.core.request.params import InvalidInput, Limits

DEFAULT_STRENGTH = 0.9999  # StableDiffusionXLInpaintPipeline's default


@dataclass(frozen=True)
class EditImages:
    image: np.ndarray  # [H, W, 3] uint8
    mask: np.ndarray  # [H, W] uint8, 0 or 255

    def check(self, width: int, height: int) -> None:
        check_edit_images(self.image, self.mask, width, height)


def decode_edit_images(image: bytes | None, mask: bytes | None, limits: Limits) -> EditImages:
    """The template and the mask as pixels, or InvalidInput naming the one at fault."""
    for field, data in (("image", image), ("mask_image", mask)):
        if data is None:
            raise InvalidInput(field, "is needed for an edit: give image and mask_image together")
    most = limits.max_width * limits.max_height
    pixels = np.asarray(decode_image(image, "image", most).convert("RGB"))
    repaint = np.asarray(decode_image(mask, "mask_image", most).convert("L"))
    return EditImages(pixels, repaint)


def edit_defaults(raw: Mapping[str, Any], limits: Limits) -> tuple[Mapping[str, Any], EditImages | None]:
    """A public request's scalars with an edit's defaults filled in (its size is the template's,
    its strength the pipeline's), and its images; (raw, None) for text to image."""
    if raw.get("image") is None and raw.get("mask_image") is None:
        if raw.get("strength") is not None:
            raise InvalidInput("strength", "is for edits: give image and mask_image too")
        return raw, None
    edit = decode_edit_images(raw.get("image"), raw.get("mask_image"), limits)
    height, width = edit.image.shape[:2]
    filled = {"width": width, "height": height, "strength": DEFAULT_STRENGTH}
    return {**raw, **{k: v for k, v in filled.items() if raw.get(k) is None}}, edit


def check_edit_images(image: np.ndarray, mask: np.ndarray, width: int, height: int) -> None:
    """InvalidInput naming `image` or `mask_image` when they are not what an edit of this size takes."""
    for field, pixels, channels in (("image", image, (3,)), ("mask_image", mask, ())):
        if pixels.dtype != np.uint8 or pixels.shape != (height, width, *channels):
            size = "x".join(map(str, pixels.shape[1::-1] if pixels.ndim in (2, 3) else pixels.shape))
            raise InvalidInput(field, f"is {size} pixels of {pixels.dtype}{'' if channels else ' (one channel)'}, "
                                      f"not the request's {width}x{height} uint8")
    if not np.isin(mask, (0, 255)).all():
        raise InvalidInput("mask_image", "is not binary: use 0 to keep a pixel and 255 to repaint it")
