"""Each denoiser's outstanding work, where every public model reads it: one small file per
denoiser in /dev/shm.

The public models route each request to the least loaded denoiser (backends/core/serving/routing.py).
What they sent themselves is only part of a denoiser's load: `easel` and `easel_stream` are
separate processes, and a request they sent long ago may be almost done. The denoiser knows the
rest: it writes its queued and running requests' remaining work (steps left x rows x pixels) here
after every step and every arrival, and the routers read it at each pick: a `Load`, the work in
row-steps and, once the denoiser has measured steps, in predicted seconds with the rates that
price a new request on it (engine/step_cost.py) and when it last measured one.

A file is named by the tritonserver process (the parent of every model's stub process, so one
server's models find each other and two servers on one host do not) and by the denoiser. It holds
the value twice: a reader that finds the two halves different read it mid-write and takes the
next value. Files of a server that is gone are removed when a denoiser starts. Mode 0600, opened
without following symlinks, as the server's other /dev/shm files.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from dataclasses import dataclass

from backends.core.engine.step_cost import StepCostModel
from backends.core.serving.shm_files import SHM_DIR, remove_orphans, server_file, unlink

PREFIX = "easel-load-"
_FIELDS = 6
_VALUE = struct.Struct(f"<{2 * _FIELDS}d")


@dataclass(frozen=True)
class Load:
    """A denoiser's outstanding work (queued and running, the steps left)."""

    work: float  # in 1024x1024 row-steps (GenerateParams.work)
    seconds: float | None = None  # predicted; None until the denoiser has measured a step
    row_step_s: float | None = None  # its measured seconds of one row-step
    dense: float = 1.0  # the share of a row-step that a reusing edit's mask does not shrink
    # time.monotonic() of its last measured step: CLOCK_MONOTONIC, one clock for every process of
    # the host, so the routers (other processes) can tell how old its costs are
    measured_at: float | None = None
    measured_steps: int = 0  # the steps its rate is the median of

    def price(self, work: float, token_work: float) -> float | None:
        """Predicted seconds of a new request of `work` row-steps (`token_work`: the same weighted
        by its share of block tokens computed) on this denoiser; None before it measured a step."""
        return StepCostModel(self.row_step_s, self.dense).seconds(work, token_work)

    def _values(self) -> tuple[float, ...]:
        nan = math.nan
        return (self.work, nan if self.seconds is None else self.seconds,
                nan if self.row_step_s is None else self.row_step_s, self.dense,
                nan if self.measured_at is None else self.measured_at, float(self.measured_steps))

    @classmethod
    def _from(cls, values: tuple[float, ...]) -> "Load":
        work, seconds, rate, dense, at, steps = values
        return cls(work, None if math.isnan(seconds) else seconds, None if math.isnan(rate) else rate, dense,
                   None if math.isnan(at) else at, int(steps))


def board_path(denoiser: str, folder: str = SHM_DIR, server_pid: int | None = None) -> str:
    return server_file(PREFIX, denoiser, folder, server_pid)


class LoadWriter:
    """A denoiser's side: publish(load) from any thread."""

    def __init__(self, denoiser: str, folder: str = SHM_DIR, server_pid: int | None = None):
        remove_orphans(folder, PREFIX)
        self.path = board_path(denoiser, folder, server_pid)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._lock = threading.Lock()
        self._last: Load | None = None
        self.publish(Load(0.0))

    def publish(self, load: Load) -> None:
        with self._lock:
            if load != self._last and self._fd >= 0:
                values = load._values()
                os.pwrite(self._fd, _VALUE.pack(*values, *values), 0)
                self._last = load

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        unlink(self.path)


class LoadReader:
    """A router's side: the Load each denoiser published, or None where it has not (yet)."""

    def __init__(self, folder: str = SHM_DIR, server_pid: int | None = None):
        self.folder, self.server_pid = folder, server_pid

    def __call__(self, denoiser: str) -> Load | None:
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
                half = _VALUE.size // 2
                if data[:half] == data[half:]:  # bytes, not floats: NaN (not measured yet) is no number
                    return Load._from(_VALUE.unpack(data)[:_FIELDS])
            return None
        finally:
            os.close(fd)
