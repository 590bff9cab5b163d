"""The adapter store: a folder of ControlNets and LoRAs, found by name through an index.

    <root>/controlnets/<name>/config.json + diffusion_pytorch_model.safetensors
    <root>/loras/<name>.safetensors      (diffusers/PEFT or kohya layout)

A request names adapters; a name is looked up in the index built by scanning the store, never
joined onto a path, so `../x` or `/etc/passwd` can only be "unknown". Entries whose files resolve
outside the store (symlinks) are left out of the index, and only safetensors are indexed:
pickle formats (.bin, .ckpt, .pt, .pth) are never opened.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from backends.core.request.params import InvalidInput

log = logging.getLogger(__name__)

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
CONTROLNET_DIR = "controlnets"
CONTROLNET_WEIGHTS = "diffusion_pytorch_model.safetensors"
LORA_DIR = "loras"
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


@dataclass(frozen=True)
class ControlNetEntry:
    name: str
    folder: Path
    weights: Path
    nbytes: int


@dataclass(frozen=True)
class LoraEntry:
    name: str
    path: Path
    nbytes: int


def check_name(field_name: str, name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidInput(field_name, f"{name!r} is not a valid adapter name "
                                       "(letters, digits, '_', '.', '-'; at most 128; no paths)")
    return name


def _inside(path: Path, root: Path) -> bool:
    resolved = path.resolve()
    return resolved == root or root in resolved.parents


class AdapterStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"adapter store {self.root} is not a folder")
        self.controlnets = self._scan_controlnets()
        self.loras = self._scan_loras()

    def _scan_controlnets(self) -> dict[str, ControlNetEntry]:
        index: dict[str, ControlNetEntry] = {}
        base = self.root / CONTROLNET_DIR
        if not base.is_dir():
            return index
        for folder in sorted(base.iterdir()):
            name = folder.name
            if not folder.is_dir() or not NAME_PATTERN.fullmatch(name):
                continue
            config, weights = folder / "config.json", folder / CONTROLNET_WEIGHTS
            if not (_inside(folder, self.root) and all(p.is_file() and _inside(p, self.root) for p in (config, weights))):
                pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
                log.warning("controlnet %r left out of the index: needs config.json and %s inside the store%s",
                            name, CONTROLNET_WEIGHTS, f" (pickle files are refused: {pickles})" if pickles else "")
                continue
            index[name] = ControlNetEntry(name, folder.resolve(), weights.resolve(), weights.stat().st_size)
        return index

    def _scan_loras(self) -> dict[str, LoraEntry]:
        index: dict[str, LoraEntry] = {}
        base = self.root / LORA_DIR
        if not base.is_dir():
            return index
        for path in sorted(base.iterdir()):
            if path.suffix in PICKLE_SUFFIXES:
                log.warning("lora file %s left out of the index: pickle files are refused", path.name)
                continue
            if path.suffix != ".safetensors" or not NAME_PATTERN.fullmatch(path.stem):
                continue
            if not (path.is_file() and _inside(path, self.root)):
                log.warning("lora %r left out of the index: not a file inside the store", path.stem)
                continue
            index[path.stem] = LoraEntry(path.stem, path.resolve(), path.stat().st_size)
        return index

    def lora(self, name: str, field_name: str = "loras") -> LoraEntry:
        check_name(field_name, name)
        try:
            return self.loras[name]
        except KeyError:
            raise InvalidInput(field_name, f"unknown LoRA {name!r}") from None

    def controlnet(self, name: str, field_name: str = "controlnets") -> ControlNetEntry:
        check_name(field_name, name)
        try:
            return self.controlnets[name]
        except KeyError:
            raise InvalidInput(field_name, f"unknown ControlNet {name!r}") from None
