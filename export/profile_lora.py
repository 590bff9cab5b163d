"""`easel profile-lora`: per (base model, LoRA), how many steps a request may run before the
LoRA has to be merged (the bound K of bounded asynchronous loading).

K is the first step at which the latents with and without the LoRA stop being alike: cosine
similarity under a threshold (0.99 by default), measured over a few seeds at one size, and the
smallest over the seeds. Early steps lay out the image and a LoRA barely changes them, which is
what lets the request start before its LoRA has loaded. The result goes into the repository
(`<denoiser>/1/lora_bounds.json`), where the denoiser reads it; LoRAs never profiled use the
deployment's `--lora-bound-steps`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from backends.core.adapters.lora import BOUNDS_FILE

log = logging.getLogger(__name__)


def latents_per_step(engine, encoder, params, loras) -> list[torch.Tensor]:
    from backends.core.engine.requests import DenoiseJob

    embeds, pooled = encoder.encode(params)
    state = engine.start(DenoiseJob("profile", params, embeds, pooled, loras=loras))
    out = []
    while state.index < len(state.timesteps):
        engine.step([state])
        out.append(state.latents.float().flatten().cpu())
    return out


def first_divergent_step(with_lora: list[torch.Tensor], without: list[torch.Tensor], threshold: float) -> int:
    for step, (a, b) in enumerate(zip(with_lora, without)):
        if torch.nn.functional.cosine_similarity(a, b, dim=0).item() < threshold:
            return step
    return len(with_lora)


def profile_loras(repo: str | Path, names: list[str] | None = None, steps: int = 30, size: int | None = None,
                  seeds: int = 2, threshold: float = 0.99) -> dict[str, int]:
    from backends.core.adapters.store import AdapterStore
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.adapters.lora import load_lora
    from backends.core.engine.config import DenoiserConfig
    from backends.core.request.params import LoraParams, validate
    from backends.core.runtime.placement import Placement
    from backends.core.stages.text_encoding import PromptEncoder
    from export.triton_config import read_parameters

    repo = Path(repo)
    denoiser = next(p.parent for p in sorted(repo.glob("denoiser*/config.pbtxt")) if (p.parent / "1" / "unet").is_dir())
    params = read_parameters(denoiser / "config.pbtxt")
    if "adapters" not in params:
        raise ValueError(f"{denoiser}: this repository was exported without --adapters")
    device = "cuda:0" if "KIND_GPU" in (denoiser / "config.pbtxt").read_text() else "cpu"
    placement = Placement(device, params.get("dtype", "fp32"))
    store = AdapterStore(repo / params["adapters"])
    limits = DenoiserConfig.from_json(params["denoiser"]).limits
    engine = TorchDenoiser(denoiser / "1", placement)
    encoder = PromptEncoder(repo / "text_encoder" / "1", placement, store)
    size = size or limits.default_width

    bounds = {}
    for name in names or sorted(store.loras):
        lora = ((load_lora(name, store.lora(name).path), 1.0),)
        ks = []
        for seed in range(seeds):
            p = validate({"prompt": "a photo of a city street at dusk", "seed": seed, "steps": steps,
                          "width": size, "height": size}, limits)
            # Both runs get the LoRA's text-encoder layers (a request has them from the start):
            # only the UNet part is what lands late.
            p = dataclasses.replace(p, loras=(LoraParams(name, 1.0),))
            ks.append(first_divergent_step(latents_per_step(engine, encoder, p, lora),
                                           latents_per_step(engine, encoder, p, ()), threshold))
        bounds[name] = min(ks)
        log.info("%s: bound %d of %d steps (seeds: %s)", name, bounds[name], steps, ks)

    path = denoiser / "1" / BOUNDS_FILE
    existing = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**existing, **bounds}, indent=2, sort_keys=True))
    return bounds
