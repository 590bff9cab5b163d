"""A LoRA's text-encoder layers in the prompt encoder reproduce diffusers' load_lora_weights +
set_adapters + encode_prompt (unfused, both CLIP encoders, CPU fp32; measured: equal bit for bit,
tolerance 1e-5), for the request only: afterwards the encoders are the base ones bit for bit."""

from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline
from safetensors.torch import load_file, save_file

from backends.core.adapters.store import AdapterStore
from backends.core.adapters.lora import load_lora
from backends.core.request.params import InvalidInput, Limits, LoraParams, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository
from export.tiny_adapters import TEXT_ENCODER_LORAS

TOLERANCE = 1e-5


def _derived_loras(path) -> dict[str, dict]:
    """Files made from charcoal's text-encoder part: PEFT layout (no alphas; paths as diffusers
    saves them from transformers 5's encoders), kohya with alphas that differ per layer, a layer
    that does not fit, a layer the encoder does not have."""
    peft = {}
    for te, layers in load_lora("charcoal", path).text_encoders.items():
        for module, layer in layers.items():
            peft.update({f"{te}.{module}.lora_A.weight": layer.down, f"{te}.{module}.lora_B.weight": layer.up})
    text = {k: v for k, v in load_file(path).items() if k.startswith("lora_te")}
    alpha_keys = sorted(k for k in text if k.endswith(".alpha"))
    alphas = {**text, **{k: torch.tensor(8.0) for k in alpha_keys[::3]}}
    q = "lora_te2_text_model_encoder_layers_0_self_attn_q_proj"  # the second encoder: the first one's hooks
    misfit = {**text, f"{q}.lora_down.weight": torch.ones(4, 31)}  # are in place when this fails
    absent = {**text, **{k.replace("layers_0", "layers_7"): v for k, v in text.items() if k.startswith(q)}}
    return {"charcoal_peft": peft, "charcoal_alphas": alphas, "misfit": misfit, "absent": absent}


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("text_lora")
    repo = export_repository(tiny_model, tmp / "repo", ExportOptions())
    shutil.copytree(tiny_model / "adapters" / "loras", tmp / "store" / "loras")
    loras = tmp / "store" / "loras"
    for name, state in _derived_loras(loras / "charcoal.safetensors").items():
        save_file({k: v.clone().contiguous() for k, v in state.items()}, str(loras / f"{name}.safetensors"))
    (loras / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    store = AdapterStore(tmp / "store")
    return repo, store, PromptEncoder(repo / "text_encoder" / "1", Placement(), store)


def request(loras=()):  # an explicit negative prompt: its encoding gets the LoRAs too
    params = validate({"prompt": "a fox in snow", "negative_prompt": "blurry", "seed": 1}, Limits())
    return dataclasses.replace(params, loras=tuple(LoraParams(n, s) for n, s in loras))


def diffusers_embeds(model, store, loras):
    pipe = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
    for name, _ in loras:
        pipe.load_lora_weights(str(store.lora(name).path), adapter_name=name)
    pipe.set_adapters([n for n, _ in loras], adapter_weights=[s for _, s in loras])
    with torch.no_grad():
        embeds, neg, pooled, neg_pooled = pipe.encode_prompt("a fox in snow", negative_prompt="blurry")
    return torch.cat([neg, embeds]).numpy(), torch.cat([neg_pooled, pooled]).numpy()


def snapshot(encoder):
    return [{k: v.clone() for k, v in e.state_dict().items()} for e in encoder.encoders]


def assert_base(encoder, base):
    assert all(torch.equal(v, b[k]) for e, b in zip(encoder.encoders, base) for k, v in e.state_dict().items())
    assert not any(m._forward_hooks for e in encoder.encoders for m in e.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("loras", [
    [("charcoal", 0.7)], [("charcoal", 0.7), ("papercut", 1.3)], [("charcoal_peft", -0.6)],
    [("charcoal_alphas", 1.0)],
], ids=["kohya", "with-unet-only-lora", "peft-layout", "kohya-alphas-differ"])
def test_text_encoder_loras_match_diffusers(tiny_model, setup, loras):
    _, store, encoder = setup
    base = snapshot(encoder)
    plain = encoder.encode(request())
    ours = encoder.encode(request(loras))
    ref = diffusers_embeds(tiny_model, store, loras)
    for a, b, p in zip(ours, ref, plain):
        assert np.abs(a - b).max() <= TOLERANCE
        assert np.abs(a - p).max() > 1e-2  # the text-encoder layers do something
    assert_base(encoder, base)
    assert all(np.array_equal(a, b) for a, b in zip(encoder.encode(request()), plain))


def test_loras_without_text_layers_change_nothing(setup):
    _, _, encoder = setup
    plain = encoder.encode(request())
    assert all(np.array_equal(a, b) for a, b in zip(encoder.encode(request([("papercut", 1.0)])), plain))


def test_text_parts_are_read_once_and_again_when_the_file_changes(setup):
    _, store, encoder = setup
    encoder.encode(request([("charcoal", 1.0)]))
    reads = encoder.loras.reads
    encoder.encode(request([("charcoal", 0.5)]))
    assert encoder.loras.reads == reads
    path = store.lora("charcoal").path
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    encoder.encode(request([("charcoal", 0.5)]))
    assert encoder.loras.reads == reads + 1


def test_reading_only_the_text_part(setup):
    _, store, _ = setup
    full = load_lora("charcoal", store.lora("charcoal").path)
    text = load_lora("charcoal", store.lora("charcoal").path, text_encoders_only=True)
    assert full.unet and not text.unet and set(text.text_encoders) == {"text_encoder", "text_encoder_2"}
    for te, layers in full.text_encoders.items():
        assert layers.keys() == text.text_encoders[te].keys()
        assert all(torch.equal(a.down, text.text_encoders[te][m].down) and a.scale == text.text_encoders[te][m].scale
                   for m, a in layers.items())
    assert 0 < text.nbytes < full.nbytes
    unet_only = load_lora("papercut", store.lora("papercut").path, text_encoders_only=True)
    assert unet_only.text_encoders == {} and unet_only.unet == {}  # no text part: not an error
    assert set(TEXT_ENCODER_LORAS) == {"charcoal"}


@pytest.mark.parametrize("loras, expected", [
    ([("nope", 1.0)], "loras: unknown LoRA 'nope'"),
    ([("bad", 1.0)], "loras: 'bad' cannot be read as a LoRA"),
    ([("charcoal", 1.0), ("misfit", 1.0)],
     "loras: 'misfit': layer text_model.encoder.layers.0.self_attn.q_proj is (32, 31), the base model's is (32, 32)"),
    ([("absent", 1.0)],
     "loras: 'absent': layer text_model.encoder.layers.7.self_attn.q_proj does not exist in the base model"),
], ids=["unknown", "unreadable", "misfit", "absent"])
def test_bad_loras_fail_and_leave_the_encoders_alone(setup, loras, expected):
    _, _, encoder = setup
    base = snapshot(encoder)
    with pytest.raises(InvalidInput) as err:
        encoder.encode(request(loras))
    assert expected in str(err.value)
    assert_base(encoder, base)


def test_no_adapter_store(setup):
    repo, _, _ = setup
    with pytest.raises(InvalidInput, match="loras: this deployment has no adapter store"):
        PromptEncoder(repo / "text_encoder" / "1", Placement()).encode(request([("charcoal", 1.0)]))
