"""The SDXL UNet split at the mid block into two halves that run as separate engines.

`encoder` = time/added embeddings + conv_in + down blocks + mid block; `decoder` = up blocks +
output head. ControlNet residuals join between them, which is what lets ControlNets run beside
the encoder half instead of before the whole UNet. Both halves hold the very same parameter
objects as the diffusers UNet they were split from (no copies), and their state_dict keys are
the UNet's own, so an artifact of a half is a subset of the UNet's safetensors.

The forward code follows `UNet2DConditionModel.forward` of diffusers line for line for the
SDXL configuration (addition_embed_type "text_time"); anything the split does not support is
rejected at construction instead of being silently ignored.
"""

from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel
from torch import nn

ENCODER_MODULES = (
    "time_proj", "time_embedding", "add_time_proj", "add_embedding", "time_embed_act",
    "conv_in", "down_blocks", "mid_block",
)
DECODER_MODULES = ("up_blocks", "conv_norm_out", "conv_act", "conv_out")


def _check_supported(unet: UNet2DConditionModel) -> None:
    cfg = unet.config
    unsupported = {
        "addition_embed_type": (cfg.addition_embed_type, "text_time"),
        "class_embed_type": (cfg.class_embed_type, None),
        "encoder_hid_dim_type": (cfg.encoder_hid_dim_type, None),
        "time_cond_proj_dim": (cfg.time_cond_proj_dim, None),
        "center_input_sample": (cfg.center_input_sample, False),
    }
    for key, (value, wanted) in unsupported.items():
        if value != wanted:
            raise ValueError(f"unet config {key}={value!r} is not supported by the split UNet (need {wanted!r})")


def num_skips(unet: UNet2DConditionModel) -> int:
    """How many skip tensors the encoder half hands to the decoder half (conv_in's output included)."""
    return 1 + sum(len(b.resnets) + (1 if b.downsamplers else 0) for b in unet.down_blocks)


class _Half(nn.Module):
    names: tuple[str, ...] = ()

    def __init__(self, unet: UNet2DConditionModel):
        super().__init__()
        _check_supported(unet)
        # Kept unregistered: the half must own only its own parameters, under the UNet's key names.
        object.__setattr__(self, "unet", unet)
        for name in self.names:
            module = getattr(unet, name)
            if module is not None:
                self.add_module(name, module)


class UNetEncoder(_Half):
    """(latents, t, text states, pooled text, time ids) -> (emb, mid sample, skips)."""

    names = ENCODER_MODULES

    def forward(self, sample, timestep, encoder_hidden_states, text_embeds, time_ids):
        unet = self.unet
        t_emb = unet.get_time_embed(sample=sample, timestep=timestep)
        emb = unet.time_embedding(t_emb, None)
        aug_emb = unet.get_aug_embed(
            emb=emb, encoder_hidden_states=encoder_hidden_states,
            added_cond_kwargs={"text_embeds": text_embeds, "time_ids": time_ids},
        )
        emb = emb + aug_emb
        if unet.time_embed_act is not None:
            emb = unet.time_embed_act(emb)

        sample = unet.conv_in(sample)
        skips = (sample,)
        for block in unet.down_blocks:
            if getattr(block, "has_cross_attention", False):
                sample, res = block(hidden_states=sample, temb=emb, encoder_hidden_states=encoder_hidden_states)
            else:
                sample, res = block(hidden_states=sample, temb=emb)
            skips += res

        if unet.mid_block is not None:
            if getattr(unet.mid_block, "has_cross_attention", False):
                sample = unet.mid_block(sample, emb, encoder_hidden_states=encoder_hidden_states)
            else:
                sample = unet.mid_block(sample, emb)
        return emb, sample, skips


class UNetDecoder(_Half):
    """(emb, mid sample, skips, text states[, ControlNet residuals]) -> noise prediction."""

    names = DECODER_MODULES

    def forward(self, emb, sample, skips, encoder_hidden_states, down_residuals=None, mid_residual=None):
        unet = self.unet
        if down_residuals is not None:
            if len(down_residuals) != len(skips):
                raise ValueError(f"got {len(down_residuals)} down residuals for {len(skips)} skips")
            skips = tuple(s + r for s, r in zip(skips, down_residuals))
        if mid_residual is not None:
            sample = sample + mid_residual

        # Latent sizes that are not a multiple of the overall up factor need explicit upsample
        # sizes, taken from the skips exactly as diffusers does.
        factor = 2**unet.num_upsamplers
        forward_upsample_size = any(d % factor != 0 for d in skips[0].shape[-2:])
        upsample_size = None
        for i, block in enumerate(unet.up_blocks):
            is_final = i == len(unet.up_blocks) - 1
            n = len(block.resnets)
            res, skips = skips[-n:], skips[:-n]
            if not is_final and forward_upsample_size:
                upsample_size = skips[-1].shape[2:]
            if getattr(block, "has_cross_attention", False):
                sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res,
                               encoder_hidden_states=encoder_hidden_states, upsample_size=upsample_size)
            else:
                sample = block(hidden_states=sample, temb=emb, res_hidden_states_tuple=res,
                               upsample_size=upsample_size)

        if unet.conv_norm_out is not None:
            sample = unet.conv_act(unet.conv_norm_out(sample))
        return unet.conv_out(sample)


def split_unet(unet: UNet2DConditionModel) -> tuple[UNetEncoder, UNetDecoder]:
    return UNetEncoder(unet), UNetDecoder(unet)


@torch.no_grad()
def split_forward(encoder: UNetEncoder, decoder: UNetDecoder, sample, timestep, encoder_hidden_states,
                  text_embeds, time_ids, down_residuals=None, mid_residual=None):
    """The whole UNet through its two halves (what the denoiser runs when no ControlNet is active)."""
    emb, mid, skips = encoder(sample, timestep, encoder_hidden_states, text_embeds, time_ids)
    return decoder(emb, mid, skips, encoder_hidden_states, down_residuals, mid_residual)
