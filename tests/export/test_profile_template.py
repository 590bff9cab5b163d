"""`easel profile-template` measures each transformer block with and without a template's
recording and writes the profile into every denoiser of a repository, where the denoiser reads it
(runtime/cache_plan.py)."""

from __future__ import annotations

import dataclasses

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.runtime.cache_plan import BlockProfile
from backends.core.runtime.placement import Placement
from export.cli import main
from export.profile_template import RATIOS, conv_record_bytes, summary
from export.repository import ExportOptions, export_repository


def test_profile_template_writes_every_denoisers_profile(tiny_model, tmp_path):
    repo = tmp_path / "repo"
    export_repository(tiny_model, repo, dataclasses.replace(ExportOptions(), cpu_denoisers=2))
    assert main(["profile-template", "--repo", str(repo), "--size", "64", "--iters", "2"]) == 0
    profiles = [BlockProfile.read(repo / name / "1") for name in ("denoiser_cpu0", "denoiser_cpu1")]
    assert profiles[0] == profiles[1] and profiles[0].size == 64 and profiles[0].ratios == RATIOS
    profile = profiles[0]
    assert len(profile.blocks) == len({b.index for b in profile.blocks}) > 0  # each block once
    assert all(b.without_s > 0 and all(t > 0 for t in b.with_s) and b.load_s == 0.0 for b in profile.blocks)
    engine = TorchDenoiser(repo / "denoiser_cpu0" / "1", Placement())
    assert engine.workflows["inpaint"].model.block_profile == profile


def test_the_profile_summary_gives_a_steps_bytes_and_the_links_rate():
    blocks = [{"record_bytes": 4_000_000, "load_ms": 0.1, "without_ms": 0.5, "with_ms": {str(r): r for r in RATIOS}}] * 2
    line = summary(blocks, rows=2)
    assert "2 transformer blocks, 2 rows: recorded outputs 8.0 MB a step, loaded in 0.20 ms, 40.0 GB/s" in line
    assert "whole 1.00 ms" in line and "0.2: 0.40" in line
    assert "GB/s" not in summary([dict(blocks[0], load_ms=0.0)], rows=2)  # on a CPU loads cost nothing


def test_a_recordings_resnet_and_upsampler_parts_are_counted(tiny_model):
    """What every streamed step loads under conv_subsets, counted as the profile prices it: the
    bytes of one row of a recording's parts outside the transformer blocks, as an eager recording
    step keeps them."""
    import torch
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.conv_subsets import is_block_key
    from backends.core.runtime.token_subsets import RECORD, TemplateActivations, TokenLayout, TokenRow
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.unet_split import split_unet

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet").eval()
    encoder, decoder = split_unet(unet)
    nbytes = conv_record_bytes(unet, 128)  # (before the blocks' classes are swapped)
    runtime = EagerUNetRuntime(unet, encoder, decoder, conv_subsets=True)
    record = TemplateActivations(1)
    cfg = unet.config
    pooled = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    with torch.inference_mode(), runtime.token_layout(TokenLayout((TokenRow(RECORD, record, 0, 0),))):
        text = torch.zeros(1, 77, cfg.cross_attention_dim)
        emb, mid, skips = encoder(torch.zeros(1, cfg.in_channels, 16, 16), torch.tensor([500.0]), text,
                                  torch.zeros(1, pooled), torch.tensor([[128.0, 128, 0, 0, 128, 128]]))
        decoder(emb, mid, skips, text)
    kept = sum(t.numel() * t.element_size() for (_, key), t in record.outputs.items() if not is_block_key(key))
    assert nbytes == kept > 0
