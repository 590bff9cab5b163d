"""A template and its mask -> what the inpaint workflow needs (engine/workflows/inpaint.py), as
StableDiffusionXLInpaintPipeline prepares them: the VAE encoder's latent distributions of the
template and of the template with its masked region blanked, and the mask at latent size.

The distributions' samples are drawn by the denoiser, on the request's generator and in the
pipeline's order, so this stage draws nothing. Images come checked (request/edit_inputs.py):
the request's size, masks binary.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.runtime.placement import Placement


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


class EditEncoder:
    """The VAE's encoder, from a model folder's `vae` (the VAE decoder's copy), in the dtype the
    inpaint pipeline encodes in (fp32 for a VAE that asks diffusers to upcast, as SDXL's does)."""

    def __init__(self, folder: str | Path, placement: Placement):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(Path(folder) / "vae", use_safetensors=True)
        dtype = placement.torch_dtype
        if dtype == torch.float16 and vae.config.force_upcast:
            dtype = torch.float32
        del vae.decoder, vae.post_quant_conv  # (encoding only: half the weights stay off the device)
        self.vae = vae.to(torch.device(placement.device), dtype).eval()
        self.scaling_factor = float(vae.config.scaling_factor)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)

    def encode(self, image: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The EditInputs arrays of a checked template and mask (request/edit_inputs.py)."""
        return encode_edit(self.vae, image, mask, self.vae_scale_factor)
