"""Attention projections packed into fewer, larger matrix products, for the fast runtime.

Two exact rewrites of the UNet's attention (the same dot products; only which GEMM computes them
changes), each keeping the layers' weights as views of one packed tensor, so that everything that
writes weights in place (a LoRA merge, `refit`) writes into the packed tensor too:

- self-attention (`attn1`): `to_q`, `to_k` and `to_v` as one product of 3C columns instead of three
  of C: fewer, fuller kernels.
- cross-attention (`attn2`): its keys and values are projections of the text, which stays the same
  for all of a request's steps. `TextProjections.project` computes them for every cross-attention
  layer at once (one product, text x all layers' K and V weights), and the fast runtime hands the
  result to the UNet in place of the text, redoing it only when the batch's text or the weights
  change. SDXL has 70 cross-attention layers: 140 small products per step no longer run (0.8 ms of
  kernels, plus their launch gaps, in a 32.5 ms step at 1024 px on an H200: the step profile's
  `nvjet ... 64x32` kernel).

The processors fall back to diffusers' own (`AttnProcessor2_0`) whenever they are given plain text
or the projections carry forward hooks (the unmerged LoRA terms of a batch that mixes LoRAs,
which the fast runtime runs eager): then nothing differs from the stock path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from torch import nn

log = logging.getLogger(__name__)


def _plain(attn: Attention) -> bool:
    """An attention whose forward is exactly the packed processors' (SDXL's transformer blocks)."""
    return (type(attn.processor) is AttnProcessor2_0 and attn.spatial_norm is None and attn.group_norm is None
            and attn.norm_q is None and attn.norm_k is None and not attn.residual_connection
            and attn.rescale_output_factor == 1.0 and getattr(attn, "add_q_proj", None) is None
            and all(getattr(attn, p).bias is None for p in ("to_q", "to_k", "to_v")))


def _hooked(*modules: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _pack(linears: list[nn.Linear]) -> torch.Tensor:
    """One tensor holding the linears' weights one after another; each linear's weight becomes
    a view of it (a Parameter sharing its memory), so in-place writes reach the packed tensor."""
    first = linears[0].weight
    packed = torch.cat([lin.weight.detach() for lin in linears])
    row = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(packed[row:row + n], requires_grad=first.requires_grad)
        row += n
    return packed


def _attend(attn: Attention, query, key, value, batch: int) -> torch.Tensor:
    """[b, n, C] projections (any strides with a contiguous last dim) -> the attention's output."""
    heads = attn.heads
    head_dim = query.shape[-1] // heads

    def split(t):
        return t.unflatten(-1, (heads, head_dim)).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(query), split(key), split(value), dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(batch, -1, heads * head_dim).to(query.dtype)
    return attn.to_out[1](attn.to_out[0](out))


class PackedSelfAttnProcessor:
    """Self-attention with one QKV product over the packed [3C, C] weight."""

    def __init__(self, stock: AttnProcessor2_0, qkv: torch.Tensor):
        self.stock = stock
        self.qkv = qkv
        self.qkv_product: nn.Module | None = None  # the product over `qkv` in FP8 (runtime/fp8.py)

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        if (encoder_hidden_states is not None or attention_mask is not None or hidden_states.ndim != 3
                or _hooked(attn.to_q, attn.to_k, attn.to_v)):
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        qkv = F.linear(hidden_states, self.qkv) if self.qkv_product is None else self.qkv_product(hidden_states)
        query, key, value = qkv.chunk(3, dim=-1)
        return _attend(attn, query, key, value, hidden_states.shape[0])


@dataclass(frozen=True)
class _Slot:
    key: slice
    value: slice


class PackedCrossAttnProcessor:
    """Cross-attention that reads its keys and values from the packed text projections
    (`TextProjections.project`), given in place of the text; plain text goes the stock way."""

    def __init__(self, stock: AttnProcessor2_0, slot: _Slot, width: int):
        self.stock = stock
        self.slot = slot
        self.width = width

    def __call__(self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        packed = encoder_hidden_states is not None and encoder_hidden_states.shape[-1] == self.width
        if not packed:
            return self.stock(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)
        if attention_mask is not None or hidden_states.ndim != 3 or _hooked(attn.to_q, attn.to_k, attn.to_v):
            # Packed projections cannot be undone into text: a caller that hooks the projections
            # (unmerged LoRA terms) must give the text itself.
            raise ValueError("packed text projections given to a cross-attention that needs the text itself")
        query = attn.to_q(hidden_states)
        key = encoder_hidden_states[..., self.slot.key]
        value = encoder_hidden_states[..., self.slot.value]
        return _attend(attn, query, key, value, hidden_states.shape[0])


class TextProjections:
    """Every cross-attention layer's to_k and to_v weights packed into one [width, text dim]
    tensor (the layers' weights are views of it) and the processors that read their slices."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    def project(self, text: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, tokens, text dim] -> [rows, tokens, width]: what the UNet takes in place of the text."""
        if out is None:
            return F.linear(text, self.weight)
        torch.matmul(text, self.weight.t(), out=out)
        return out


def pack_attention(unet: nn.Module) -> TextProjections | None:
    """Pack the UNet's attention projections in place (see the module's docstring). Returns the
    text projections, or None when the UNet has no cross-attention this can serve."""
    self_layers, cross_layers = [], []
    for module in unet.modules():
        if isinstance(module, Attention) and _plain(module):
            (cross_layers if module.is_cross_attention else self_layers).append(module)
    for attn in self_layers:
        attn.set_processor(PackedSelfAttnProcessor(attn.processor, _pack([attn.to_q, attn.to_k, attn.to_v])))
    if not cross_layers:
        return None
    slots, row = [], 0
    for attn in cross_layers:
        k, v = attn.to_k.weight.shape[0], attn.to_v.weight.shape[0]
        slots.append(_Slot(slice(row, row + k), slice(row + k, row + k + v)))
        row += k + v
    if row in {attn.to_k.in_features for attn in cross_layers}:
        # The processors tell packed projections from text by their width: it must not be ambiguous.
        log.info("cross-attention text K/V not packed: their width equals the text's (%d)", row)
        return None
    weight = _pack([lin for attn in cross_layers for lin in (attn.to_k, attn.to_v)])
    for attn, slot in zip(cross_layers, slots):
        attn.set_processor(PackedCrossAttnProcessor(attn.processor, slot, row))
    log.info("packed attention projections: %d self-attention QKV, %d cross-attention layers' text K/V "
             "(%d columns)", len(self_layers), len(cross_layers), row)
    return TextProjections(weight)
