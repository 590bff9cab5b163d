"""A template and its mask -> what the inpaint workflow needs (engine/workflows/inpaint.py), as
StableDiffusionXLInpaintPipeline prepares them: the VAE encoder's latent distributions of the
template and of the template with its masked region blanked, and the mask at latent size.

The distributions' samples are drawn by the denoiser, on the request's generator and in the
pipeline's order, so this stage draws nothing. Images come checked (request/edit_inputs.py):
the request's size, masks binary.

At 1024 px an encode is 4.9 TFLOP, in fp32 for SDXL's VAE (diffusers upcasts it): most of what an
edit costs beyond its steps. Both savings here are exact: a UNet of 4 input channels never reads
the masked template's latents (the pipeline encodes it all the same, and the denoiser still draws
its sample, to keep the generator's order), and a template's own distribution, the same for every
edit of it, is kept (`EditEncoder`, by the digest of its pixels).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from backends.core.runtime.placement import Placement

# Host memory for templates' distributions (at 1024 px: 0.5 MiB a template).
TEMPLATE_BYTES = 256 << 20


@torch.inference_mode()
def encode_edit(vae, image: np.ndarray, mask: np.ndarray, vae_scale_factor: int, masked_image: bool = True,
                template: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """`image` [H, W, 3] and `mask` [H, W] uint8 -> the EditInputs arrays (image_mean, image_std,
    masked_mean, masked_std, mask), float32 on the host. `template`: the image's (mean, std),
    encoded before; without `masked_image` (a UNet of 4 input channels) the masked template's
    mean and std are zeros of their shape."""
    pixels = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0 * 2.0 - 1.0  # VaeImageProcessor
    repaint = (torch.from_numpy(mask)[None, None].float() / 255.0 >= 0.5).float()  # mask_processor: binarized
    h, w = mask.shape[0] // vae_scale_factor, mask.shape[1] // vae_scale_factor
    out = {"mask": F.interpolate(repaint, size=(h, w)).numpy()}
    out["image_mean"], out["image_std"] = template if template is not None else _distribution(vae, pixels)
    if masked_image:
        out["masked_mean"], out["masked_std"] = _distribution(vae, pixels * (repaint < 0.5))
    else:
        out["masked_mean"] = out["masked_std"] = np.zeros_like(out["image_mean"])
    return out


def _distribution(vae, pixels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    dist = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist
    return dist.mean.float().cpu().numpy(), dist.std.float().cpu().numpy()


class EditEncoder:
    """The VAE's encoder, from a model folder's `vae` (the VAE decoder's copy), in the dtype the
    inpaint pipeline encodes in (fp32 for a VAE that asks diffusers to upcast, as SDXL's does).
    `masked_image`: whether the UNet reads the masked template (9 input channels). Templates'
    distributions are kept, least recently used first out, within `template_bytes`."""

    def __init__(self, folder: str | Path, placement: Placement, masked_image: bool = True,
                 template_bytes: int = TEMPLATE_BYTES):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(Path(folder) / "vae", use_safetensors=True)
        dtype = placement.torch_dtype
        if dtype == torch.float16 and vae.config.force_upcast:
            dtype = torch.float32
        del vae.decoder, vae.post_quant_conv  # (encoding only: half the weights stay off the device)
        self.vae = vae.to(torch.device(placement.device), dtype).eval()
        self.scaling_factor = float(vae.config.scaling_factor)
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.masked_image = masked_image
        self.template_bytes = template_bytes
        self.templates: OrderedDict[str, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.template_hits = 0

    def encode(self, image: np.ndarray, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The EditInputs arrays of a checked template and mask (request/edit_inputs.py)."""
        key = hashlib.sha256(np.ascontiguousarray(image).tobytes()).hexdigest() + str(image.shape)
        template = self.templates.get(key)
        if template is not None:
            self.templates.move_to_end(key)
            self.template_hits += 1
        out = encode_edit(self.vae, image, mask, self.vae_scale_factor, self.masked_image, template)
        if template is None:
            self._keep(key, out["image_mean"], out["image_std"])
        return out

    def _keep(self, key: str, mean: np.ndarray, std: np.ndarray) -> None:
        for a in (mean, std):
            a.flags.writeable = False  # shared by every later edit of the template
        self.templates[key] = (mean, std)
        while sum(m.nbytes + s.nbytes for m, s in self.templates.values()) > self.template_bytes:
            self.templates.popitem(last=False)
