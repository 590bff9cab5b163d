"""Put the fused ops into a diffusers UNet2DConditionModel or AutoencoderKL, in place.

Modules are switched to a subclass by assigning `__class__`, not rebuilt: parameters stay
the same objects (an in-place LoRA merge into `norm1.weight` or `proj.weight` is seen), the
state_dict keys do not change, `isinstance` checks still hold, and torch.compile sees an
ordinary class-level forward. A module whose forward has been replaced on the instance (by
accelerate's hooks, say) or whose configuration the fused forward does not reproduce is left
as it is. Written against diffusers 0.42.1; the replacement forwards follow its code line
for line.
"""

from __future__ import annotations

import logging

import torch
from diffusers.models.activations import GEGLU
from diffusers.models.autoencoders.vae import Decoder, Encoder
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from diffusers.utils import deprecate
from torch import nn

from plugins import ops

log = logging.getLogger("plugins.patch")

_SCALE_DEPRECATION = (
    "The `scale` argument is deprecated and will be ignored. Please remove it, as passing it will raise an error "
    "in the future. `scale` should directly be passed while calling the underlying pipeline component i.e., via "
    "`cross_attention_kwargs`."
)

# Classes whose forward applies `conv_act` exactly once, right after `conv_norm_out`.
_NORM_OUT_OWNERS = (UNet2DConditionModel, Encoder, Decoder)


def _gn_silu(norm: nn.GroupNorm, x: torch.Tensor, pre_bias: torch.Tensor | None = None) -> torch.Tensor:
    return ops.group_norm_silu(x, norm.weight, norm.bias, norm.num_groups, norm.eps, pre_bias)


def _conv_leaving_bias(conv: nn.Module, x: torch.Tensor, allowed: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """conv(x), and None; or, where the bias may be left to the op that reads the output, conv(x)
    without it, and the bias. It may for a plain Conv2d with a bias and no hooks (unmerged LoRA
    terms are forward hooks), on CUDA, where torch adds a convolution's bias in a pass of its own
    anyway, so the sums are the same. (On CPU oneDNN adds it inside the convolution: the outputs
    would differ in the last bits.)"""
    if (allowed and x.is_cuda and _plain(conv, nn.Conv2d) and conv.bias is not None
            and not conv._forward_hooks and not conv._forward_pre_hooks):
        return conv._conv_forward(x, conv.weight, None), conv.bias
    return conv(x), None


class FusedResnetBlock2D(ResnetBlock2D):
    """ResnetBlock2D (affine GroupNorms, SiLU, any time_embedding_norm but "scale_shift") with
    norm1+SiLU and norm2+SiLU each one op; `self.nonlinearity` still applies to temb. Without a
    temb (the VAE's blocks) conv1's bias is added inside norm2's op; conv2's always is, with the
    residual and the output scale, in easel::bias_residual: torch would add each in a pass of its own."""

    def forward(self, input_tensor: torch.Tensor, temb: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", _SCALE_DEPRECATION)

        hidden_states = input_tensor

        hidden_states = _gn_silu(self.norm1, hidden_states)

        if self.upsample is not None:
            # upsample_nearest_nhwc fails with large batch sizes. see https://github.com/huggingface/diffusers/issues/984
            if hidden_states.shape[0] >= 64:
                input_tensor = input_tensor.contiguous()
                hidden_states = hidden_states.contiguous()
            input_tensor = self.upsample(input_tensor)
            hidden_states = self.upsample(hidden_states)
        elif self.downsample is not None:
            input_tensor = self.downsample(input_tensor)
            hidden_states = self.downsample(hidden_states)

        # A temb is added between conv1 and norm2: then conv1's bias stays in conv1.
        hidden_states, conv1_bias = _conv_leaving_bias(self.conv1, hidden_states, allowed=temb is None)

        if self.time_emb_proj is not None:
            if not self.skip_time_act:
                temb = self.nonlinearity(temb)
            temb = self.time_emb_proj(temb)[:, :, None, None]

        # "scale_shift" (an affine between norm2 and the activation) is never patched; "default"
        # adds temb; any other value (the VAE decoder's "group") is diffusers' plain-norm2 branch.
        if self.time_embedding_norm == "default" and temb is not None:
            hidden_states = hidden_states + temb
        hidden_states = _gn_silu(self.norm2, hidden_states, conv1_bias)

        hidden_states = self.dropout(hidden_states)
        hidden_states, conv2_bias = _conv_leaving_bias(self.conv2, hidden_states)

        if self.conv_shortcut is not None:
            if self.training:
                input_tensor = input_tensor.contiguous()
            input_tensor = self.conv_shortcut(input_tensor)

        if conv2_bias is not None:
            return ops.bias_residual(hidden_states, conv2_bias, input_tensor, self.output_scale_factor)
        output_tensor = (input_tensor + hidden_states) / self.output_scale_factor

        return output_tensor


class FusedGroupNormSiLU(nn.GroupNorm):
    """A GroupNorm that also applies SiLU: the owner's `conv_act` becomes Identity."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gn_silu(self, x)


class FusedGEGLU(GEGLU):
    """GEGLU whose chunk + gelu + multiply is one op (the projection stays a torch Linear)."""

    def forward(self, hidden_states, *args, **kwargs) -> torch.Tensor:
        if len(args) > 0 or kwargs.get("scale", None) is not None:
            deprecate("scale", "1.0.0", _SCALE_DEPRECATION)
        return ops.geglu(self.proj(hidden_states))


def _plain(module: nn.Module, cls: type) -> bool:
    """Exactly `cls` (a subclass may have its own forward) with no per-instance forward."""
    return type(module) is cls and "forward" not in module.__dict__


def _affine_group_norm(m: nn.Module) -> bool:
    return _plain(m, nn.GroupNorm) and m.affine


def _resnet_unsupported(block: ResnetBlock2D) -> str | None:
    if block.time_embedding_norm == "scale_shift":
        return "time_embedding_norm='scale_shift' puts an affine between norm2 and the activation"
    if not (_affine_group_norm(block.norm1) and _affine_group_norm(block.norm2)):
        return "norms are not affine nn.GroupNorm"
    if type(block.nonlinearity) is not nn.SiLU:
        return f"nonlinearity is {type(block.nonlinearity).__name__}"
    return None


def use_fused_kernels(model: nn.Module, groupnorm_silu: bool = True, geglu: bool = True) -> dict[str, int]:
    """Patch `model` (a UNet2DConditionModel, AutoencoderKL, or anything holding their blocks)
    in place to run easel::group_norm_silu and easel::geglu. Returns how many modules were
    patched by kind, and how many ResnetBlock2D were left unfused. Idempotent: modules already
    patched are not counted again."""
    counts = {"resnet_blocks": 0, "norm_out": 0, "geglu": 0, "resnet_blocks_skipped": 0}
    for name, module in list(model.named_modules()):  # listed first: conv_act is replaced on the way
        if groupnorm_silu and _plain(module, ResnetBlock2D):
            reason = _resnet_unsupported(module)
            if reason is None:
                module.__class__ = FusedResnetBlock2D
                counts["resnet_blocks"] += 1
            else:
                log.debug("left %s unfused: %s", name, reason)
                counts["resnet_blocks_skipped"] += 1
        elif groupnorm_silu and type(module) in _NORM_OUT_OWNERS and "forward" not in module.__dict__:
            norm, act = getattr(module, "conv_norm_out", None), getattr(module, "conv_act", None)
            if norm is not None and _affine_group_norm(norm) and type(act) is nn.SiLU:
                norm.__class__ = FusedGroupNormSiLU
                module.conv_act = nn.Identity()
                counts["norm_out"] += 1
        elif geglu and _plain(module, GEGLU):
            module.__class__ = FusedGEGLU
            counts["geglu"] += 1
    log.info("fused kernels: %s", counts)
    return counts
