"""LoRA merge in place reproduces diffusers' load_lora_weights + set_adapters + fuse_lora on the
UNet, for both file layouts and two LoRAs at once; restore gives the base weights bit for bit.
Tolerance: 1e-5 max abs on the UNet output (fp32, CPU): diffusers adds the LoRAs one after the
other, we add their fp32 sum once."""

from __future__ import annotations

import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from backends.core.adapters.store import AdapterStore
from backends.core.adapters.lora import LoraMerger, load_lora
from backends.core.request.params import InvalidInput
from export.tiny_adapters import TINY_LORAS

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def store(tiny_model):
    return AdapterStore(tiny_model / "adapters")


def unet_output(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, 8, 8, generator=g)
    cross = unet.config.cross_attention_dim
    cond = {"text_embeds": torch.randn(2, 32, generator=g), "time_ids": torch.randn(2, 6, generator=g)}
    with torch.no_grad():
        return unet(x, torch.tensor([700.0, 300.0]), encoder_hidden_states=torch.randn(2, 77, cross, generator=g),
                    added_cond_kwargs=cond).sample


def diffusers_fused(model, store, loras):
    pipe = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
    for name, _ in loras:
        pipe.load_lora_weights(str(store.lora(name).path), adapter_name=name)
    pipe.set_adapters([n for n, _ in loras], adapter_weights=[s for _, s in loras])
    pipe.fuse_lora(adapter_names=[n for n, _ in loras])
    return unet_output(pipe.unet)


@pytest.mark.parametrize("loras", [
    [("papercut", 1.0)], [("inkwash", 0.7)], [("papercut", 0.8), ("inkwash", 0.5)],
], ids=["peft-layout", "kohya-layout", "two"])
def test_merge_matches_diffusers_fuse_and_restores_exactly(tiny_model, store, loras):
    unet = StableDiffusionXLPipeline.from_pretrained(tiny_model, add_watermarker=False).unet
    base_state = {k: v.clone() for k, v in unet.state_dict().items()}
    base_out = unet_output(unet)
    merger = LoraMerger(unet)
    merger.merge([(load_lora(n, store.lora(n).path), s) for n, s in loras])
    merged_s = merger.seconds()
    assert merged_s > 0  # timed (wall time on a CPU)
    ours = unet_output(unet)
    assert (ours - base_out).abs().max() > 1e-3  # the LoRAs do something
    assert (ours - diffusers_fused(tiny_model, store, loras)).abs().max() <= TOLERANCE
    merger.restore()
    assert merger.seconds() > merged_s  # restoring is timed too
    assert all(torch.equal(v, base_state[k]) for k, v in unet.state_dict().items())


def test_merging_again_does_not_drift(tiny_model, store):
    unet = StableDiffusionXLPipeline.from_pretrained(tiny_model, add_watermarker=False).unet
    lora = load_lora("papercut", store.lora("papercut").path)
    merger = LoraMerger(unet)
    merger.merge([(lora, 1.0)])
    once = {k: v.clone() for k, v in unet.state_dict().items()}
    for _ in range(5):
        merger.merge([(lora, 0.3)])
        merger.merge([(lora, 1.0)])
    assert all(torch.equal(v, once[k]) for k, v in unet.state_dict().items())


def test_merging_in_small_chunks_gives_the_same_weights(tiny_model, store, monkeypatch):
    """The merge batches same-shaped layers into one product, in chunks bounded by DELTA_BYTES:
    one layer per chunk gives the same weights."""
    import backends.core.adapters.lora as lora_module

    unet = StableDiffusionXLPipeline.from_pretrained(tiny_model, add_watermarker=False).unet
    loras = [(load_lora(n, store.lora(n).path), s) for n, s in (("papercut", 0.8), ("inkwash", 0.5))]
    merger = LoraMerger(unet)
    merger.merge(loras)
    batched = {k: v.clone() for k, v in unet.state_dict().items()}
    monkeypatch.setattr(lora_module, "DELTA_BYTES", 1)
    merger.merge([])
    merger.merge(loras)
    assert all(torch.allclose(v, batched[k], rtol=0, atol=1e-6) for k, v in unet.state_dict().items())


def test_a_lora_that_does_not_fit_changes_nothing(tiny_model, alt_model, store):
    alt_unet = StableDiffusionXLPipeline.from_pretrained(alt_model, add_watermarker=False).unet
    before = {k: v.clone() for k, v in alt_unet.state_dict().items()}
    with pytest.raises(InvalidInput, match="loras: 'papercut': layer .* (does not exist|is \\()"):
        LoraMerger(alt_unet).merge([(load_lora("papercut", store.lora("papercut").path), 1.0)])
    assert all(torch.equal(v, before[k]) for k, v in alt_unet.state_dict().items())


def test_unreadable_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(InvalidInput, match="loras: 'bad' cannot be read as a LoRA"):
        load_lora("bad", bad)


def test_tiny_loras_cover_both_layouts():
    assert {layout for layout, _, _ in TINY_LORAS.values()} == {"peft", "kohya"}
