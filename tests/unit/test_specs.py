"""backends/core/runtime/specs.py: component specs derived from model configs alone.

The shapes a spec promises are checked against what the real modules produce, on both tiny
model variants (they differ in UNet depth, widths, layers per block and text encoder sizes).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from diffusers import UNet2DConditionModel

from backends.core.runtime import specs
from backends.core.runtime.specs import ComponentSpec, Profile, TensorSpec
from backends.core.runtime.unet_split import num_skips, split_unet


@pytest.fixture(scope="module", params=["tiny_model", "alt_model"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def config(model_dir, component):
    return json.loads((model_dir / component / "config.json").read_text())


def test_import_does_not_need_torch():
    code = "import sys, backends.core.runtime.specs; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unet_specs_match_the_split_unet(model_dir):
    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet").eval()
    enc_spec = specs.unet_encoder_spec(unet.config)
    dec_spec = specs.unet_decoder_spec(config(model_dir, "unet"))  # a plain json dict works too
    n = num_skips(unet)
    assert specs.unet_num_skips(unet.config) == n
    assert enc_spec.output_names == ["emb", "mid", *(f"skip_{i}" for i in range(n))]
    assert dec_spec.input_names == ["emb", "mid", *(f"skip_{i}" for i in range(n)), "encoder_hidden_states"]
    # The decoder consumes exactly what the encoder produces.
    assert enc_spec.outputs == dec_spec.inputs[:-1]

    encoder, decoder = split_unet(unet)
    sizes = dict(batch=2, latent_h=9, latent_w=13, tokens=5)  # odd sizes: ceil division at every level
    x = enc_spec.sample_inputs(**sizes)
    with torch.no_grad():
        emb, mid, skips = encoder(*(x[name] for name in enc_spec.input_names))
        out = decoder(emb, mid, skips, x["encoder_hidden_states"])
    for tensor, value in zip(enc_spec.outputs, (emb, mid, *skips)):
        assert tuple(value.shape) == tensor.shape(sizes), tensor.name
    assert tuple(out.shape) == dec_spec.outputs[0].shape(sizes)


def test_skip_counts_of_the_tiny_variants(tiny_model, alt_model):
    # default: 3 levels x 1 layer; alt: 2 levels x 2 layers. Both happen to give 6 skips, by
    # different routes: the levels of the skips tell them apart.
    assert specs.unet_skip_shapes(config(tiny_model, "unet")) == [(16, 0), (16, 0), (16, 1), (32, 1), (32, 2), (32, 2)]
    assert specs.unet_skip_shapes(config(alt_model, "unet")) == [(24, 0), (24, 0), (24, 0), (24, 1), (40, 1), (40, 1)]
    dec = specs.unet_decoder_spec(config(tiny_model, "unet"))
    assert dec.inputs[1].dims == ("batch", 32, "latent_h/4", "latent_w/4")


def test_text_and_pooled_dims_are_checked(model_dir):
    cfg = config(model_dir, "unet")
    te1, te2 = config(model_dir, "text_encoder"), config(model_dir, "text_encoder_2")
    spec = specs.unet_encoder_spec(cfg, te1["hidden_size"] + te2["hidden_size"], te2["projection_dim"])
    assert spec.inputs[4].dims == ("batch", 6)
    with pytest.raises(ValueError, match="cross_attention_dim"):
        specs.unet_encoder_spec(cfg, text_dim=te1["hidden_size"])
    with pytest.raises(ValueError, match="pooled_dim"):
        specs.unet_encoder_spec(cfg, pooled_dim=te2["projection_dim"] + 1)


def test_text_encoder_and_vae_specs(model_dir):
    te2 = config(model_dir, "text_encoder_2")
    spec = specs.text_encoder_spec(te2, "text_encoder_2")
    assert spec.output_names == ["penultimate_hidden_states", "text_embeds"]
    assert spec.outputs[1].dims == ("batch", te2["projection_dim"])
    assert specs.text_encoder_spec(config(model_dir, "text_encoder"), "text_encoder").output_names == [
        "penultimate_hidden_states"]
    ids = spec.sample_inputs(batch=3, tokens=77)["input_ids"]
    assert ids.shape == (3, 77) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < te2["vocab_size"]
    with pytest.raises(ValueError, match="tokens=78"):
        spec.sample_inputs(tokens=78)  # CLIP has 77 position embeddings
    with pytest.raises(ValueError, match="which"):
        specs.text_encoder_spec(te2, "text_encoder_3")

    vae = specs.vae_decoder_spec(config(model_dir, "vae"))
    assert vae.outputs[0].shape(dict(batch=1, latent_h=9, latent_w=13)) == (1, 3, 72, 104)


def test_sample_inputs_shapes_and_dtypes(tiny_model):
    spec = specs.unet_encoder_spec(config(tiny_model, "unet"))
    x = spec.sample_inputs(model_dtype="fp16", batch=3, latent_h=12, latent_w=16, tokens=20)
    assert list(x) == spec.input_names
    assert x["sample"].shape == (3, 4, 12, 16) and x["sample"].dtype == torch.float16
    assert x["timestep"].shape == (3,) and x["timestep"].dtype == torch.float32  # always fp32
    assert x["encoder_hidden_states"].shape == (3, 20, 64)
    assert x["text_embeds"].shape == (3, 32) and x["time_ids"].shape == (3, 6)
    assert 0 <= float(x["timestep"].min()) and float(x["timestep"].max()) < 1000
    # Same seed, same values whatever the dtype.
    x32 = spec.sample_inputs(model_dtype="fp32", batch=3, latent_h=12, latent_w=16, tokens=20)
    assert torch.equal(x32["sample"].half(), x["sample"])
    with pytest.raises(ValueError, match="unknown axes"):
        spec.sample_inputs(height=8)


def test_dynamic_axes_and_profiles(tiny_model):
    spec = specs.unet_decoder_spec(config(tiny_model, "unet"))
    axes = spec.dynamic_axes()
    assert axes["mid"] == {0: "batch", 2: "latent_h/4", 3: "latent_w/4"}
    assert axes["model_output"] == {0: "batch", 2: "latent_h", 3: "latent_w"}
    assert len(spec.dynamic_shapes()) == len(spec.inputs)
    assert spec.base_axes() == ["batch", "latent_h", "latent_w", "tokens"]

    profile = Profile({"batch": (1, 2, 16), "latent_h": (64, 128, 130), "latent_w": (64, 128, 128),
                       "tokens": (77, 77, 154)})
    shapes = spec.profile_shapes(profile)
    assert shapes["mid"] == ((1, 32, 16, 16), (2, 32, 32, 32), (16, 32, 33, 32))  # ceil(130 / 4) = 33
    assert shapes["encoder_hidden_states"] == ((1, 77, 64), (2, 77, 64), (16, 154, 64))
    with pytest.raises(ValueError, match="no size"):
        spec.profile_shapes(Profile({"batch": (1, 1, 1)}))
    with pytest.raises(ValueError, match="min <= opt <= max"):
        Profile({"batch": (2, 1, 4)})


@pytest.mark.parametrize("dtype", ["float32", "fp64", "int32", "FP16", ""])
def test_bad_dtype_names_are_refused(dtype):
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("x", dtype, ("batch",))


def test_other_bad_declarations_are_refused(tiny_model):
    for dims in (("height",), ("latent_h/0",), ("latent_h+1",), (0,), (2.0,)):
        with pytest.raises(ValueError):
            TensorSpec("x", "fp32", dims)
    with pytest.raises(ValueError, match="value_range"):
        TensorSpec("ids", "int64", ("batch",))
    x = TensorSpec("x", "fp32", ("batch",))
    with pytest.raises(ValueError, match="not unique"):
        ComponentSpec("c", (x,), (x,))
    with pytest.raises(ValueError, match="model_dtype"):
        specs.vae_decoder_spec(config(tiny_model, "vae")).sample_inputs(model_dtype="int64")
