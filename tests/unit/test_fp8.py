"""FP8 products with static scales (backends/core/runtime/fp8.py) on CPU: an approximate mode, so
these tests bound its error instead of asking for equality.

Bounds: e4m3 keeps 3 mantissa bits, so each operand is rounded by up to 2^-4 of itself (6.25%);
over a dot product the errors mostly cancel, and a product's RMS error relative to the exact
one's RMS is about 3-4% for random operands. Measured on a 2-core x86-64 CPU: 3.6% and 3.8% for
one product, 4.4% for the tiny UNet's noise (calibrated on export's data). The tests assert <= 8% and <= 10%, and > 0.1% so that
a product which silently stayed in fp32 fails.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusers import StableDiffusionXLPipeline
from safetensors.torch import load_file

from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.config import FP8_PARTS, RuntimeConfig
from backends.core.runtime.fp8 import (CALIBRATION_FILE, CALIBRATION_PROMPTS, HEADROOM, Fp8Linear, calibrate_from_file,
                                       calibrating, use_fp8, write_calibration)
from backends.core.runtime.packed_attention import PackedSelfAttnProcessor, pack_attention
from backends.core.runtime.placement import Placement
from backends.core.runtime.unet_split import split_forward
from clients.bench.common import rel_rms
from export.cli import parser
from export.repository import ExportOptions, export_repository
from tests.unit.test_packed_attention import inputs


def linear(seed=0, n_in=64, n_out=96):
    torch.manual_seed(seed)
    return nn.Linear(n_in, n_out)


@torch.no_grad()
def test_an_fp8_product_stays_near_the_exact_one():
    lin = linear()
    x = torch.randn(4, 32, 64)
    fp8 = Fp8Linear(lin.weight, lin.bias)
    with calibrating([fp8]):
        assert torch.equal(fp8(x), lin(x))  # calibrating runs the exact product
    assert float(fp8.x_amax) == pytest.approx(float(x.abs().max()))
    error = rel_rms(fp8(x), lin(x))
    assert 1e-3 < error <= 0.08, f"relative RMS error {error:.4f}"
    # Inputs up to HEADROOM times the calibrated range keep their precision; tiny ones too.
    assert rel_rms(fp8(x * HEADROOM), lin(x * HEADROOM)) <= 0.08
    assert rel_rms(fp8(x / 1000) - lin.bias, lin(x / 1000) - lin.bias) <= 0.08
    # Further out the input saturates: wrong, but finite (an unclamped e4m3 cast gives NaN).
    assert torch.isfinite(fp8(x * 100)).all()


@torch.no_grad()
def test_requantize_follows_an_in_place_weight_write():
    """The fp16 weight is what a LoRA merge writes; the e4m3 copy follows on requantize(), in place."""
    lin = linear()
    x = torch.randn(8, 64)
    fp8 = Fp8Linear(lin.weight, lin.bias)
    with calibrating([fp8]):
        fp8(x)
    w8 = fp8.w8
    before = fp8(x)
    lin.weight.add_(torch.randn_like(lin.weight))
    assert torch.equal(fp8(x), before)  # the copy is stale until requantized
    fp8.requantize()
    assert fp8.w8 is w8  # the same storage: a captured graph reads the new values
    assert rel_rms(fp8(x), lin(x)) <= 0.08


@torch.no_grad()
def test_a_small_input_range_in_fp16_stays_finite():
    """The input's multiplier (448 / range) is applied in fp32: in fp16 it overflows below 0.0017."""
    lin = linear().half()
    x = (torch.randn(8, 64) * 1e-4).half()
    fp8 = Fp8Linear(lin.weight, None)
    with calibrating([fp8]):
        fp8(x)
    got = fp8(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert rel_rms(got.float(), torch.nn.functional.linear(x.float(), lin.weight.float())) <= 0.08


def test_dimensions_must_be_multiples_of_16():
    with pytest.raises(ValueError, match="multiples of 16"):
        Fp8Linear(torch.zeros(24, 64), None)
    with pytest.raises(ValueError, match=r"fp8 parts: \['nope'\]"):
        use_fp8(nn.Module(), ("nope",))


@pytest.fixture(scope="module")
def folder(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("fp8") / "repo", ExportOptions()) / "denoiser" / "1"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_export_writes_calibration_text_from_the_models_encoders(tiny_model, tmp_path, dtype):
    """What `easel export --fp8` writes (on the CPU, in the export's dtype): each calibration
    prompt's text beside its negative's, as the pipeline's own encode_prompt makes them."""
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_model, dtype=dtype)
    path = tmp_path / CALIBRATION_FILE
    write_calibration(pipe, path, 64)
    data = load_file(str(path))
    n = len(CALIBRATION_PROMPTS)
    embeds, negative, pooled, _ = pipe.encode_prompt(list(CALIBRATION_PROMPTS), device="cpu")
    assert torch.equal(data["text"][n:], embeds) and torch.equal(data["text"][:n], negative)
    assert torch.equal(data["pooled"][n:], pooled) and data["pooled"].shape[0] == 2 * n
    assert data["latent_hw"].tolist() == [64 // pipe.vae_scale_factor] * 2
    assert data["time_ids"].tolist() == [[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]]


@torch.no_grad()
def test_the_tiny_unet_in_fp8_stays_near_fp32(folder, tiny_model, tmp_path):
    _, enc0, dec0 = load_unet_halves(folder, Placement())
    unet, enc, dec = load_unet_halves(folder, Placement())
    pack_attention(unet)
    layers = use_fp8(unet)
    packed = [m.processor for m in unet.modules() if isinstance(getattr(m, "processor", None), PackedSelfAttnProcessor)]
    assert packed and all(isinstance(p.qkv_product, Fp8Linear) for p in packed)
    linears = [m for m in unet.modules() if type(m) is nn.Linear]
    assert len(layers) >= 3 * len(packed)  # QKV, two feed-forward products per block at least
    assert not any(isinstance(m, Fp8Linear) for m in linears)
    # attention's output projections stay in the model's dtype (use_fp8 says why)
    outs = [m.to_out[0] for m in unet.modules() if hasattr(m, "to_out") and hasattr(m, "to_q")]
    assert outs and all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in outs)

    path = tmp_path / CALIBRATION_FILE
    with pytest.raises(ValueError, match="runtime.fp8: no calibration data at .*easel export --fp8"):
        calibrate_from_file(layers, unet, enc, dec, path)
    write_calibration(StableDiffusionXLPipeline.from_pretrained(tiny_model), path, 64)
    calibrate_from_file(layers, unet, enc, dec, path)
    assert all(float(layer.x_scale) > 0 for layer in layers)

    measured = inputs(unet, rows=3)  # other inputs than the calibration's
    want = split_forward(enc0, dec0, *measured)
    error = rel_rms(split_forward(enc, dec, *measured), want)
    assert 1e-3 < error <= 0.10, f"noise relative RMS error {error:.4f}"

    # bench/fp8_fidelity's diagnosis, which the GPU figures rest on: each product's own error, and
    # the products emulated in fp32 (a CPU's torch._scaled_mm gives the same noise within 5%).
    from clients.bench.fp8_diagnosis import diagnose

    found = diagnose(layers, unet, lambda: split_forward(enc, dec, *measured), want)
    assert found["noise_rms_rel_error"] == pytest.approx(error)
    assert found["noise_rms_rel_error_emulated"] == pytest.approx(error, rel=0.05)
    assert 1e-3 < found["own_error_median"] <= found["own_error_max"] <= 0.08
    assert all("product" not in vars(layer) for layer in layers)  # each layer's own product again


def test_fp8_is_configured_only_for_a_fast_runtime():
    assert RuntimeConfig(kind="compiled", fp8=["feed_forward"]).fp8 == ("feed_forward",)
    with pytest.raises(ValueError, match=r"runtime.fp8: \['ffn'\] not among"):
        RuntimeConfig(kind="compiled", fp8=("ffn",))
    with pytest.raises(ValueError, match="runtime.fp8: needs a fast runtime"):
        RuntimeConfig(kind="eager", fp8=("feed_forward",))
    with pytest.raises(ValueError, match="fp8: needs a fast runtime"):
        ExportOptions(fp8=("feed_forward",))  # the CPU: eager
    assert ExportOptions(device="cuda", gpus=(0,), fp8=FP8_PARTS).runtime_config(8, 1024).fp8 == FP8_PARTS
    args = parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "all"])
    assert args.fp8 == FP8_PARTS
    assert parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "feed_forward"]).fp8 == ("feed_forward",)
    assert parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "attention, projections"]).fp8 == \
        ("attention", "projections")
    assert parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "all,feed_forward"]).fp8 == FP8_PARTS
    with pytest.raises(SystemExit):
        parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "ff"])


def test_fast_accumulation_is_an_fp8_option_that_reaches_the_runtime_config():
    with pytest.raises(ValueError, match="runtime.fp8_fast_accum: needs runtime.fp8"):
        RuntimeConfig(kind="compiled", fp8_fast_accum=True)
    with pytest.raises(ValueError, match="fp8_fast_accum: needs --fp8"):
        ExportOptions(device="cuda", gpus=(0,), fp8_fast_accum=True)
    args = parser().parse_args(["export", "--model", "m", "--out", "o", "--fp8", "all", "--fp8-fast-accum"])
    options = ExportOptions(device="cuda", gpus=(0,), fp8=args.fp8, fp8_fast_accum=args.fp8_fast_accum)
    config = options.runtime_config(8, 1024)
    assert config.fp8_fast_accum and RuntimeConfig.from_dict(config.to_dict()) == config
    assert not ExportOptions(device="cuda", gpus=(0,), fp8=FP8_PARTS).runtime_config(8, 1024).fp8_fast_accum
