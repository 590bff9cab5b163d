"""Step-level continuous batching: who runs the next denoising step.

`schedule() -> StepPlan`, the executor runs the plan, `update(plan, output)` advances the
requests. Plain Python over dataclasses, no tensors: tested on CPU with fake outputs.

The batcher keeps the books (waiting and running sets, ticks, bound waits); a `Policy` decides
who is admitted and who steps. `Fcfs`, the default: requests are admitted in arrival order while
the running set has room; each step serves the running request that has waited longest since its
own last step, batched with every other running request of the same latent shape and workflow
(up to the row budget). Requests join before any step and leave after any step; shapes interleave.
Template edits that reuse a recording batch only with those whose share of computed tokens is
within `BatcherConfig.max_share_ratio` of each other's: a reusing step pads every row to its
largest share, so one wide mask would make every row of the step as costly as itself.
(diffusers' noise schedules, the other "schedulers", are engine/diffusers_schedulers.py.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol, Sequence


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class SeqState:
    """What the step batcher knows about one request."""

    request_id: str
    steps: int
    shape: tuple[int, int]  # latent (height, width): requests batch only with equal shapes
    rows: int  # UNet batch rows this request takes (2 with classifier-free guidance)
    arrival: float
    # A template edit's use of its template (engine/workflows/inpaint.py): "recorded" or "reused";
    # None for every other request, which shares steps whatever its workflow. Steps that record run
    # eager, steps whose rows all reuse run as their own graphs, and a step mixing kinds would run
    # eager for all its rows: each kind batches only with its own.
    template: str | None = None
    # A reusing edit's share of tokens computed (token_subsets.token_share): what its steps cost
    token_share: float | None = None
    steps_done: int = 0
    status: Status = Status.WAITING
    error: str | None = None
    first_step_at: float | None = None
    last_served: int = -1  # tick of its last step (or of its admission)
    # Bounded asynchrony: while its LoRAs load, the request may run steps below this one only.
    wait_from_step: int | None = None
    waited_at_bound: bool = False  # it was held at its bound at least once
    bound_wait_s: float = 0.0  # time held there, from the `now` of the plans that held and resumed it
    held_since: float | None = None

    @property
    def batch_key(self) -> tuple:
        """Requests share a step only with requests of an equal key."""
        return self.shape, self.template

    @property
    def runnable(self) -> bool:
        return self.wait_from_step is None or self.steps_done < self.wait_from_step

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.FAILED, Status.CANCELLED)


@dataclass(frozen=True)
class StepPlan:
    tick: int
    request_ids: tuple[str, ...]
    shape: tuple[int, int]
    admitted: tuple[str, ...] = ()  # joined the running set at this step


@dataclass(frozen=True)
class StepOutput:
    """What the executor reports back; request ids of the plan that failed, with why."""

    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BatcherConfig:
    max_running: int = 16  # requests holding state (latents, noise schedule) at once
    max_batch_rows: int = 16  # UNet batch rows per step (a CFG request takes 2)
    # Reusing edits share a step only where its largest token share is at most this times its
    # smallest (None: whatever their shares). With InstGenIE's mask ratios (mean 0.11) eight edits
    # padded to their widest mask are an ideal 2.83x faster than exact (FLOPs, SDXL at 1024 px,
    # ResNet boxes); grouped within 2x, 4.66x in 2.53 steps a round; each at its own mask 5.19x
    # (bench/micro/template_flops.py, bench/results/2026-11-29b-cpu). Unmeasured on a GPU, where
    # smaller steps run less efficiently.
    max_share_ratio: float | None = 2.0


class Policy(Protocol):
    """What a scheduling policy decides; it reads the requests' states and changes none."""

    def admit(self, waiting: Sequence[SeqState], room: int) -> list[SeqState]:
        """Which waiting requests join the running set now (at most `room`), in joining order."""

    def select(self, runnable: Sequence[SeqState], max_rows: int) -> list[SeqState]:
        """The next step's batch: runnable requests of one `SeqState.batch_key`,
        `max_rows` rows at most, never empty when `runnable` is not."""


class Fcfs:
    """First come, first admitted; the request served least recently leads each step, and those
    after it join in the same order while the step's token shares stay within `max_share_ratio`."""

    def __init__(self, max_share_ratio: float | None = None):
        self.max_share_ratio = max_share_ratio

    def admit(self, waiting: Sequence[SeqState], room: int) -> list[SeqState]:
        return list(waiting[:max(room, 0)])

    def select(self, runnable: Sequence[SeqState], max_rows: int) -> list[SeqState]:
        def staleness(s: SeqState):
            return (s.last_served, s.arrival)

        lead = min(runnable, key=staleness)
        batch, rows = [], 0
        low = high = lead.token_share
        for seq in sorted((s for s in runnable if s.batch_key == lead.batch_key),
                          key=staleness):
            if rows + seq.rows > max_rows:
                break
            if self.max_share_ratio is not None and low is not None and seq.token_share is not None:
                lo, hi = min(low, seq.token_share), max(high, seq.token_share)
                if hi > self.max_share_ratio * lo:
                    continue  # it would widen every row of the step: it leads a step of its own
                low, high = lo, hi
            batch.append(seq)
            rows += seq.rows
        return batch


class StepBatcher:
    def __init__(self, config: BatcherConfig = BatcherConfig(), policy: Policy | None = None):
        if config.max_running < 1 or config.max_batch_rows < 2:
            raise ValueError(f"step batcher config out of range: {config}")
        if config.max_share_ratio is not None and config.max_share_ratio < 1:
            raise ValueError(f"step batcher max_share_ratio: {config.max_share_ratio} is below 1")
        self.config = config
        self.policy = policy or Fcfs(config.max_share_ratio)
        self.waiting: list[SeqState] = []
        self.running: dict[str, SeqState] = {}
        self._tick = -1  # the last tick planned

    def add(self, seq: SeqState) -> None:
        if seq.rows > self.config.max_batch_rows:
            raise ValueError(f"request needs {seq.rows} rows, over max_batch_rows={self.config.max_batch_rows}")
        if seq.request_id in self.running or any(s.request_id == seq.request_id for s in self.waiting):
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        self.waiting.append(seq)

    def abort(self, request_id: str, status: Status = Status.CANCELLED, error: str | None = None) -> SeqState | None:
        """Remove a request wherever it is; returns it, or None if unknown."""
        seq = self.running.pop(request_id, None)
        if seq is None:
            for i, s in enumerate(self.waiting):
                if s.request_id == request_id:
                    seq = self.waiting.pop(i)
                    break
        if seq is not None:
            seq.status, seq.error = status, error
        return seq

    def find(self, request_id: str) -> SeqState | None:
        return self.running.get(request_id) or next((s for s in self.waiting if s.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float = 0.0) -> StepPlan | None:
        admitted = []
        for seq in self.policy.admit(tuple(self.waiting), self.config.max_running - len(self.running)):
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            # A newcomer ranks as if served just now: otherwise a stream of arrivals of one
            # shape would keep leading and starve running requests of another shape.
            seq.last_served = self._tick
            self.running[seq.request_id] = seq
            admitted.append(seq.request_id)
        runnable = []
        for seq in self.running.values():
            if seq.runnable:
                runnable.append(seq)
                if seq.held_since is not None:
                    seq.bound_wait_s += now - seq.held_since
                    seq.held_since = None
            else:
                seq.waited_at_bound = True
                if seq.held_since is None:
                    seq.held_since = now
        if not runnable:
            return None

        batch = self.policy.select(tuple(runnable), self.config.max_batch_rows)
        shapes = {s.batch_key for s in batch}
        if not batch or len(shapes) != 1 or sum(s.rows for s in batch) > self.config.max_batch_rows \
                or any(s not in runnable for s in batch):
            raise RuntimeError(f"policy {type(self.policy).__name__} chose an invalid batch "
                               f"({[s.request_id for s in batch]})")
        self._tick = tick = self._tick + 1
        for seq in batch:
            seq.last_served = tick
            if seq.first_step_at is None:
                seq.first_step_at = now
        return StepPlan(tick=tick, request_ids=tuple(s.request_id for s in batch), shape=batch[0].shape,
                        admitted=tuple(admitted))

    def update(self, plan: StepPlan, output: StepOutput) -> list[SeqState]:
        """Advance the plan's requests by one step; returns those that left the running set."""
        left = []
        for rid in plan.request_ids:
            seq = self.running.get(rid)
            if seq is None:  # aborted while its step ran
                continue
            if rid in output.failed:
                left.append(self.abort(rid, Status.FAILED, output.failed[rid]))
                continue
            seq.steps_done += 1
            if seq.steps_done >= seq.steps:
                seq.status = Status.FINISHED
                left.append(self.running.pop(rid))
        return left
