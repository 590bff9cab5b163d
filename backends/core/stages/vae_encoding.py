"""A template and its mask -> what the inpaint workflow needs (engine/workflows/inpaint.py), as
StableDiffusionXLInpaintPipeline prepares them: the VAE encoder's latent distributions of the
template and of the template with its masked region blanked, and the mask at latent size.

The distributions' samples are drawn by the denoiser, on the request's generator and in the
pipeline's order, so this stage draws nothing. Images must already have the request's size and
masks must be binary (0 keeps, 255 repaints): the pipeline would resize and binarize, but a
server refuses rather than silently correct.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.request.params import InvalidInput


def check_edit_images(image: np.ndarray, mask: np.ndarray, width: int, height: int) -> None:
    """InvalidInput naming `image` or `mask_image` when they are not what an edit of this size takes."""
    for field, pixels, channels in (("image", image, (3,)), ("mask_image", mask, ())):
        if pixels.dtype != np.uint8 or pixels.shape != (height, width, *channels):
            size = "x".join(map(str, pixels.shape[1::-1] if pixels.ndim in (2, 3) else pixels.shape))
            raise InvalidInput(field, f"is {size} pixels of {pixels.dtype}{'' if channels else ' (one channel)'}, "
                                      f"not the request's {width}x{height} uint8")
    if not np.isin(mask, (0, 255)).all():
        raise InvalidInput("mask_image", "is not binary: use 0 to keep a pixel and 255 to repaint it")


@torch.inference_mode()
def encode_edit(vae, image: np.ndarray, mask: np.ndarray, vae_scale_factor: int) -> dict[str, np.ndarray]:
    """`image` [H, W, 3] and `mask` [H, W] uint8 -> the EditInputs arrays (image_mean, image_std,
    masked_mean, masked_std, mask), float32 on the host."""
    device, dtype = vae.device, vae.dtype
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0 * 2.0 - 1.0  # VaeImageProcessor
    repaint = (torch.from_numpy(mask)[None, None].float() / 255.0 >= 0.5).float()  # mask_processor: binarized
    masked = pixels * (repaint < 0.5)
    h, w = mask.shape[0] // vae_scale_factor, mask.shape[1] // vae_scale_factor
    out = {"mask": F.interpolate(repaint, size=(h, w)).numpy()}
    for name, x in (("image", pixels), ("masked", masked)):
        dist = vae.encode(x.to(device, dtype)).latent_dist
        out[f"{name}_mean"] = dist.mean.float().cpu().numpy()
        out[f"{name}_std"] = dist.std.float().cpu().numpy()
    return out
