"""Which denoiser a request goes to: the one that would finish it first.

Each denoiser (one per GPU, or per GPU pair) batches what it gets, so a request sent to a busy one
waits on its queue or slows its batch while another GPU idles; a blind round robin does that
whenever requests differ in size, steps or mask.

A denoiser's load is what it publishes on the load board (backends/core/serving/load_board.py: the
remaining work of everything it holds, whoever sent it, `easel` or `easel_stream`) plus what this
router sent it that it has not admitted yet (between the pick and the denoiser's acknowledgement,
the board does not show it). Two measures:

- `seconds` (the default): predicted seconds, which the denoiser learns from its own steps
  (engine/step_cost.py). A template edit that reuses a recording costs its mask's share of the
  transformer blocks, so a denoiser busy with small-mask edits is less loaded than its pixels say,
  and a faster denoiser (a GPU pair) counts as such. A request goes where its own predicted
  seconds plus the load are least: where it would finish first. A template edit is priced by its
  mask only on a denoiser this router has seen serve that template (it holds the recording; on
  another it would record, whole), so edits of a template stay where its recording is unless that
  denoiser is busier by more than the recording saves. Until every denoiser has a full window of
  measured steps (engine/step_cost.WINDOW), the last within STALE_S seconds, this router compares
  work instead: costs a denoiser learned before it went idle came from other requests (other sizes,
  ControlNets, LoRAs, another machine load), and a few first steps carry one-time costs; either
  priced an idle denoiser above a busy one for a short request. By work an idle one has none,
  takes the request and measures afresh.
- `work`: row-steps of 1024x1024 pixels (GenerateParams.work), blind to masks and speeds.

A denoiser with nothing on the board (not started, or a board that cannot be read) is counted by
this router's own requests, as work: those it sent and that have not ended. Ties go round the
denoisers in turn, so equal requests still spread. Torch-free and Triton-free, so that it is
tested on its own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from backends.core.engine.step_cost import WINDOW
from backends.core.serving.load_board import Load

MEASURES = ("seconds", "work")
# How old a denoiser's last measured step may be for its costs to price requests
STALE_S = 30.0
# Templates whose denoisers this router remembers (least recently routed forgotten first)
MAX_TEMPLATES = 4096


def _trusted(board: Load, now: float) -> bool:
    """Whether a denoiser's costs may price requests: a full window of steps, the last one recent."""
    return board.measured_steps >= WINDOW and board.measured_at is not None and now - board.measured_at <= STALE_S


@dataclass(frozen=True)
class RequestCost:
    """A request's denoising work: row-steps (GenerateParams.work), and the same weighted by the
    share of block tokens it is expected to compute (less than `work` for a reusing template edit)."""

    work: float
    token_work: float | None = None  # None: equal to work
    template: tuple | None = None  # a template edit's recording key (as the pipeline sees it)

    @property
    def tokens(self) -> float:
        return self.work if self.token_work is None else self.token_work


@dataclass(frozen=True)
class Pick:
    """Where a request went and what it added to that denoiser's load here, for admitted() and release()."""

    name: str
    work: float
    seconds: float
    template: tuple | None = None


class LeastLoaded:
    def __init__(self, names: Sequence[str], board: Callable[[str], Load | None] | None = None,
                 measure: str = "seconds"):
        if not names:
            raise ValueError("denoisers: none to route to")
        if measure not in MEASURES:
            raise ValueError(f"routing: {measure!r} is not one of {', '.join(MEASURES)}")
        self.names = list(names)
        self.board = board
        self.measure = measure
        self.outstanding = {name: 0.0 for name in self.names}  # work sent by this router, not ended
        self.pending = {name: 0.0 for name in self.names}  # work sent by this router, not admitted
        self.pending_s = {name: 0.0 for name in self.names}  # ... its predicted seconds
        self.holders: OrderedDict[tuple, set[str]] = OrderedDict()  # template -> denoisers that served it
        self._next = 0  # where the search starts: ties go round in turn
        self._lock = threading.Lock()  # picks and releases come from the pipeline's worker threads

    def loads(self, cost: RequestCost) -> tuple[str, dict[str, float], dict[str, float]]:
        """(the measure used, each denoiser's load as it would be with the request, the request's
        own seconds on each (0 when measured in work))."""
        boards = {name: self.board(name) if self.board is not None else None for name in self.names}
        holders = self.holders.get(cost.template, ()) if cost.template is not None else self.names
        own = {name: b.price(cost.work, cost.tokens if name in holders else cost.work) if b is not None else None
               for name, b in boards.items()}
        now = time.monotonic()
        # (a trusted board has a rate: its seconds and the request's own price there are numbers)
        if self.measure == "seconds" and all(b is not None and _trusted(b, now) for b in boards.values()):
            return "seconds", {n: boards[n].seconds + self.pending_s[n] + own[n] for n in self.names}, own
        loads = {n: (self.outstanding[n] if b is None else b.work + self.pending[n]) for n, b in boards.items()}
        return "work", loads, dict.fromkeys(self.names, 0.0)

    def pick(self, cost: RequestCost) -> Pick:
        """The denoiser for a request, counted as pending until admitted() and as outstanding
        until release()."""
        with self._lock:
            _, loads, own = self.loads(cost)
            order = self.names[self._next:] + self.names[:self._next]
            name = min(order, key=loads.__getitem__)  # the first of the least loaded
            self._next = (self.names.index(name) + 1) % len(self.names)
            chosen = Pick(name, cost.work, own[name] or 0.0, cost.template)
            self.outstanding[name] += chosen.work
            self.pending[name] += chosen.work
            self.pending_s[name] += chosen.seconds
            return chosen

    def admitted(self, chosen: Pick) -> None:
        """The denoiser acknowledged the request: from now on its board counts it."""
        with self._lock:
            self._unpend(chosen)

    def release(self, chosen: Pick, admitted: bool = True, served: bool = False) -> None:
        """The request sent to `chosen.name` ended (finished, failed or cancelled; `served`: it
        finished, so a template edit's denoiser now holds that template's recording)."""
        with self._lock:
            name = chosen.name
            if served and chosen.template is not None:
                self.holders.setdefault(chosen.template, set()).add(name)
                self.holders.move_to_end(chosen.template)
                while len(self.holders) > MAX_TEMPLATES:
                    self.holders.popitem(last=False)
            self.outstanding[name] = max(0.0, self.outstanding[name] - chosen.work)  # float sums need not return to 0
            if not admitted:
                self._unpend(chosen)

    def _unpend(self, chosen: Pick) -> None:
        name = chosen.name
        self.pending[name] = max(0.0, self.pending[name] - chosen.work)
        self.pending_s[name] = max(0.0, self.pending_s[name] - chosen.seconds)
