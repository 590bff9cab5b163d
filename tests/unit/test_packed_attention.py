"""Packed attention projections (backends/core/runtime/packed_attention.py) on CPU, on the tiny
UNet: the packed halves against the stock ones, and the promises the fast runtime relies on
(weights stay views, so in-place writes reach the packed products; hooks take the stock path).

Tolerance: fp32, max |diff| <= 1e-5 against outputs of about unit size. The packed products
compute the same dot products as the stock ones, but one larger GEMM may block its sums
differently from three small ones, so bit equality depends on the CPU's kernels.
"""

from __future__ import annotations

import pytest
import torch

from backends.core.engine.builder import template_batch
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.packed_attention import (PackedCrossAttnProcessor, PackedSelfAttnProcessor,
                                                    pack_attention)
from backends.core.runtime.placement import Placement
from backends.core.runtime.unet_split import split_forward
from export.repository import ExportOptions, export_repository

TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("packed") / "repo", ExportOptions()) / "denoiser" / "1"


def halves(folder):
    unet, encoder, decoder = load_unet_halves(folder, Placement())
    return unet, encoder, decoder


def inputs(unet, rows=3):
    t = template_batch(unet, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(7)
    return (torch.randn(rows, *t.sample.shape[1:], generator=g), torch.linspace(900, 20, rows),
            torch.randn(rows, *t.text.shape[1:], generator=g), torch.randn(rows, *t.pooled.shape[1:], generator=g),
            t.time_ids.repeat(rows, 1))


def close(a, b):
    return (a - b).abs().max().item() <= TOL


@torch.no_grad()
def test_packed_halves_match_the_stock_ones(folder):
    _, enc0, dec0 = halves(folder)
    unet, enc, dec = halves(folder)
    sample, t, text, pooled, time_ids = inputs(unet)
    want = split_forward(enc0, dec0, sample, t, text, pooled, time_ids)

    projections = pack_attention(unet)
    assert projections is not None, "the tiny UNet's cross-attention should be packable"
    procs = [m.processor for m in unet.modules() if hasattr(m, "processor")]
    assert any(isinstance(p, PackedSelfAttnProcessor) for p in procs)
    assert any(isinstance(p, PackedCrossAttnProcessor) for p in procs)
    # Plain text: the self-attention packed, cross-attention the stock way.
    assert close(split_forward(enc, dec, sample, t, text, pooled, time_ids), want)
    # The text's K/V projections in place of the text: what the fast runtime hands the halves.
    packed = projections.project(text)
    assert packed.shape == (*text.shape[:2], projections.width)
    got = split_forward(enc, dec, sample, t, packed, pooled, time_ids)
    assert close(got, want), (got - want).abs().max()
    out = torch.empty_like(packed)
    assert projections.project(text, out=out) is out and torch.equal(out, packed)


@torch.no_grad()
def test_weights_stay_views_so_in_place_writes_reach_the_packed_products(folder):
    unet, enc, dec = halves(folder)
    names = [n for n, _ in unet.named_parameters()]
    projections = pack_attention(unet)
    assert [n for n, _ in unet.named_parameters()] == names  # the state dict's keys are unchanged
    packed = projections.weight
    cross = next(m for m in unet.modules() if isinstance(getattr(m, "processor", None), PackedCrossAttnProcessor))
    assert cross.to_v.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()

    sample, t, text, pooled, time_ids = inputs(unet)
    before = split_forward(enc, dec, sample, t, projections.project(text), pooled, time_ids)
    # A merge writes in place (LoraMerger: torch.add(..., out=weight)); so does refit.
    for lin in (cross.to_k, cross.to_v):
        lin.weight.mul_(1.5)
    self_attn = next(m for m in unet.modules() if isinstance(getattr(m, "processor", None), PackedSelfAttnProcessor))
    self_attn.to_q.weight.mul_(0.5)
    after = split_forward(enc, dec, sample, t, projections.project(text), pooled, time_ids)
    assert not close(after, before)

    _, enc0, dec0 = halves(folder)
    for attn in (cross, self_attn):  # the same writes on stock modules give the same UNet
        path = next(n for n, m in unet.named_modules() if m is attn)
        stock = enc0.unet.get_submodule(path)
        if attn is cross:
            stock.to_k.weight.mul_(1.5)
            stock.to_v.weight.mul_(1.5)
        else:
            stock.to_q.weight.mul_(0.5)
    assert close(after, split_forward(enc0, dec0, sample, t, text, pooled, time_ids))


@torch.no_grad()
def test_hooked_projections_take_the_stock_path(folder):
    """Unmerged LoRA terms are forward hooks on the projections: a packed product would skip them."""
    unet, enc, dec = halves(folder)
    projections = pack_attention(unet)
    sample, t, text, pooled, time_ids = inputs(unet)
    plain = split_forward(enc, dec, sample, t, text, pooled, time_ids)
    attn = next(m for m in unet.modules() if isinstance(getattr(m, "processor", None), PackedSelfAttnProcessor))
    handle = attn.to_v.register_forward_hook(lambda module, args, output: output * 2)
    try:
        hooked = split_forward(enc, dec, sample, t, text, pooled, time_ids)
        assert not close(hooked, plain)  # the hook ran: the self-attention went the stock way
        cross = next(m for m in unet.modules() if isinstance(getattr(m, "processor", None), PackedCrossAttnProcessor))
        cross_handle = cross.to_k.register_forward_hook(lambda module, args, output: output)
        try:
            with pytest.raises(ValueError, match="needs the text itself"):
                split_forward(enc, dec, sample, t, projections.project(text), pooled, time_ids)
        finally:
            cross_handle.remove()
    finally:
        handle.remove()
