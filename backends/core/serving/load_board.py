"""Each denoiser's outstanding work, where every public model reads it: one small file per
denoiser in /dev/shm.

The public models route each request to the least loaded denoiser (backends/core/serving/routing.py).
What they sent themselves is only part of a denoiser's load: `easel` and `easel_stream` are
separate processes, and a request they sent long ago may be almost done. The denoiser knows the
rest: it writes its queued and running requests' remaining work (steps left x rows x pixels) here
after every step and every arrival, and the routers read it at each pick.

A file is named by the tritonserver process (the parent of every model's stub process, so one
server's models find each other and two servers on one host do not) and by the denoiser. It holds
the value twice: a reader that finds the two halves different read it mid-write and takes the
next value. Files of a server that is gone are removed when a denoiser starts. Mode 0600, opened
without following symlinks, as the server's other /dev/shm files.
"""

from __future__ import annotations

import os
import struct
import threading

from backends.core.serving.shm_files import SHM_DIR, remove_orphans, server_file, unlink

PREFIX = "easel-load-"
_VALUE = struct.Struct("<dd")


def board_path(denoiser: str, folder: str = SHM_DIR, server_pid: int | None = None) -> str:
    return server_file(PREFIX, denoiser, folder, server_pid)


class LoadWriter:
    """A denoiser's side: publish(work) from any thread."""

    def __init__(self, denoiser: str, folder: str = SHM_DIR, server_pid: int | None = None):
        remove_orphans(folder, PREFIX)
        self.path = board_path(denoiser, folder, server_pid)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._lock = threading.Lock()
        self._last: float | None = None
        self.publish(0.0)

    def publish(self, work: float) -> None:
        with self._lock:
            if work != self._last and self._fd >= 0:
                os.pwrite(self._fd, _VALUE.pack(work, work), 0)
                self._last = work

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        unlink(self.path)


class LoadReader:
    """A router's side: the work each denoiser published, or None where it has not (yet)."""

    def __init__(self, folder: str = SHM_DIR, server_pid: int | None = None):
        self.folder, self.server_pid = folder, server_pid

    def __call__(self, denoiser: str) -> float | None:
        # Opened at each read: a denoiser that restarts writes a new file in place of the old.
        try:
            fd = os.open(board_path(denoiser, self.folder, self.server_pid), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            for _ in range(2):
                data = os.pread(fd, _VALUE.size, 0)
                if len(data) != _VALUE.size:
                    return None
                first, second = _VALUE.unpack(data)
                if first == second:
                    return first
            return None
        finally:
            os.close(fd)
