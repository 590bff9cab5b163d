"""Tiny ControlNets and LoRAs for the demo and tests, written into an adapter store beside a tiny
pipeline.

Built from the pipeline's own UNet (as ControlNet training starts) and then given random zero
convolutions: a fresh ControlNet's zero convolutions make its residuals exactly zero, which would
let a test pass while the residuals were dropped on the floor.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch

from backends.core.adapters.store import CONTROLNET_DIR, LORA_DIR

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


TINY_LORAS = {"papercut": ("peft", 4, None), "inkwash": ("kohya", 8, 4.0),  # name: (layout, rank, alpha)
              "charcoal": ("kohya", 4, 2.0)}
TEXT_ENCODER_LORAS = ("charcoal",)  # these also have layers for both text encoders
# The layers real SDXL LoRAs touch: attention projections and the feed-forward output.
LORA_TARGETS = re.compile(r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$|ff\.net\.2$")
# ... and in the CLIP text encoders (kohya's train_network default): attention and MLP Linears.
TEXT_LORA_TARGETS = re.compile(r"self_attn\.(q_proj|k_proj|v_proj|out_proj)$|mlp\.(fc1|fc2)$")


def write_tiny_loras(store: str | Path, unet, seed: int = 0, text_encoders=()) -> list[Path]:
    """Random LoRAs in the two layouts found in the wild: diffusers/PEFT and kohya. Those in
    TEXT_ENCODER_LORAS also get layers for `text_encoders` (the pipeline's two CLIP encoders)."""
    from safetensors.torch import save_file

    targets = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear) and LORA_TARGETS.search(n)]
    folder = Path(store) / LORA_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for index, (name, (layout, rank, alpha)) in enumerate(TINY_LORAS.items()):
        generator = torch.Generator().manual_seed(seed * 16 + 12 + index)
        state = {}
        for module in targets:
            linear = unet.get_submodule(module)
            down = torch.randn(rank, linear.in_features, generator=generator) * 0.1
            up = torch.randn(linear.out_features, rank, generator=generator) * 0.1
            if layout == "peft":
                state[f"unet.{module}.lora_A.weight"] = down
                state[f"unet.{module}.lora_B.weight"] = up
            else:
                key = "lora_unet_" + module.replace(".", "_")
                state.update({f"{key}.lora_down.weight": down, f"{key}.lora_up.weight": up,
                              f"{key}.alpha": torch.tensor(alpha)})
        if name in TEXT_ENCODER_LORAS:
            if len(text_encoders) != 2 or layout != "kohya":
                raise ValueError(f"LoRA {name!r} needs the two text encoders and the kohya layout")
            state.update(_kohya_text_layers(text_encoders, rank, alpha, generator))
        path = folder / f"{name}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        written.append(path)
    log.info("wrote tiny LoRAs %s to %s", list(TINY_LORAS), store)
    return written


def _kohya_text_layers(text_encoders, rank: int, alpha: float, generator) -> dict[str, torch.Tensor]:
    """kohya names the encoders lora_te1_/lora_te2_ and always spells the `text_model.` that
    transformers 5 dropped from CLIPTextModel."""
    state = {}
    for prefix, encoder in zip(("lora_te1_", "lora_te2_"), text_encoders):
        for module, linear in encoder.named_modules():
            if not (isinstance(linear, torch.nn.Linear) and TEXT_LORA_TARGETS.search(module)):
                continue
            key = prefix + "text_model_" + module.removeprefix("text_model.").replace(".", "_")
            state[f"{key}.lora_down.weight"] = torch.randn(rank, linear.in_features, generator=generator) * 0.2
            state[f"{key}.lora_up.weight"] = torch.randn(linear.out_features, rank, generator=generator) * 0.2
            state[f"{key}.alpha"] = torch.tensor(alpha)
    return state


def write_tiny_adapter_store(pipeline_dir: str | Path, store: str | Path | None = None, seed: int = 0) -> Path:
    """An adapter store for the tiny pipeline in `pipeline_dir` (default: `<pipeline_dir>/adapters`)."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    store = Path(store) if store is not None else Path(pipeline_dir) / "adapters"
    unet = UNet2DConditionModel.from_pretrained(Path(pipeline_dir) / "unet", use_safetensors=True)
    text_encoders = (CLIPTextModel.from_pretrained(Path(pipeline_dir) / "text_encoder", use_safetensors=True),
                     CLIPTextModelWithProjection.from_pretrained(Path(pipeline_dir) / "text_encoder_2",
                                                                 use_safetensors=True))
    write_tiny_controlnets(store, unet, seed)
    write_tiny_loras(store, unet, seed, text_encoders)
    return store
