"""What the loop measures about its steps (backends/core/engine/step_stats.py): on the tiny engine
on CPU through the real loop, and the GPU path's bookkeeping with fake events (no device here)."""

from __future__ import annotations

import pytest
import torch

from backends.core.engine import step_stats
from backends.core.engine.loop import DenoiseLoop
from backends.core.engine.step_batcher import BatcherConfig
from backends.core.engine.step_stats import (DECODED, DECODER, ENCODED, ENCODER, SAMPLED, SAMPLER, LoopStats,
                                             StepClock)
from tests.unit.test_denoise_loop import Results, job


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.runtime.placement import Placement
    from backends.core.stages.text_encoding import PromptEncoder
    from export.repository import ExportOptions, export_repository

    repo = export_repository(tiny_model, tmp_path_factory.mktemp("stats") / "repo", ExportOptions())
    return TorchDenoiser(repo / "denoiser" / "1", Placement()), PromptEncoder(repo / "text_encoder" / "1", Placement())


def test_the_loop_records_every_step_its_rows_and_each_first_step(engines):
    engine, encoder = engines
    bad = job(encoder, "bad")
    bad.prompt_embeds = bad.prompt_embeds[:1]  # refused at admission: never steps
    jobs = [job(encoder, f"r{i}", steps=3 + i, seed=i) for i in range(3)]
    results = Results()
    seen = []  # (queued, running) as each request finished, read on the loop thread

    def done(result):
        seen.append((loop.stats.queued, loop.stats.running))
        results(result)

    loop = DenoiseLoop(engine, done, BatcherConfig(max_running=2, max_batch_rows=4))
    for j in [bad, *jobs]:
        loop.submit(j)
    assert loop.stats.queued == 4 and loop.stats.running == 0  # in the inbox: admitted, not running
    loop.start()
    out = results.wait([j.request_id for j in [bad, *jobs]])
    loop.shutdown()  # joins the loop: its last record and counts are in
    assert [r.outcome for r in out] == ["invalid"] + ["finished"] * 3
    bad, r0, r1, r2 = out
    # r2 waits while r0 and r1 run; it joins when r0 leaves, beside r1.
    assert seen[1:] == [(1, 2), (0, 2), (0, 1)]
    assert loop.stats.queued == 0 and loop.stats.running == 0

    records = loop.stats.take()
    assert loop.stats.take() == []
    # r0 and r1 share 3 steps (2 rows each with guidance), r1's last beside r2's first, then r2 alone.
    assert [r.rows for r in records] == [4, 4, 4, 4, 2, 2, 2, 2]
    assert sum(r.rows for r in records) == sum(2 * r.steps for r in out)
    for r in records:
        assert r.encoder_s > 0 and r.decoder_s > 0 and r.sampler_s > 0 and r.orchestration_s >= 0
    assert [len(r.first_step_s) for r in records] == [2, 0, 0, 1, 0, 0, 0, 0]  # bad never stepped
    for ttfs, result in zip(records[0].first_step_s + records[3].first_step_s, [r0, r1, r2]):
        # After its first step was planned, before its last step ended.
        assert result.queue_s < ttfs < result.queue_s + result.denoise_s
        # Its preparation (start) is part of its queue; r2's queue also holds its wait for a place.
        assert 0 < result.admit_s <= result.queue_s
    assert r2.queue_s > r2.admit_s + r0.denoise_s / 2


def test_a_step_that_raises_leaves_no_record(engines, monkeypatch):
    engine, encoder = engines

    def broken(batch):
        raise RuntimeError("the encoder half broke")

    monkeypatch.setattr(engine.runtime, "encode", broken)
    results = Results()
    loop = DenoiseLoop(engine, results)
    loop.start()
    loop.submit(job(encoder, "a"))
    (out,) = results.wait(["a"])
    loop.shutdown()
    assert out.outcome == "failed" and "the encoder half broke" in out.error
    assert loop.stats.take() == [] and loop.stats.running == 0


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_cpu_marks_split_the_wall_time(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(step_stats.time, "monotonic", clock)
    stats, steps = LoopStats(), StepClock()
    steps.mark(ENCODER)  # outside a step (an engine stepped directly): nothing
    for point, at in [(None, 100.0), (ENCODER, 100.5), (ENCODED, 101.5), (DECODER, 102.0), (DECODED, 104.0),
                      (SAMPLER, 104.0), (SAMPLED, 104.25)]:
        clock.now = at
        steps.begin() if point is None else steps.mark(point)
    clock.now = 105.0
    steps.end(6, (99.0, 104.5), stats)
    (record,) = stats.take()
    assert (record.rows, record.encoder_s, record.decoder_s, record.sampler_s) == (6, 1.0, 2.0, 0.25)
    assert record.orchestration_s == 1.75 and record.wall_s == 5.0
    assert record.first_step_s == (6.0, 0.5)
    steps.begin()
    steps.discard()
    assert stats.take() == []


class FakeStream:
    """A device timeline: events complete when `done` (GPU seconds) passes them."""

    def __init__(self):
        self.t = 0.0  # GPU time at which the next recorded event will complete
        self.done = 0.0


class FakeEvent:
    made = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        FakeEvent.made += 1
        self.t = None
        self.stream = None

    def record(self, stream):
        self.t, self.stream = stream.t, stream

    def query(self):
        return self.t <= self.stream.done

    def synchronize(self):
        self.stream.done = max(self.stream.done, self.t)

    def elapsed_time(self, end):
        assert self.query() and end.query(), "elapsed_time on an event not completed (a real one raises)"
        return (end.t - self.t) * 1e3


def test_gpu_records_wait_for_their_events_and_never_sync(monkeypatch):
    host = FakeClock()
    monkeypatch.setattr(step_stats.time, "monotonic", host)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stream, stats = FakeStream(), LoopStats()
    steps = StepClock(stream)
    # Loop start: the anchor; GPU time 10 s is host time 100 s.
    stream.t = stream.done = 10.0
    steps.idle(stats)

    def step(gpu_start, rows, arrivals=()):
        """Issue a step whose events land 1 s apart on the device from gpu_start."""
        stream.t = gpu_start
        steps.begin()
        for i, point in enumerate([ENCODER, ENCODED, DECODER, DECODED, SAMPLER, SAMPLED]):
            stream.t = gpu_start + 1 + i
            steps.mark(point)
        stream.t = gpu_start + 8
        steps.end(rows, arrivals, stats)

    step(10.0, 4, (99.5,))
    step(18.0, 2)
    assert stats.take() == []  # the device has finished neither: nothing read, nothing waited for
    stream.done = 18.0  # the first step is done
    step(26.0, 2)
    (first,) = stats.take()
    assert (first.rows, first.encoder_s, first.decoder_s, first.sampler_s, first.orchestration_s) == (4, 1, 1, 1, 5)
    assert first.first_step_s == (100.0 + 8 - 99.5,)  # its end in host time, from the anchor
    made = FakeEvent.made
    stream.done = 34.0  # the second and third are done
    step(34.0, 2)  # reuses the first step's events
    assert FakeEvent.made == made
    assert [r.rows for r in stats.take()] == [2, 2]
    # Idle: the tail is read (after a sync with nothing in flight), then a new anchor.
    host.now = 200.0
    stream.t = 50.0
    steps.idle(stats)
    assert [r.rows for r in stats.take()] == [2]
    step(60.0, 2, (190.0,))
    stream.done = 68.0
    steps.idle(stats)
    (late,) = stats.take()
    assert late.first_step_s == pytest.approx((200.0 + 18 - 190.0,))


def test_stats_drop_the_oldest_records_when_nobody_reads_them(monkeypatch):
    monkeypatch.setattr(step_stats, "MAX_RECORDS", 3)
    stats = LoopStats()
    stats.records = type(stats.records)(maxlen=3)
    for rows in range(5):
        stats.add(step_stats.StepRecord(rows, 0.0, 0.0, 0.0, 0.0))
    assert [r.rows for r in stats.take()] == [2, 3, 4] and stats.dropped == 2
    assert stats.queued == 0
