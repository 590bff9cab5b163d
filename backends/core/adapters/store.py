"""The adapter store: a folder of ControlNets and LoRAs, found by name through an index.

    <root>/controlnets/<name>/config.json + diffusion_pytorch_model.safetensors
    <root>/loras/<name>.safetensors      (diffusers/PEFT or kohya layout)

A request names adapters; a name is looked up in the index built by scanning the store, never
joined onto a path, so `../x` or `/etc/passwd` can only be "unknown". Entries whose files resolve
outside the store (symlinks) are left out of the index, and only safetensors are indexed:
pickle formats (.bin, .ckpt, .pt, .pth) are never opened.

The index is made at start, but the files can change afterwards (a LoRA swapped for a symlink
to /etc/passwd, a folder renamed): so a file is never opened by its path. `StoreFile.open()`
walks from the store's root one component at a time with O_NOFOLLOW (openat), checks that the
root is still the folder indexed at start and that the file is a regular file, and readers
read from that descriptor. A symlink anywhere on the way, or a file that left, is "not in the
store" at the moment of reading, whatever happened since the scan.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from backends.core.request.adapter_inputs import NAME_PATTERN, check_name
from backends.core.request.params import UnknownAdapter

log = logging.getLogger(__name__)

CONTROLNET_DIR = "controlnets"
CONTROLNET_WEIGHTS = "diffusion_pytorch_model.safetensors"
LORA_DIR = "loras"
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in a file's place must not hang the reader (it is refused by fstat next).
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class NotInStore(UnknownAdapter):
    """An indexed adapter's file is no longer a regular file inside the store (moved, replaced
    by a symlink or something else since the store was scanned). Says the adapter's name only."""


@dataclass(frozen=True)
class StoreFile:
    """One file of the store, named by its components below the root (picklable: the LoRA loader
    processes open it themselves). `root_id` is the root folder's (st_dev, st_ino) at the scan."""

    root: str
    root_id: tuple[int, int]
    parts: tuple[str, ...]
    what: str  # the adapter, as errors name it ("LoRA 'papercut'"), never a path

    @contextlib.contextmanager
    def open(self) -> Iterator[int]:
        """A descriptor of the file, opened without following any symlink below `/`."""
        fds: list[int] = []
        try:
            fd = os.open("/", _DIR_FLAGS)
            fds.append(fd)
            root_parts = [p for p in Path(self.root).parts[1:]]
            for i, part in enumerate(root_parts + list(self.parts)):
                last = i == len(root_parts) + len(self.parts) - 1
                fd = os.open(part, _FILE_FLAGS if last else _DIR_FLAGS, dir_fd=fd)
                fds.append(fd)
                if i == len(root_parts) - 1:
                    info = os.fstat(fd)
                    if (info.st_dev, info.st_ino) != self.root_id:
                        raise NotInStore(self.parts[0], f"{self.what}: the adapter store's folder was replaced")
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotInStore(self.parts[0], f"{self.what} is not a regular file inside the adapter store")
        except OSError as exc:  # ELOOP: a symlink on the way; ENOENT/ENOTDIR: moved away
            for fd in fds:
                os.close(fd)
            raise NotInStore(self.parts[0], f"{self.what} is no longer a file inside the adapter store "
                                         f"({os.strerror(exc.errno) if exc.errno else type(exc).__name__})") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        for fd in fds[:-1]:
            os.close(fd)
        try:
            yield fds[-1]
        finally:
            os.close(fds[-1])

    @contextlib.contextmanager
    def path(self) -> Iterator[str]:
        """A path naming the very file `open()` opened (/proc/self/fd/N, valid while the block
        runs), for readers that memory-map by path (safetensors): renaming or swapping the store's
        path after the open changes nothing about which file they read."""
        with self.open() as fd:
            yield f"/proc/self/fd/{fd}"

    def read_bytes(self, limit: int = 1 << 20) -> bytes:
        """A small file (a ControlNet's config.json) whole, refusing one over `limit` bytes."""
        with self.open() as fd:
            size = os.fstat(fd).st_size
            if size > limit:
                raise NotInStore(self.parts[0], f"{self.what} is {size} bytes, over the limit of {limit}")
            chunks, left = [], size
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)

    def stamp(self) -> tuple[int, int, int]:
        """(inode, mtime, size) of the file now: whether a cached read is still that file."""
        with self.open() as fd:
            info = os.fstat(fd)
            return info.st_ino, info.st_mtime_ns, info.st_size


@dataclass(frozen=True)
class ControlNetEntry:
    name: str
    folder: Path  # for display and for tests' references only: the server reads `config_file`, `weights_file`
    weights: Path
    nbytes: int
    config_file: StoreFile | None = None
    weights_file: StoreFile | None = None


@dataclass(frozen=True)
class LoraEntry:
    name: str
    path: Path  # for display and for tests' references only: the server reads `file`
    nbytes: int
    file: StoreFile | None = None


def _inside(path: Path, root: Path) -> bool:
    resolved = path.resolve()
    return resolved == root or root in resolved.parents


class AdapterStore:
    def __init__(self, root: str | Path):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ValueError(f"adapter store {self.root} is not a folder")
        info = os.stat(self.root)
        self.root_id = (info.st_dev, info.st_ino)
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
            what = f"ControlNet {name!r}"
            index[name] = ControlNetEntry(name, folder.resolve(), weights.resolve(), weights.stat().st_size,
                                          self._file((CONTROLNET_DIR, name, "config.json"), what),
                                          self._file((CONTROLNET_DIR, name, CONTROLNET_WEIGHTS), what))
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
            index[path.stem] = LoraEntry(path.stem, path.resolve(), path.stat().st_size,
                                         self._file((LORA_DIR, path.name), f"LoRA {path.stem!r}"))
        return index

    def _file(self, parts: tuple[str, ...], what: str) -> StoreFile:
        return StoreFile(str(self.root), self.root_id, parts, what)

    def lora(self, name: str, field_name: str = "loras") -> LoraEntry:
        check_name(field_name, name)
        try:
            return self.loras[name]
        except KeyError:
            raise UnknownAdapter(field_name, f"unknown LoRA {name!r}") from None

    def controlnet(self, name: str, field_name: str = "controlnets") -> ControlNetEntry:
        check_name(field_name, name)
        try:
            return self.controlnets[name]
        except KeyError:
            raise UnknownAdapter(field_name, f"unknown ControlNet {name!r}") from None
