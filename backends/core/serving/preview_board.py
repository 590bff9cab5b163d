"""Preview latents from a denoiser to the public model that streams them (`easel_stream`), through
one small file per request in /dev/shm instead of BLS responses.

Why not BLS: Triton 2.51's Python backend loads a BLS response's tensors into numpy arrays
without holding the GIL (a decoupled call's later responses on the stub's monitor thread). Python
code running at that moment in the caller's stub races it on the allocator; under a flood of
refused requests beside streams that corrupted `easel_stream`'s heap within minutes
(bench/results/2026-11-24-cpu/notes.md; fixed upstream in python_backend r25.02). So a
denoiser's step responses carry no tensor at all: a step is an empty response, and a preview due
at that step is written here just before it.

The caller creates the file (empty, mode 0600) before its request and removes it afterwards. The
denoiser only writes into a file that exists, so a request sent to a denoiser directly cannot
leave files behind. A write is a seqlock: the counter at the start is odd while the latents are
being written, and a reader that finds it odd, or changed by the end of its read, takes no
preview that step (the next due step brings another). Files of a server that is gone are removed
when a public model starts. Opened without following symlinks, as the server's other /dev/shm
files.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct

import numpy as np

from backends.core.serving.shm_files import SHM_DIR, remove_orphans, server_file, unlink

PREFIX = "easel-preview-"
# A key names a file: letters, digits, '_' and '-' only (the public models send uuid4 hex).
MAX_KEY_LENGTH = 64
KEY = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_KEY_LENGTH}}}")
_COUNTER = struct.Struct("<Q")
_HEADER = struct.Struct("<5I")  # step, then the latents' 4 dimensions
_DATA_AT = _COUNTER.size + _HEADER.size
# Far above any latents a request may ask for (Limits bound them): a corrupt header reads nothing.
MAX_VALUES = 1 << 26


def valid_key(key: str) -> bool:
    return KEY.fullmatch(key) is not None


def preview_path(key: str, folder: str = SHM_DIR, server_pid: int | None = None) -> str:
    """The request's file, named by a digest of its key: the key also cancels the request
    (contract.DENOISER), and /dev/shm's names are there for any local user to list."""
    if not valid_key(key):
        raise ValueError(f"a preview key is 1 to {MAX_KEY_LENGTH} letters, digits, '_' or '-', not {key!r}")
    return server_file(PREFIX, hashlib.sha256(key.encode()).hexdigest()[:32], folder, server_pid)


class PreviewFile:
    """The caller's side, for one request: creates the file, reads the latest preview, removes it."""

    def __init__(self, key: str, folder: str = SHM_DIR, server_pid: int | None = None):
        self.path = preview_path(key, folder, server_pid)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)

    def read(self) -> tuple[int, np.ndarray] | None:
        """(step, latents) of the last preview written, or None: none yet, or one being written."""
        if self._fd < 0:
            return None
        before = os.pread(self._fd, _COUNTER.size, 0)
        if len(before) != _COUNTER.size or _COUNTER.unpack(before)[0] % 2 or not any(before):
            return None  # nothing written yet, or a write under way
        header = os.pread(self._fd, _HEADER.size, _COUNTER.size)
        if len(header) != _HEADER.size:
            return None
        step, *shape = _HEADER.unpack(header)
        count = math.prod(shape)
        if not 0 < count <= MAX_VALUES:
            return None
        data = os.pread(self._fd, count * 4, _DATA_AT)
        if len(data) != count * 4 or os.pread(self._fd, _COUNTER.size, 0) != before:
            return None
        return step, np.frombuffer(data, dtype="<f4").reshape(shape).copy()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        unlink(self.path)


def write_preview(key: str, step: int, latents: np.ndarray, folder: str = SHM_DIR,
                  server_pid: int | None = None) -> bool:
    """The denoiser's side: the request's latents at `step` into its caller's file. False where
    the caller made none (a request sent to the denoiser directly)."""
    if latents.ndim != 4:
        raise ValueError(f"preview latents are [rows, channels, height, width], not {latents.shape}")
    try:
        fd = os.open(preview_path(key, folder, server_pid), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        raw = os.pread(fd, _COUNTER.size, 0)
        count = _COUNTER.unpack(raw)[0] if len(raw) == _COUNTER.size else 0
        count += count % 2  # (a write that died half-way left it odd)
        os.pwrite(fd, _COUNTER.pack(count + 1), 0)
        body = _HEADER.pack(step, *latents.shape) + np.ascontiguousarray(latents, dtype="<f4").tobytes()
        os.pwrite(fd, body, _COUNTER.size)
        os.pwrite(fd, _COUNTER.pack(count + 2), 0)
    finally:
        os.close(fd)
    return True


def remove_orphan_previews(folder: str = SHM_DIR) -> None:
    remove_orphans(folder, PREFIX)
