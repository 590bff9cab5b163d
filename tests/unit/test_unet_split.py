"""backends/core/runtime/unet_split.py: the UNet cut at the mid block must be the very same function.

Tolerance: none where the halves and the UNet run on the same weight tensors: the halves run the
UNet's own modules in the UNet's own order, so outputs are compared with torch.equal
(bit-identical), on both tiny model variants. After an export round trip the weights are
bit-equal but live at other addresses: CPU kernels (oneDNN/MKL, AVX-512 on some machines) pick
code paths by alignment, so a forward on reloaded weights may differ from the original in the last
bits. There the forward is compared within RELOAD_RTOL of the output's scale (seen failing with
torch.equal on an AMD EPYC with AVX-512; fp32 rounding differences are ~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import UNet2DConditionModel

from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.placement import Placement
from backends.core.runtime.unet_split import UNetDecoder, UNetEncoder, num_skips, split_forward, split_unet
from export.repository import ExportOptions, export_repository

RELOAD_RTOL = 1e-5


@pytest.fixture(scope="module", params=["tiny_model", "alt_model"])
def model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def unet(model_dir):
    return UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()


def make_inputs(unet, batch: int, height: int, width: int, seed: int = 0):
    """Random UNet inputs with a different timestep on every row, as a mixed batch has."""
    cfg = unet.config
    g = torch.Generator().manual_seed(seed)
    pooled_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    return dict(
        sample=torch.randn(batch, cfg.in_channels, height, width, generator=g),
        timestep=torch.linspace(999.0, 1.0, batch) if batch > 1 else torch.tensor([417.0]),
        encoder_hidden_states=torch.randn(batch, 7, cfg.cross_attention_dim, generator=g),
        text_embeds=torch.randn(batch, pooled_dim, generator=g),
        time_ids=torch.tensor([[8.0 * height, 8.0 * width, 0, 0, 8.0 * height, 8.0 * width]]).repeat(batch, 1),
    )


@torch.no_grad()
def full_unet(unet, x, **extra):
    return unet(x["sample"], x["timestep"], x["encoder_hidden_states"],
                added_cond_kwargs={"text_embeds": x["text_embeds"], "time_ids": x["time_ids"]}, **extra).sample


def halves(unet, x, **extra):
    encoder, decoder = split_unet(unet)
    return split_forward(encoder, decoder, x["sample"], x["timestep"], x["encoder_hidden_states"],
                         x["text_embeds"], x["time_ids"], **extra)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("size", [(8, 8), (9, 13)], ids=["8x8", "9x13"])
def test_halves_equal_the_full_unet(unet, batch, size):
    x = make_inputs(unet, batch, *size)
    expected = full_unet(unet, x)
    got = halves(unet, x)
    assert got.shape == (batch, unet.config.out_channels, *size)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_rows_really_get_their_own_timestep(unet):
    # Guards the test above: a UNet that ignored per-row timesteps would fail it.
    x = make_inputs(unet, 3, 8, 8)
    y = {**x, "timestep": x["timestep"].flip(0)}
    assert not torch.allclose(halves(unet, x), halves(unet, y))


@pytest.mark.parametrize("batch,size", [(1, (8, 8)), (3, (9, 13))], ids=["1x8x8", "3x9x13"])
def test_halves_with_controlnet_residuals_equal_the_full_unet(unet, batch, size):
    x = make_inputs(unet, batch, *size, seed=1)
    encoder, _ = split_unet(unet)
    with torch.no_grad():
        _, mid, skips = encoder(x["sample"], x["timestep"], x["encoder_hidden_states"], x["text_embeds"],
                                x["time_ids"])
    g = torch.Generator().manual_seed(2)
    down = tuple(torch.randn(s.shape, generator=g) for s in skips)
    mid_residual = torch.randn(mid.shape, generator=g)

    expected = full_unet(unet, x, down_block_additional_residuals=down, mid_block_additional_residual=mid_residual)
    got = halves(unet, x, down_residuals=down, mid_residual=mid_residual)
    assert torch.equal(got, expected), (got - expected).abs().max()
    assert not torch.allclose(got, full_unet(unet, x))  # the residuals did change the result
    # ControlNets always give both kinds (diffusers applies them only together); zero residuals change nothing.
    zeros = tuple(torch.zeros_like(d) for d in down)
    assert torch.equal(halves(unet, x, down_residuals=zeros, mid_residual=torch.zeros_like(mid)), full_unet(unet, x))


def test_decoder_refuses_a_wrong_number_of_residuals(unet):
    x = make_inputs(unet, 1, 8, 8)
    encoder, decoder = split_unet(unet)
    with torch.no_grad():
        emb, mid, skips = encoder(x["sample"], x["timestep"], x["encoder_hidden_states"], x["text_embeds"],
                                  x["time_ids"])
        with pytest.raises(ValueError, match=f"{len(skips) - 1} down residuals for {len(skips)} skips"):
            decoder(emb, mid, skips, x["encoder_hidden_states"], [torch.zeros_like(s) for s in skips[1:]])


@pytest.mark.parametrize("size", [(8, 8), (9, 13)], ids=["8x8", "9x13"])
def test_num_skips_matches_the_encoder_output(unet, size):
    x = make_inputs(unet, 2, *size)
    encoder, _ = split_unet(unet)
    with torch.no_grad():
        emb, mid, skips = encoder(x["sample"], x["timestep"], x["encoder_hidden_states"], x["text_embeds"],
                                  x["time_ids"])
    assert len(skips) == num_skips(unet)
    assert skips[0].shape[-2:] == size  # conv_in's output comes first
    assert emb.shape[0] == 2 and mid.shape[0] == 2


def test_halves_own_disjoint_parameters_covering_the_unet(unet):
    encoder, decoder = split_unet(unet)
    full = unet.state_dict()
    enc, dec = encoder.state_dict(), decoder.state_dict()
    assert enc and dec
    assert not set(enc) & set(dec)
    assert set(enc) | set(dec) == set(full)  # the UNet's own key names, nothing missing or extra
    for key, tensor in {**enc, **dec}.items():
        assert tensor.data_ptr() == full[key].data_ptr(), key  # shared, not copied
    params = {id(p) for p in unet.parameters()}
    enc_params = {id(p) for p in encoder.parameters()}
    dec_params = {id(p) for p in decoder.parameters()}
    assert not enc_params & dec_params and enc_params | dec_params == params
    assert "unet" not in dict(encoder.named_children()) and "unet" not in dict(decoder.named_children())


@pytest.mark.parametrize("change", [
    {"addition_embed_type": None},
    {"class_embed_type": "timestep"},
    {"time_cond_proj_dim": 8},
    {"center_input_sample": True},
], ids=lambda c: next(iter(c)))
def test_unsupported_configs_are_rejected(tiny_model, change):
    config = {**UNet2DConditionModel.load_config(tiny_model / "unet"), **change}
    other = UNet2DConditionModel.from_config(config)
    key = next(iter(change))
    for build in (split_unet, UNetEncoder, UNetDecoder):
        with pytest.raises(ValueError, match=f"{key}=.*not supported"):
            build(other)


def test_load_unet_halves_after_export_gives_the_same_unet(model_dir, unet, tmp_path):
    repo = export_repository(model_dir, tmp_path / "repo", ExportOptions(device="cpu"))
    loaded, encoder, decoder = load_unet_halves(repo / "denoiser" / "1", Placement())
    assert encoder.unet is loaded and decoder.unet is loaded
    original, restored = unet.state_dict(), loaded.state_dict()
    assert set(original) == set(restored)
    for key in original:
        assert restored[key].device.type == "cpu" and torch.equal(restored[key], original[key]), key
    for batch, size in [(1, (8, 8)), (3, (9, 13))]:
        x = make_inputs(unet, batch, *size, seed=5)
        expected = full_unet(unet, x)
        got = split_forward(encoder, decoder, x["sample"], x["timestep"], x["encoder_hidden_states"],
                            x["text_embeds"], x["time_ids"])
        assert torch.equal(got, full_unet(loaded, x))  # same weight tensors: bit-identical
        scale = expected.abs().max().item()
        assert (got - expected).abs().max().item() <= RELOAD_RTOL * scale, (got - expected).abs().max()
