"""The denoiser's loop thread: the one owner of the engine.

    plan = batcher.schedule()   # who runs this step
    engine.step(states of plan)   # one batched UNet call
    batcher.update(plan, out)   # advance, finish, fail

`submit` and `cancel` only enqueue, so Triton's `execute` never blocks. Finished requests are
handed to `on_done`, which must not block either (the Triton adapter queues the response and a
sender thread sends it), so sending never delays the next step. Cancellation and deadlines are
checked between steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob, RequestState, StepProgress
from backends.core.request.params import InvalidInput, UnknownAdapter
from backends.core.engine.step_batcher import BatcherConfig, SeqState, Status, StepOutput, StepBatcher
from backends.core.engine.step_stats import LoopStats
from backends.core.serving.load_board import Load

log = logging.getLogger(__name__)
_WAKE = "wake"  # a LoRA load finished: look again


@dataclass(frozen=True)
class DenoiseResult:
    request_id: str
    latents: np.ndarray | None
    error: str | None
    queue_s: float  # from arrival to its first step
    denoise_s: float  # from its first step to its last
    steps: int
    max_batch: int = 1
    lora_step: int | None = None  # the step before which its LoRAs were merged
    lora_waited: bool = False  # it waited at its bound for them
    lora_wait_s: float = 0.0  # for how long
    # Why it failed, when it did: "invalid" (the client's input, a bad LoRA say), "not_found" (an
    # adapter the store does not hold, or no longer), "cancelled" (by the client, at a step
    # boundary), "failed" (the server's fault, or a shutdown).
    kind: str | None = None
    admit_s: float = 0.0  # of queue_s: preparing it to run (TorchDenoiser.start)
    template_use: str | None = None  # RequestState.template_use

    @property
    def outcome(self) -> str:
        """finished, or the kind of failure (for the denoiser's request counters)."""
        return "finished" if self.error is None else (self.kind or "failed")


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, UnknownAdapter):
        return "not_found"
    return "invalid" if isinstance(exc, InvalidInput) else "failed"


class DenoiseLoop:
    def __init__(self, engine: TorchDenoiser, on_done: Callable[[DenoiseResult], None],
                 config: BatcherConfig = BatcherConfig(), publish_load: Callable[[Load], None] | None = None):
        self.engine = engine
        self.on_done = on_done
        # The work still to do (GenerateParams.work of the steps left) of the requests submitted and
        # not yet taken, and of those taken (also weighted by their share of block tokens computed),
        # published with its predicted seconds for the routers (backends/core/serving/load_board.py).
        self.publish_load = publish_load
        self._inbox_work = 0.0
        self._held_work = 0.0
        self._held_token_work = 0.0
        self._work_lock = threading.Lock()
        self.batcher = StepBatcher(config)
        self.states: dict[str, RequestState] = {}
        self.stats = LoopStats()  # queue, running, step records: read by the adapter's metrics thread
        self._inbox: queue.Queue[DenoiseJob | None | str] = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="easel-denoise-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: DenoiseJob) -> None:
        self.stats.submitted += 1
        self._add_inbox_work(job.params.work())
        workflow = self.engine.workflows.get(job.workflow)  # (an unknown one is refused at admission)
        try:
            if workflow is not None:
                workflow.prefetch(job)
        except Exception:  # a head start only: admission checks the job and fetches what it needs
            log.warning("prefetch for request %s failed", job.request_id, exc_info=True)
        self._inbox.put(job)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking work, fail what is left, and join the thread."""
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout)

    # --- loop thread only below ---

    def _run(self) -> None:
        with self.engine.on_stream():
            self.engine.clock.idle(self.stats)  # anchors GPU time to host time
            self._loop()

    def _loop(self) -> None:
        clock = self.engine.clock
        while not self._stopping.is_set():
            if not self.batcher.has_work():
                clock.idle(self.stats)
            self._drain(block=not self.batcher.has_work())
            clock.begin()  # the step's wall time starts here: scheduling is part of it
            self._reap_cancelled()
            self._take_loaded_loras()
            self._take_loaded()
            plan = self.batcher.schedule(now=time.monotonic())
            self._count()
            if plan is None:  # nothing runnable: every request waits at its LoRA bound or for a load
                clock.discard()
                self._drain(block=True)
                continue
            batch = [self.states[rid] for rid in plan.request_ids]
            new = tuple(s for s in batch if s.index == 0)
            kinds: dict[str, str] = {}
            try:
                failed = self.engine.step(batch)  # id -> why: a message, or the client's error itself
                kinds = {rid: failure_kind(why) for rid, why in failed.items() if isinstance(why, BaseException)}
                output = StepOutput(failed={rid: str(why) for rid, why in failed.items()})
            except Exception as exc:  # one bad step fails its batch, not the server
                log.exception("denoising step failed for %s", plan.request_ids)
                output = StepOutput(failed={rid: f"denoising step failed: {exc}" for rid in plan.request_ids})
                new = None
            self._report_steps(batch, output)  # before any result: a request's progress precedes its end
            for seq in self.batcher.update(plan, output):
                self._finish(seq, kinds.get(seq.request_id))
            self._count()
            if new is None:
                clock.discard()
            else:  # (a request whose first step failed has not had one)
                units = sum(s.job.params.work(1) for s in batch)
                # (a step pads every reusing row to its widest mask: it costs that share on every row)
                clock.end(sum(s.rows for s in batch), tuple(s.job.arrival for s in new if s.index == 1), self.stats,
                          units, units * max(s.token_share for s in batch))
        for rid in list(self.states):
            self._abort(rid, Status.FAILED, "the denoiser is shutting down")
        self._count()

    def _count(self, taken: float = 0.0) -> None:
        """`taken`: the work of a job just taken from the inbox (admitted, or failed at admission)."""
        self.stats.waiting = len(self.batcher.waiting)
        self.stats.running = len(self.batcher.running)
        if self.publish_load is not None:
            held = [(s.job.params.work(len(s.timesteps) - s.index), s.token_share) for s in self.states.values()]
            with self._work_lock:  # one value: the job leaves the inbox's count as it joins the held
                self._inbox_work = max(0.0, self._inbox_work - taken)  # sums of floats need not return to 0
                self._held_work = sum(work for work, _ in held)
                self._held_token_work = sum(work * share for work, share in held)
                self._publish()

    def _add_inbox_work(self, work: float) -> None:
        if self.publish_load is not None:
            with self._work_lock:
                self._inbox_work += work
                self._publish()

    def _publish(self) -> None:
        # A job not yet taken is priced whole: whether it reuses a recording is known at admission.
        work = self._inbox_work + self._held_work
        cost = self.stats.cost
        try:
            self.publish_load(Load(work, cost.seconds(work, self._inbox_work + self._held_token_work), cost.row_step_s,
                                   cost.dense, cost.measured_at, cost.measured_steps))
        except Exception:  # routing information: never worth a request
            log.exception("publishing the denoiser's load failed")

    def _report_steps(self, batch: list[RequestState], output: StepOutput) -> None:
        """Progress of the requests that asked for it (easel_stream): an enqueue each, and on a
        step due for a preview a copy queued on the engine's stream (LatentSnapshot), no sync."""
        for state in batch:
            job = state.job
            if job.on_step is None or job.request_id in output.failed:
                continue
            due = job.preview_every > 0 and state.index % job.preview_every == 0
            try:
                job.on_step(StepProgress(job.request_id, state.index, len(state.timesteps),
                                         self.engine.snapshot(state) if due else None))
            except Exception:  # a progress report must never fail the step loop
                log.exception("progress of request %s failed", job.request_id)

    def _drain(self, block: bool) -> None:
        while True:
            try:
                job = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if job is None:
                return
            if job is not _WAKE:
                self._admit(job)
                self.stats.taken += 1
                self._count(taken=job.params.work())

    def _admit(self, job: DenoiseJob) -> None:
        try:
            started = time.monotonic()
            state = self.engine.start(job)
            state.admit_s = time.monotonic() - started
            reused = state.template_use == "reused"
            seq = SeqState(request_id=job.request_id, steps=len(state.timesteps),
                           shape=tuple(state.latents.shape[-2:]), rows=state.rows, arrival=job.arrival,
                           template=state.template_use if state.template_use in ("recorded", "reused") else None,
                           token_share=state.token_share if reused else None)
            self.batcher.add(seq)
        except Exception as exc:
            if failure_kind(exc) == "failed":  # our fault: its traceback (refusals: the adapter logs one line)
                log.exception("request %s failed at admission", job.request_id)
            self.on_done(DenoiseResult(job.request_id, None, str(exc), 0.0, 0.0, 0, kind=failure_kind(exc)))
            return
        self.states[job.request_id] = state
        if job.loras:
            state.lora_step = 0
        if job.loras_pending is not None:
            # A bound past the last step still waits before it: a request never finishes
            # without the LoRAs it asked for.
            seq.wait_from_step = min(job.lora_bound, seq.steps - 1)
            job.loras_pending.add_done_callback(lambda _: self._inbox.put(_WAKE))
        loading = state.workflow.loading(state)
        if loading is not None:  # held before its first step; the others keep stepping
            seq.wait_from_step = 0
            state.loading_since = time.monotonic()
            loading.add_done_callback(lambda _: self._inbox.put(_WAKE))

    def _take_loaded_loras(self) -> None:
        """LoRAs that finished loading join their request at this step boundary."""
        for rid, state in list(self.states.items()):
            future = state.job.loras_pending
            if future is None or not future.done():
                continue
            state.job.loras_pending = None
            try:
                state.job.loras = self.engine.adopt_loras(future.result())
            except Exception as exc:  # unreadable, or does not fit the UNet: this request only
                self._abort(rid, Status.FAILED, str(exc), kind=failure_kind(exc))
                continue
            state.lora_step = state.index
            seq = self.batcher.find(rid)
            if seq is not None:
                seq.wait_from_step = 0 if state.workflow.loading(state) is not None else None

    def _take_loaded(self) -> None:
        """What a request waited for before its first step (a template's recording) joins it here."""
        for rid, state in list(self.states.items()):
            loading = state.workflow.loading(state)
            if loading is None or not loading.done():
                continue
            state.workflow.adopt(state)
            self.engine.templates.stats.wait_seconds += time.monotonic() - state.loading_since
            seq = self.batcher.find(rid)
            if seq is not None:
                job = state.job
                seq.wait_from_step = min(job.lora_bound, seq.steps - 1) if job.loras_pending is not None else None

    def _reap_cancelled(self) -> None:
        """Requests whose client cancelled or whose deadline passed leave here, at a step
        boundary, waiting or running: their work stops, not only their answer."""
        now = time.monotonic()
        for rid, state in list(self.states.items()):
            job = state.job
            if job.is_cancelled():
                self._abort(rid, Status.CANCELLED, "cancelled by the client", kind="cancelled")
            elif job.deadline is not None and now >= job.deadline:
                self._abort(rid, Status.CANCELLED, f"its deadline passed ({job.deadline - job.arrival:.3g} s after "
                                                   "it reached the denoiser)", kind="cancelled")

    def _abort(self, rid: str, status: Status, why: str, kind: str = "failed") -> None:
        seq = self.batcher.abort(rid, status, why)
        if seq is not None:
            self._finish(seq, kind)

    def _finish(self, seq: SeqState, kind: str | None = None) -> None:
        state = self.states.pop(seq.request_id)
        # After the result's copy, which waits for the GPU: the loop issues steps ahead of the
        # device, so a clock read at the last step's issue would leave its tail out of denoise_s.
        latents = self.engine.result(state) if seq.status is Status.FINISHED else None
        now = time.monotonic()
        first = seq.first_step_at if seq.first_step_at is not None else now
        self.on_done(DenoiseResult(seq.request_id, latents, seq.error, first - seq.arrival, now - first,
                                   seq.steps_done, state.max_batch, state.lora_step, seq.waited_at_bound,
                                   seq.bound_wait_s, kind=kind if seq.status is not Status.FINISHED else None,
                                   admit_s=state.admit_s, template_use=state.template_use))
