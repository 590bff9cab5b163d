"""Where export puts each component inside a model's version folder, and how it is loaded back.

Layout (inside `<repo>/<model>/1/`):
  text_encoder:  text_encoder/ text_encoder_2/ tokenizer/ tokenizer_2/   (transformers folders)
  denoiser:      unet/config.json, unet/encoder.safetensors, unet/decoder.safetensors, scheduler/
  vae_decoder:   vae/   (diffusers AutoencoderKL folder)
Only safetensors are ever read; nothing here unpickles.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from backends.core.runtime.placement import Placement

UNET_DIR = "unet"
ENCODER_FILE = "encoder.safetensors"
DECODER_FILE = "decoder.safetensors"


def load_unet_halves(folder: Path, placement: Placement):
    """The UNet built from its config with the two halves' weights; returns (unet, encoder, decoder)."""
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.unet_split import split_unet

    unet_dir = Path(folder) / UNET_DIR
    config = json.loads((unet_dir / "config.json").read_text())
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    encoder, decoder = split_unet(unet)
    for half, name in ((encoder, ENCODER_FILE), (decoder, DECODER_FILE)):
        state = load_file(str(unet_dir / name), device=placement.device)
        missing, unexpected = half.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"{unet_dir / name}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    unet = unet.to(device=placement.device, dtype=placement.torch_dtype).eval()
    # Non-persistent buffers are not in any state dict; rebuild them off the meta device.
    for module in unet.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                raise ValueError(f"buffer {key} of {type(module).__name__} was not restored")
    return unet, encoder, decoder
