"""Which denoiser a request goes to: the one with the least work outstanding.

Each denoiser (one per GPU, or per GPU pair) batches what it gets, so a request sent to a busy one
waits on its queue or slows its batch while another GPU idles; a blind round robin does that
whenever requests differ in size or steps. Work is counted as steps x rows (2 with guidance) x
pixels, in units of one 1024x1024 row-step, the cost a step grows with
(GenerateParams.work).

A denoiser's load is what it publishes on the load board (backends/core/serving/load_board.py: the remaining
work of everything it holds, whoever sent it, `easel` or `easel_stream`) plus what this router
sent it that it has not admitted yet (between the pick and the denoiser's acknowledgement, the
board does not show it). A denoiser with nothing on the board (not started, or a board that cannot
be read) is counted by this router's own requests, as before there was a board: those it sent
and that have not ended. Ties go round the denoisers in turn, so equal requests still spread.
Torch-free and Triton-free, so that it is tested on its own.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence


class LeastLoaded:
    def __init__(self, names: Sequence[str], board: Callable[[str], float | None] | None = None):
        if not names:
            raise ValueError("denoisers: none to route to")
        self.names = list(names)
        self.board = board
        self.outstanding = {name: 0.0 for name in self.names}  # sent by this router, not ended
        self.pending = {name: 0.0 for name in self.names}  # sent by this router, not admitted
        self._next = 0  # where the search starts: ties go round in turn
        self._lock = threading.Lock()  # picks and releases come from the pipeline's worker threads

    def load(self, name: str) -> float:
        published = self.board(name) if self.board is not None else None
        return self.outstanding[name] if published is None else published + self.pending[name]

    def pick(self, work: float) -> str:
        """The denoiser for a request of `work`, counted as pending until admitted() and as
        outstanding until release()."""
        with self._lock:
            loads = {name: self.load(name) for name in self.names}
            order = self.names[self._next:] + self.names[:self._next]
            name = min(order, key=loads.__getitem__)  # the first of the least loaded
            self._next = (self.names.index(name) + 1) % len(self.names)
            self.outstanding[name] += work
            self.pending[name] += work
            return name

    def admitted(self, name: str, work: float) -> None:
        """The denoiser acknowledged the request: from now on its board counts it."""
        with self._lock:
            self.pending[name] = max(0.0, self.pending[name] - work)  # sums of floats need not return to 0

    def release(self, name: str, work: float, admitted: bool = True) -> None:
        """The request sent to `name` ended (finished, failed or cancelled)."""
        with self._lock:
            self.outstanding[name] = max(0.0, self.outstanding[name] - work)
            if not admitted:
                self.pending[name] = max(0.0, self.pending[name] - work)
