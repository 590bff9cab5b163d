"""Tiny ControlNets for the demo and tests, written into an adapter store beside a tiny pipeline.

Built from the pipeline's own UNet (as ControlNet training starts) and then given random zero
convolutions: a fresh ControlNet's zero convolutions make its residuals exactly zero, which would
let a test pass while the residuals were dropped on the floor.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from backends.core.adapter_store import CONTROLNET_DIR

log = logging.getLogger(__name__)

TINY_CONTROLNETS = ("canny", "depth")


def write_tiny_controlnets(store: str | Path, unet, seed: int = 0, names=TINY_CONTROLNETS,
                           embedding_channels=(4, 8, 8, 16)) -> list[Path]:
    """`embedding_channels`: the control image embedding (8x down); SDXL's is (16, 32, 96, 256),
    which dwarfs a tiny UNet."""
    from diffusers import ControlNetModel

    written = []
    for index, name in enumerate(names):
        with torch.random.fork_rng(devices=[]), torch.device(unet.device):
            torch.manual_seed(seed * 16 + 8 + index)
            controlnet = ControlNetModel.from_unet(unet, conditioning_channels=3,
                                                   conditioning_embedding_out_channels=embedding_channels)
            zero_convs = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                          controlnet.controlnet_cond_embedding.conv_out]
            with torch.no_grad():
                for conv in zero_convs:
                    conv.weight.normal_(0.0, 0.05)
                    conv.bias.normal_(0.0, 0.05)
        folder = Path(store) / CONTROLNET_DIR / name
        controlnet.to(unet.dtype).save_pretrained(folder, safe_serialization=True)
        written.append(folder)
    log.info("wrote tiny ControlNets %s to %s", list(names), store)
    return written


def write_tiny_adapter_store(pipeline_dir: str | Path, store: str | Path | None = None, seed: int = 0) -> Path:
    """An adapter store for the tiny pipeline in `pipeline_dir` (default: `<pipeline_dir>/adapters`)."""
    from diffusers import UNet2DConditionModel

    store = Path(store) if store is not None else Path(pipeline_dir) / "adapters"
    unet = UNet2DConditionModel.from_pretrained(Path(pipeline_dir) / "unet", use_safetensors=True)
    write_tiny_controlnets(store, unet, seed)
    return store
