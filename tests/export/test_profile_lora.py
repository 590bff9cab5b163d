"""`easel profile-lora` measures each LoRA's bound K and stores it where the denoiser reads it."""

from __future__ import annotations

import dataclasses
import json

import torch

from backends.core.adapters.lora import BOUNDS_FILE
from export.cli import main
from export.profile_lora import first_divergent_step
from export.repository import ExportOptions, export_repository
from export.tiny_adapters import TINY_LORAS


def test_first_divergent_step():
    same = [torch.ones(4)] * 5
    drift = [torch.ones(4), torch.ones(4), torch.tensor([1.0, 1.0, 1.0, -1.0]), torch.ones(4), torch.ones(4)]
    assert first_divergent_step(same, same, 0.99) == 5  # never diverges: may join at the very end
    assert first_divergent_step(drift, same, 0.99) == 2


def test_profile_lora_writes_bounds(tiny_model, tmp_path):
    repo = tmp_path / "repo"
    export_repository(tiny_model, repo, dataclasses.replace(ExportOptions(), adapters=str(tiny_model / "adapters")))
    assert main(["profile-lora", "--repo", str(repo), "--steps", "6", "--size", "64", "--seeds", "1"]) == 0
    bounds = json.loads((repo / "denoiser" / "1" / BOUNDS_FILE).read_text())
    assert set(bounds) == set(TINY_LORAS) and all(0 <= k <= 6 for k in bounds.values())
    # A threshold no latent meets says "merge before step 0".
    assert main(["profile-lora", "--repo", str(repo), "--loras", "papercut", "--steps", "4", "--size", "64",
                 "--seeds", "1", "--threshold", "1.5"]) == 0
    bounds = json.loads((repo / "denoiser" / "1" / BOUNDS_FILE).read_text())
    assert bounds["papercut"] == 0 and "inkwash" in bounds
