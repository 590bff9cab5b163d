"""`easel profile-template` measures each transformer block with and without a template's
recording and writes the profile into every denoiser of a repository, where the denoiser reads it
(runtime/cache_plan.py)."""

from __future__ import annotations

import dataclasses

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.runtime.cache_plan import BlockProfile
from backends.core.runtime.placement import Placement
from export.cli import main
from export.profile_template import RATIOS
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
