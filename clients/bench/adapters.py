"""The adapters `easel bench` serves at SDXL size: random LoRAs of a chosen size in the
diffusers/PEFT layout, random control images, and a way to read LoRA files cold."""

from __future__ import annotations

import io
import logging
import os
import re
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("easel.bench")

# The UNet Linear layers a LoRA targets (attention projections and feed-forward), as SDXL LoRAs do.
TARGETS = re.compile(r"attn[12]\.(to_q|to_k|to_v|to_out\.0)$|ff\.net\.(0\.proj|2)$")


def lora_targets(unet_dir: Path) -> list[tuple[str, int, int]]:
    """(module, in_features, out_features) of every targeted Linear, read from a UNet built on
    the meta device from its config: shapes only, none of the gigabytes of weights."""
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_dir))
    return [(name, m.in_features, m.out_features) for name, m in unet.named_modules()
            if isinstance(m, torch.nn.Linear) and TARGETS.search(name)]


def rank_for(targets: list[tuple[str, int, int]], mib: float) -> int:
    """The uniform rank whose fp16 A and B matrices come closest to `mib` MiB."""
    per_rank = 2 * sum(i + o for _, i, o in targets)  # bytes: fp16 A [r, in] + B [out, r]
    return max(1, round(mib * 2**20 / per_rank))


def write_random_lora(path: Path, targets: list[tuple[str, int, int]], rank: int, seed: int, std: float,
                      device: str) -> None:
    """A random UNet LoRA in the diffusers/PEFT layout export/tiny_adapters.py writes for
    `papercut` (`unet.<module>.lora_A.weight` [r, in], `.lora_B.weight` [out, r]; no alpha, so
    diffusers and Easel both scale by 1). Drawn on `device` (seconds on a GPU for ~10^8 values),
    seeded; B is non-zero (unlike a fresh LoRA) so the merge changes the weights."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator(device).manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator, device=device) * std).to(torch.float16).cpu()

    state = {}
    for module, fan_in, fan_out in targets:
        state[f"unet.{module}.lora_A.weight"] = draw(rank, fan_in)
        state[f"unet.{module}.lora_B.weight"] = draw(fan_out, rank)
    partial = path.with_suffix(".partial")  # not indexed by the store (.safetensors only) until complete
    save_file(state, str(partial))
    # Written pages are dirty and DONTNEED leaves dirty pages in the cache: flush them now so
    # that dropping them before each request really does drop them.
    with open(partial, "rb") as f:
        os.fsync(f.fileno())
    partial.rename(path)


def write_loras(store: Path, unet_dir: Path, sizes_mib: list[float], std: float, device: str) -> list[dict]:
    """One LoRA per requested size in `<store>/loras/`, named by rank and seed (reused when present:
    same name, same bytes)."""
    targets = lora_targets(unet_dir)
    folder = store / "loras"
    folder.mkdir(parents=True, exist_ok=True)
    loras = []
    for index, mib in enumerate(sizes_mib):
        rank, seed = rank_for(targets, mib), 1000 + index
        path = folder / f"random_r{rank}_s{seed}.safetensors"
        start = time.perf_counter()
        if not path.exists():
            write_random_lora(path, targets, rank, seed, std, device)
            log.info("wrote %s in %.1fs", path.name, time.perf_counter() - start)
        nbytes = path.stat().st_size
        loras.append({"name": path.stem, "path": str(path), "rank": rank, "layers": len(targets),
                      "bytes": nbytes, "mib": nbytes / 2**20})
        log.info("LoRA %s: rank %d on %d Linear layers, %d bytes (%.1f MiB; asked %.1f MiB)",
                 path.stem, rank, len(targets), nbytes, nbytes / 2**20, mib)
    return loras


def drop_cache(paths: list[str]) -> None:
    """Evict the files' pages from the OS page cache, so the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def control_png(size: int, seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()
