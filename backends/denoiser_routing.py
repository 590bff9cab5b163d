"""Which denoiser a request goes to: the one with the least work outstanding from this router.

Each denoiser (one per GPU) batches what it gets, so a request sent to a busy one waits on its
queue or slows its batch while another GPU idles; a blind round robin does that whenever requests
differ in size or steps. The router counts, per denoiser, the work of the requests it sent and that
have not finished: steps x rows (2 with guidance) x pixels, in units of one 1024x1024 row-step, the
cost a step grows with. Ties go round the denoisers in turn, so equal requests still spread.

It sees only its own requests: `easel` and `easel_stream` each route with their own counts (the
router lives in the model instance), which is exact when one of them carries the traffic.
Torch-free and Triton-free, so that it is tested on its own.
"""

from __future__ import annotations

import threading
from typing import Sequence

UNIT_PIXELS = 1024 * 1024


def request_work(steps: int, guidance: bool, width: int, height: int) -> float:
    """A request's denoising work in 1024x1024 row-steps."""
    return steps * (2 if guidance else 1) * width * height / UNIT_PIXELS


class LeastLoaded:
    def __init__(self, names: Sequence[str]):
        if not names:
            raise ValueError("denoisers: none to route to")
        self.names = list(names)
        self.outstanding = {name: 0.0 for name in self.names}
        self._next = 0  # where the search starts: ties go round in turn
        self._lock = threading.Lock()  # picks and releases come from the pipeline's worker threads

    def pick(self, work: float) -> str:
        """The denoiser for a request of `work`, counted as outstanding until release()."""
        with self._lock:
            order = self.names[self._next:] + self.names[:self._next]
            name = min(order, key=self.outstanding.__getitem__)  # the first of the least loaded
            self._next = (self.names.index(name) + 1) % len(self.names)
            self.outstanding[name] += work
            return name

    def release(self, name: str, work: float) -> None:
        """The request sent to `name` ended (finished, failed or cancelled)."""
        with self._lock:
            # max(): sums of floats need not return to exactly 0
            self.outstanding[name] = max(0.0, self.outstanding[name] - work)
