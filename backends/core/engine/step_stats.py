"""What the denoiser's loop measures about its steps, as plain numbers in a typed object: the
Triton adapter (backends/triton/metrics.py) turns them into Prometheus metrics, and nothing here
imports Triton.

Per step: the UNet rows of its batch, and its wall time split into the encoder half, the decoder
half, the sampler (guidance and the sampler update of the whole batch) and orchestration (the
rest: scheduling, batch assembly, ControlNet hand-offs, finishing requests, Python). Per request:
time to first step, from the denoiser's admission (`DenoiseJob.arrival`) to the end of its first
step. Gauges: requests admitted and waiting to join the running set, and requests running.

On CPU a mark is a clock read, exact. On a GPU the loop queues a step's kernels ahead of the
device, so a clock read would time their launch: a mark is a CUDA event recorded on the engine's
stream, and a step's record is read once its last event has completed (`Event.query()` at later
steps, never a sync). Its wall time is then the GPU's, from when the device reached the step's
start (the previous step done and the loop there) to its end, so host time that leaves the
device idle shows as orchestration, and host time hidden behind the previous step does not. A
GPU time becomes a host time (for time to first step) through an anchor: an event the loop
synchronized on when it had no work, so no step waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from backends.core.engine.step_cost import StepCostModel

# Marks of one step, in order (`StepClock.mark`); the engine marks the halves and the sampler.
START, ENCODER, ENCODED, DECODER, DECODED, SAMPLER, SAMPLED, END = range(8)
MARKS = 8
# Records the loop keeps for the adapter's metrics thread; past this (that thread stalled) the
# oldest are dropped rather than grow without end.
MAX_RECORDS = 8192


@dataclass(frozen=True, slots=True)
class StepRecord:
    rows: int  # UNet rows in the step's batch (a request with guidance takes 2)
    encoder_s: float
    decoder_s: float
    sampler_s: float
    orchestration_s: float  # the step's wall time less the three above
    # Time to first step of each request whose first step this was.
    first_step_s: tuple[float, ...] = ()
    # Its work in 1024x1024 row-steps, and the same weighted by the step's largest share of block
    # tokens computed (engine/step_cost.py); 0 where the caller did not say.
    units: float = 0.0
    token_units: float = 0.0

    @property
    def wall_s(self) -> float:
        return self.encoder_s + self.decoder_s + self.sampler_s + self.orchestration_s


@dataclass
class LoopStats:
    """Written by the loop thread (`submitted` by Triton's execute thread), read by the adapter's
    metrics thread: plain ints, and finished step records in a bounded deque (whose append and
    popleft are atomic, so no lock)."""

    submitted: int = 0  # jobs handed to the loop
    taken: int = 0  # jobs the loop has taken from its inbox
    waiting: int = 0  # admitted by the loop, not yet in the running set
    running: int = 0  # in the running set (holding latents; includes those held at a LoRA bound)
    dropped: int = 0  # step records dropped because nobody read them
    records: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=MAX_RECORDS))
    cost: StepCostModel = field(default_factory=StepCostModel)  # learned from every record (loop thread)

    @property
    def queued(self) -> int:
        """Requests admitted by the denoiser and waiting to join the running batch: in the loop's
        inbox or in the scheduler's waiting list."""
        return max(0, self.submitted - self.taken) + self.waiting

    def add(self, record: StepRecord) -> None:
        self.cost.observe(record.units, record.token_units, record.wall_s)
        if len(self.records) == MAX_RECORDS:
            self.dropped += 1
        self.records.append(record)

    def take(self) -> list[StepRecord]:
        """The records not read yet, oldest first."""
        out = []
        while True:
            try:
                out.append(self.records.popleft())
            except IndexError:
                return out


class StepClock:
    """The marks of the step in flight (loop thread only). `mark` outside a step (an engine
    stepped directly, as tests and `easel profile-lora` do) does nothing."""

    def __init__(self, stream=None):
        self.stream = stream  # a CUDA stream: marks are events on it; None: clock reads
        self._open = False
        self._times = [0.0] * MARKS
        self._events: list | None = None  # the open step's events (GPU)
        # (events, rows, arrivals, units, token_units) of steps the GPU may not have finished
        self._pending: deque = deque()
        self._free: list[list] = []  # event sets to reuse: a step allocates none once the loop is warm
        self._anchor = None
        self._anchor_host = 0.0
        self._since_anchor = False  # steps were issued since the anchor

    def begin(self) -> None:
        self._open = True
        if self.stream is None:
            self._times[START] = time.monotonic()
            return
        import torch

        self._events = self._free.pop() if self._free else [torch.cuda.Event(enable_timing=True)
                                                            for _ in range(MARKS)]
        self._events[START].record(self.stream)

    def mark(self, point: int) -> None:
        if not self._open:
            return
        if self._events is None:
            self._times[point] = time.monotonic()
        else:
            self._events[point].record(self.stream)

    def discard(self) -> None:
        """No step after all (nothing runnable), or one that raised: no record."""
        self._open = False
        if self._events is not None:
            self._free.append(self._events)
            self._events = None

    def end(self, rows: int, arrivals: tuple[float, ...], stats: LoopStats, units: float = 0.0,
            token_units: float = 0.0) -> None:
        """Close the step (`arrivals`: admission times of the requests whose first step it was;
        `units`, `token_units`: its work, StepRecord's) and hand `stats` every record whose times
        are known by now."""
        self._open = False
        if self._events is None:
            t = self._times
            now = t[END] = time.monotonic()
            stats.add(_record(rows, t[ENCODED] - t[ENCODER], t[DECODED] - t[DECODER], t[SAMPLED] - t[SAMPLER],
                              now - t[START], tuple(now - a for a in arrivals), units, token_units))
            return
        self._events[END].record(self.stream)
        self._pending.append((self._events, rows, arrivals, units, token_units))
        self._events = None
        self._since_anchor = True
        self.collect(stats)

    def collect(self, stats: LoopStats) -> None:
        """Records of the steps the GPU has finished, in order; never waits for one."""
        while self._pending and self._pending[0][0][END].query():
            events, rows, arrivals, units, token_units = self._pending.popleft()
            ms = events[START].elapsed_time
            first = ()
            if arrivals and self._anchor is not None:
                end = self._anchor_host + self._anchor.elapsed_time(events[END]) / 1e3
                first = tuple(end - a for a in arrivals)
            stats.add(_record(rows, (ms(events[ENCODED]) - ms(events[ENCODER])) / 1e3,
                              (ms(events[DECODED]) - ms(events[DECODER])) / 1e3,
                              (ms(events[SAMPLED]) - ms(events[SAMPLER])) / 1e3, ms(events[END]) / 1e3, first,
                              units, token_units))
            self._free.append(events)

    def idle(self, stats: LoopStats) -> None:
        """The loop has no work: wait for the stream's tail (no step is waiting for it), read the
        last records, and anchor GPU time to host time again (the clocks drift apart). Also at
        the loop's start."""
        if self.stream is None or (self._anchor is not None and not self._since_anchor):
            return
        import torch

        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record(self.stream)
        anchor.synchronize()
        host = time.monotonic()
        self.collect(stats)  # (against the old anchor: every pending event precedes it)
        self._anchor, self._anchor_host, self._since_anchor = anchor, host, False


def _record(rows, encoder_s, decoder_s, sampler_s, wall_s, first_step_s, units, token_units) -> StepRecord:
    # Event times are rounded (to about half a microsecond): the rest is clamped at zero.
    return StepRecord(rows, encoder_s, decoder_s, sampler_s, max(0.0, wall_s - encoder_s - decoder_s - sampler_s),
                      first_step_s, units, token_units)
