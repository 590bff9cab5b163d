"""What the benchmarks share: their command line and the models they run, written once under
their --work folder (no model hub here: the weights are random, the shapes real)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path


def bench_parser(doc: str, size: int, steps: int, work_help: str = "folder for the models and repositories"
                 ) -> argparse.ArgumentParser:
    """--work, --out, --size, --steps; the caller adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help=work_help)
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--size", type=int, default=size)
    p.add_argument("--steps", type=int, default=steps)
    return p


def write_json(path: Path, report: dict) -> None:
    """A benchmark's JSON report, its folder made as needed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    logging.getLogger("easel.bench").info("wrote %s", path)


def run_key(variants: dict, name: str) -> str:
    """The report key of a variant's run: its name, or "name #2", "name #3"... for one named again
    (alternated with another, against drift), so that each run is kept."""
    runs = sum(key.split(" #")[0] == name for key in variants)
    return f"{name} #{runs + 1}" if runs else name


def start_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")


def random_sdxl(work: Path, device: str = "cuda") -> Path:
    """SDXL base's architecture with random fp16 weights, drawn on `device` (seconds on a GPU, a
    minute on a CPU; the draws differ between the two)."""
    from export.tiny import write_tiny_pipeline

    model = work / "sdxl-random"
    if not (model / "model_index.json").exists():
        write_tiny_pipeline(model, seed=0, variant="sdxl", device=device, dtype="fp16")
    return model


def rel_rms(got, want) -> float:
    """RMS of the difference against the RMS of `want` (tensors, compared in fp32)."""
    got, want = got.float(), want.float()
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def random_sdxl_denoiser(work: Path) -> Path:
    """The version folder of a denoiser (fp16, cuda:0) exported from random_sdxl: the UNet halves
    the in-process micro-benchmarks load."""
    from export.repository import ExportOptions, export_repository

    repo = work / "repo"
    if not (repo / "denoiser_gpu0").exists():
        export_repository(random_sdxl(work), repo, ExportOptions(device="cuda", dtype="fp16", gpus=(0,)))
    return repo / "denoiser_gpu0" / "1"


def random_sdxl_fp8_calibration(work: Path, size: int, pipe=None) -> Path:
    """The calibration data `easel export --fp8` writes, for random_sdxl(work) at `size` px;
    written once. `pipe`: that model's pipeline on the GPU, if the caller has it loaded already."""
    import torch
    from diffusers import StableDiffusionXLPipeline

    from backends.core.runtime.fp8 import CALIBRATION_FILE, write_calibration

    path = work / f"{size}px_{CALIBRATION_FILE}"
    if not path.exists():
        if pipe is None:
            pipe = StableDiffusionXLPipeline.from_pretrained(random_sdxl(work), dtype=torch.float16).to("cuda")
        write_calibration(pipe, path, size)
    return path


def tiny(work: Path, adapters: bool = False) -> Path:
    """The tiny test pipeline, with its tiny adapter store in `<model>/adapters` if asked."""
    from export.tiny import write_tiny_pipeline
    from export.tiny_adapters import write_tiny_adapter_store

    model = work / "tiny"
    if not (model / "model_index.json").exists():
        write_tiny_pipeline(model, seed=0)
    if adapters and not (model / "adapters").exists():
        write_tiny_adapter_store(model)
    return model


SDXL_CONTROLNET_EMBEDDING = (16, 32, 96, 256)  # SDXL ControlNets' control image embedding (8x down)


def write_controlnets(model: Path, store: Path, names, device: str = "cuda", dtype: str = "fp16",
                      embedding_channels=SDXL_CONTROLNET_EMBEDDING) -> list[Path]:
    """ControlNets built from `model`'s UNet (random zero convolutions) in `<store>/controlnets/`,
    seeded by position in `names`; written once (reused when the last one is present)."""
    import torch
    from diffusers import UNet2DConditionModel

    from export.tiny_adapters import write_tiny_controlnets

    folders = [store / "controlnets" / name for name in names]
    if names and not folders[-1].exists():
        torch_dtype = torch.float16 if dtype == "fp16" else torch.float32
        unet = UNet2DConditionModel.from_pretrained(model / "unet", dtype=torch_dtype).to(device)
        write_tiny_controlnets(store, unet, names=tuple(names), embedding_channels=embedding_channels)
        del unet
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return folders
