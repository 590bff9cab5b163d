"""backends/core/engine/step_batcher.py: the step-level batching state machine, driven by fake step outputs.

No tensors: each test plays the executor, calling `schedule()` and reporting back a StepOutput.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict

import pytest

from backends.core.engine.step_batcher import BatcherConfig, Fcfs, SeqState, Status, StepOutput, StepBatcher

A, B, C = (8, 8), (9, 13), (16, 8)  # latent shapes


def seq(rid: str, steps: int = 3, shape=A, rows: int = 2, arrival: float = 0.0) -> SeqState:
    return SeqState(request_id=rid, steps=steps, shape=shape, rows=rows, arrival=arrival)


def batcher(max_running: int = 16, max_batch_rows: int = 16, *seqs: SeqState) -> StepBatcher:
    s = StepBatcher(BatcherConfig(max_running=max_running, max_batch_rows=max_batch_rows))
    for q in seqs:
        s.add(q)
    return s


def tick(s: StepBatcher, failed: dict[str, str] | None = None):
    """One executor round: schedule, 'run' the step, report it; returns (plan, ids that left)."""
    plan = s.schedule()
    assert plan is not None
    left = s.update(plan, StepOutput(failed=failed or {}))
    return plan, [q.request_id for q in left]


def drain(s: StepBatcher, limit: int = 10_000):
    """Run until no work is left; returns the plans and every request that left, in order."""
    plans, left = [], []
    while s.has_work():
        assert len(plans) < limit, "the batcher did not drain"
        plan = s.schedule()
        plans.append(plan)
        left += s.update(plan, StepOutput())
    return plans, left


def served_ticks(plans) -> dict[str, list[int]]:
    ticks = defaultdict(list)
    for plan in plans:
        for rid in plan.request_ids:
            ticks[rid].append(plan.tick)
    return ticks


def max_gap(ticks: list[int]) -> int:
    return max((b - a for a, b in zip(ticks, ticks[1:])), default=0)


# --- configuration and add() ---


@pytest.mark.parametrize("config", [BatcherConfig(max_running=0), BatcherConfig(max_running=-1),
                                    BatcherConfig(max_batch_rows=1), BatcherConfig(max_batch_rows=0)])
def test_config_out_of_range_is_rejected(config):
    with pytest.raises(ValueError, match="out of range"):
        StepBatcher(config)


def test_smallest_valid_config_works():
    s = batcher(1, 2, seq("a", steps=2), seq("b", steps=1))
    plans, left = drain(s)
    assert [p.request_ids for p in plans] == [("a",), ("a",), ("b",)]
    assert [q.request_id for q in left] == ["a", "b"]


def test_duplicate_ids_are_rejected_while_waiting_and_while_running():
    s = batcher(1, 16, seq("a"), seq("b"))
    with pytest.raises(ValueError, match="duplicate request id 'b'"):  # b is waiting
        s.add(seq("b"))
    s.schedule()  # a is running now
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        s.add(seq("a"))
    assert [q.request_id for q in s.waiting] == ["b"] and list(s.running) == ["a"]


def test_an_id_is_free_again_once_its_request_left():
    s = batcher(4, 16, seq("a", steps=1))
    assert tick(s)[1] == ["a"]
    s.add(seq("a", steps=1))
    assert tick(s)[1] == ["a"]


def test_requests_over_the_row_budget_are_rejected():
    s = batcher(4, 3)
    with pytest.raises(ValueError, match="needs 4 rows, over max_batch_rows=3"):
        s.add(seq("big", rows=4))
    assert not s.has_work()
    s.add(seq("fits", rows=3))  # exactly the budget is fine
    assert tick(s)[0].request_ids == ("fits",)


def test_nothing_to_do_gives_no_plan():
    s = batcher()
    assert not s.has_work()
    assert s.schedule() is None


# --- admission, joining and leaving ---


def test_admission_is_fcfs_and_bounded_by_max_running():
    s = batcher(2, 16, *(seq(f"r{i}", steps=1 + i, shape=[A, B][i % 2], arrival=i) for i in range(5)))
    admitted = []
    while s.has_work():
        plan = s.schedule()
        admitted += plan.admitted
        assert len(s.running) <= 2
        assert len(s.running) == 2 or not s.waiting  # never idle room while someone waits
        s.update(plan, StepOutput())
    assert admitted == [f"r{i}" for i in range(5)]


def test_equal_shapes_share_one_step():
    s = batcher(16, 16, seq("a", steps=2), seq("b", steps=2, rows=1), seq("c", steps=2))
    plan, left = tick(s)
    assert plan.admitted == ("a", "b", "c")
    assert sorted(plan.request_ids) == ["a", "b", "c"] and plan.shape == A
    assert left == [] and all(q.steps_done == 1 for q in s.running.values())
    plan, left = tick(s)
    assert sorted(plan.request_ids) == ["a", "b", "c"] and sorted(left) == ["a", "b", "c"]


def test_row_budget_is_never_exceeded_and_the_left_out_request_goes_next():
    # Budget 5: two CFG requests (4 rows) fit, the third would make 6; the batch stops there.
    s = batcher(16, 5, seq("a", arrival=0), seq("b", arrival=1), seq("c", arrival=2), seq("d", rows=1, arrival=3))
    plans, _ = drain(s)
    rows = {"a": 2, "b": 2, "c": 2, "d": 1}
    for plan in plans:
        assert sum(rows[r] for r in plan.request_ids) <= 5
    assert set(plans[0].request_ids) == {"a", "b"}
    assert plans[1].request_ids == ("c", "d", "a")  # the left-out request leads the next step, 5 rows
    assert all(len(t) == 3 for t in served_ticks(plans).values())


def test_requests_join_between_steps_and_leave_after_their_last_step():
    s = batcher(16, 16, seq("a", steps=3))
    tick(s)
    s.add(seq("b", steps=2, arrival=1.0))  # joins while a is mid-way
    plan, left = tick(s)
    assert plan.admitted == ("b",) and set(plan.request_ids) == {"a", "b"}
    assert (s.running["a"].steps_done, s.running["b"].steps_done) == (2, 1)
    plan, left = tick(s)
    assert set(plan.request_ids) == {"a", "b"} and sorted(left) == ["a", "b"]
    assert not s.has_work()


def test_finished_requests_report_status_and_step_count():
    s = batcher(16, 16, seq("one", steps=1), seq("four", steps=4, shape=B))
    plans, left = drain(s)
    assert [q.request_id for q in left] == ["one", "four"]
    for q in left:
        assert q.status is Status.FINISHED and q.done and q.error is None
        assert q.steps_done == q.steps
    assert sum("four" in p.request_ids for p in plans) == 4


def test_first_step_time_is_the_now_of_the_first_plan_that_serves_it():
    s = batcher(1, 16, seq("a", steps=2), seq("b", steps=1))
    s.update(s.schedule(now=10.0), StepOutput())
    (a,) = s.update(s.schedule(now=11.0), StepOutput())
    assert a.first_step_at == 10.0
    plan = s.schedule(now=12.0)
    assert plan.request_ids == ("b",)
    (b,) = s.update(plan, StepOutput())
    assert b.first_step_at == 12.0


# --- shapes interleave ---


def test_different_shapes_interleave_round_robin():
    # Three shapes, all admitted at once, each shape fits in one batch: A, B, C, A, B, C, ...
    seqs = [seq(f"{name}{i}", steps=4 + i, shape=shape, rows=2, arrival=k * 3 + i)
            for k, (name, shape) in enumerate([("a", A), ("b", B), ("c", C)]) for i in range(3)]
    s = batcher(16, 16, *seqs)
    plans, left = drain(s)
    for plan in plans:
        assert len({q.shape for q in seqs if q.request_id in plan.request_ids}) == 1
    assert [p.shape for p in plans[:6]] == [A, B, C, A, B, C]
    assert sorted(q.request_id for q in left) == sorted(q.request_id for q in seqs)
    assert all(q.status is Status.FINISHED and q.steps_done == q.steps for q in left)
    ticks = served_ticks(plans)
    assert all(max_gap(t) <= 3 for t in ticks.values()), ticks


def test_no_shape_starves_when_batches_are_row_limited():
    # Budget of 4 rows: each shape needs two batches per round. With n running requests and no new
    # arrivals, the stalest request is served at least every n ticks.
    seqs = [seq(f"r{i}", steps=3 + i % 4, shape=[A, B, C][i % 3], rows=1 + i % 2, arrival=i) for i in range(12)]
    s = batcher(16, 4, *seqs)
    plans, left = drain(s)
    assert len(left) == 12 and all(q.steps_done == q.steps for q in left)
    for rid, t in served_ticks(plans).items():
        assert max_gap(t) <= 12, (rid, t)


# Regression: a steady stream of newcomers of one shape must not starve another shape.
@pytest.mark.parametrize("max_running,rows,stream_steps", [
    (3, 2, 2),  # small config, CFG requests of 2 steps
    (16, 1, 15),  # the default config, guidance <= 1 requests (1 row) of 15 steps
], ids=["small", "default-config"])
def test_a_stream_of_newcomers_does_not_starve_another_shape(max_running, rows, stream_steps):
    s = batcher(max_running, 16, seq("odd", steps=4, shape=B, rows=rows, arrival=0))
    # A stream of shape-A requests, staggered: the first ones need 1, 2, ... steps, as if each had
    # arrived one step after the previous one.
    for i in range(200):
        s.add(seq(f"s{i}", steps=min(i + 1, stream_steps), shape=A, rows=rows, arrival=1 + i))
    plans, _ = drain(s)
    ticks = served_ticks(plans)["odd"]
    assert max_gap(ticks) <= max_running, f"'odd' was served at ticks {ticks} (max_running={max_running})"


# --- failures and aborts ---


def test_a_failed_request_leaves_with_its_error_and_the_rest_advance():
    s = batcher(16, 16, seq("a"), seq("b"), seq("c"))
    plan, left = tick(s, failed={"b": "out of memory", "not-in-plan": "ignored"})
    assert left == ["b"]
    assert "b" not in s.running
    assert s.running["a"].steps_done == 1 and s.running["c"].steps_done == 1
    plans, rest = drain(s)
    assert all("b" not in p.request_ids for p in plans)
    assert {q.request_id for q in rest} == {"a", "c"}


def test_failed_request_state():
    s = batcher(16, 16, seq("a", steps=3))
    tick(s)
    plan = s.schedule()
    (a,) = s.update(plan, StepOutput(failed={"a": "nan in latents"}))
    assert (a.status, a.error, a.steps_done, a.done) == (Status.FAILED, "nan in latents", 1, True)


def test_abort_of_a_waiting_request():
    s = batcher(1, 16, seq("a", steps=2), seq("b"))
    plan = s.schedule()
    b = s.abort("b")
    assert b.request_id == "b" and b.status is Status.CANCELLED and b.error is None
    assert s.waiting == []
    s.update(plan, StepOutput())
    plans, left = drain(s)
    assert all("b" not in p.request_ids for p in plans) and [q.request_id for q in left] == ["a"]


def test_abort_of_a_running_request_with_a_status_and_error():
    s = batcher(16, 16, seq("a"), seq("b"))
    tick(s)
    a = s.abort("a", Status.FAILED, "client went away")
    assert (a.status, a.error, a.steps_done) == (Status.FAILED, "client went away", 1)
    plans, left = drain(s)
    assert all("a" not in p.request_ids for p in plans) and [q.request_id for q in left] == ["b"]


def test_abort_of_an_unknown_or_finished_request_returns_none():
    s = batcher(16, 16, seq("a", steps=1))
    assert s.abort("nobody") is None
    tick(s)
    assert s.abort("a") is None


def test_update_ignores_requests_aborted_while_their_step_ran():
    s = batcher(16, 16, seq("a", steps=1), seq("b", steps=1), seq("c", steps=2))
    plan = s.schedule()
    assert set(plan.request_ids) == {"a", "b", "c"}
    a = s.abort("a")
    c = s.abort("c")
    left = s.update(plan, StepOutput(failed={"c": "late failure"}))
    assert [q.request_id for q in left] == ["b"]
    assert (a.status, a.steps_done) == (Status.CANCELLED, 0)  # not counted, not finished
    assert (c.status, c.error, c.steps_done) == (Status.CANCELLED, None, 0)  # the late failure is ignored
    assert not s.has_work()


# --- randomized simulation ---


def _staleness(q: SeqState):
    return (q.last_served, q.arrival)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_simulation_keeps_every_invariant(seed):
    rng = random.Random(seed)
    config = BatcherConfig(max_running=rng.choice([1, 3, 6]), max_batch_rows=rng.choice([2, 5, 8]))
    s = StepBatcher(config)
    shapes = [A, B, C]
    requests: dict[str, SeqState] = {}
    expected_waiting: list[str] = []  # our own model of the FCFS queue
    counted: dict[str, int] = defaultdict(int)  # steps we reported successful
    outcome: dict[str, Status] = {}
    now = 0.0

    arrivals_end, step = 300, -1
    while step < arrivals_end or s.has_work():
        step += 1
        assert step < 10_000, "the simulation did not drain"
        now += 1.0
        if step < arrivals_end:
            for _ in range(rng.choice([0, 0, 1, 1, 2])):
                rid = f"r{len(requests)}"
                q = SeqState(rid, steps=rng.randint(1, 6), shape=rng.choice(shapes),
                             rows=rng.randint(1, min(2, config.max_batch_rows)), arrival=now)
                requests[rid] = q
                s.add(q)
                expected_waiting.append(rid)
        if rng.random() < 0.05 and (s.waiting or s.running):  # abort between steps
            rid = rng.choice([q.request_id for q in s.waiting] + list(s.running))
            assert s.abort(rid) is requests[rid]
            outcome[rid] = Status.CANCELLED
            if rid in expected_waiting:
                expected_waiting.remove(rid)
        if not s.has_work():
            assert s.schedule(now) is None
            continue

        before = {rid: _staleness(q) for rid, q in s.running.items()}
        plan = s.schedule(now)
        assert plan is not None
        # FCFS admission, bounded by max_running, no idle room while requests wait
        assert list(plan.admitted) == expected_waiting[:len(plan.admitted)]
        del expected_waiting[:len(plan.admitted)]
        assert [q.request_id for q in s.waiting] == expected_waiting
        assert len(s.running) <= config.max_running
        assert len(s.running) == config.max_running or not s.waiting
        for rid in plan.admitted:
            assert requests[rid].status is Status.RUNNING
        # the batch: non-empty, distinct, running, one shape, within the row budget
        ids = plan.request_ids
        assert ids and len(set(ids)) == len(ids) and set(ids) <= set(s.running)
        assert all(requests[r].shape == plan.shape for r in ids)
        assert sum(requests[r].rows for r in ids) <= config.max_batch_rows
        # Of the requests that ran before, the batch takes the stalest of its shape first; with no
        # newcomer this step, the stalest of all leads and the batch is as large as the budget allows.
        same_shape = sorted((r for r in before if requests[r].shape == plan.shape), key=before.get)
        old_ids = [r for r in ids if r in before]
        assert old_ids == same_shape[:len(old_ids)]
        if not plan.admitted:
            assert min(before, key=before.get) in ids
            if len(ids) < len(same_shape):
                nxt = same_shape[len(ids)]
                assert sum(requests[r].rows for r in ids) + requests[nxt].rows > config.max_batch_rows
        assert all(requests[r].last_served == plan.tick and requests[r].first_step_at is not None for r in ids)

        # the executor: some requests fail, some are aborted while the step runs
        failed = {r: f"failure of {r}" for r in ids if rng.random() < 0.03}
        for r in ids:
            if rng.random() < 0.03:
                s.abort(r)
                outcome[r] = Status.CANCELLED
        left = s.update(plan, StepOutput(failed=failed))
        for r in ids:
            if outcome.get(r) is not Status.CANCELLED and r not in failed:
                counted[r] += 1
        for q in left:
            assert q.request_id not in s.running and q.request_id in ids
            assert outcome.get(q.request_id) is None, f"{q.request_id} left twice"
            outcome[q.request_id] = q.status
            if q.status is Status.FAILED:
                assert q.error == failed[q.request_id]
            else:
                assert q.status is Status.FINISHED and q.steps_done == q.steps
        for rid, q in requests.items():
            assert q.steps_done == counted[rid]
            assert q.steps_done <= q.steps
        for q in s.running.values():
            assert q.status is Status.RUNNING and q.steps_done < q.steps

    assert set(outcome) == set(requests)
    for rid, q in requests.items():
        assert q.status is outcome[rid] and q.done
    assert sum(st is Status.FINISHED for st in outcome.values()) > len(requests) // 2


def test_time_held_at_the_lora_bound_is_measured_from_the_plans_now():
    s = batcher(16, 16, seq("a", steps=4), seq("b", steps=4))
    a = s.find("a")
    a.wait_from_step = 1  # its LoRAs are loading: it may run step 0 only
    for now, expected in ((1.0, {"a", "b"}), (2.0, {"b"}), (3.0, {"b"})):  # held from the plan at 2.0
        plan = s.schedule(now=now)
        assert set(plan.request_ids) == expected
        s.update(plan, StepOutput())
    a.wait_from_step = None  # loaded: it runs again from the next plan
    assert "a" in s.schedule(now=4.5).request_ids
    assert a.waited_at_bound and a.bound_wait_s == 2.5 and a.held_since is None


# --- the policy seam ---


class ShortestFirst(Fcfs):
    """Admits the request with the fewest steps first and steps it alone (a policy unlike Fcfs)."""

    def admit(self, waiting, room):
        return sorted(waiting, key=lambda s: s.steps)[:room]

    def select(self, runnable, max_rows):
        return [min(runnable, key=lambda s: (s.steps - s.steps_done, s.arrival))]


def test_a_policy_decides_admission_and_the_batch_while_the_batcher_keeps_the_books():
    s = StepBatcher(BatcherConfig(max_running=1), ShortestFirst())
    s.add(seq("long", steps=5, arrival=0.0))
    s.add(seq("short", steps=2, arrival=1.0))
    plans, left = drain(s)
    assert [p.request_ids for p in plans] == [("short",)] * 2 + [("long",)] * 5
    assert plans[2].admitted == ("long",) and [q.request_id for q in left] == ["short", "long"]
    assert all(q.status is Status.FINISHED for q in left)


class MixesShapes(Fcfs):
    def select(self, runnable, max_rows):
        return list(runnable)


def test_a_policy_that_mixes_shapes_is_refused_loudly():
    s = StepBatcher(BatcherConfig(), MixesShapes())
    s.add(seq("a", shape=A))
    s.add(seq("b", shape=B))
    with pytest.raises(RuntimeError, match="MixesShapes chose an invalid batch"):
        s.schedule()


def test_template_edits_share_steps_only_with_edits_that_use_their_template_alike():
    s = batcher(16, 16, seq("a"), dataclasses.replace(seq("b"), template="reused"), seq("c"),
                dataclasses.replace(seq("d"), template="reused"), dataclasses.replace(seq("e"), template="recorded"))
    plans, _ = drain(s)
    assert {p.request_ids for p in plans} == {("a", "c"), ("b", "d"), ("e",)}


def reusing(rid: str, share: float, arrival: float = 0.0) -> SeqState:
    return dataclasses.replace(seq(rid, steps=4, arrival=arrival), template="reused", token_share=share)


def test_reusing_edits_share_a_step_only_within_the_ratio_of_their_token_shares():
    """Each step pads every reusing row to its largest share: edits of 5-9% of the tokens always
    step together, the 20%, 30% and 60% ones in pairs within 2x (the default) as they lead, never
    with the narrow ones; three steps a round, not one step padded to 60%."""
    shares = {"a": 0.05, "b": 0.3, "c": 0.09, "d": 0.6, "e": 0.2, "f": 0.06}
    s = batcher(16, 16, *(reusing(rid, share, arrival=i) for i, (rid, share) in enumerate(shares.items())))
    plans, left = drain(s)
    assert len(left) == 6 and len(plans) == 3 * 4
    assert [p.request_ids for p in plans if "a" in p.request_ids] == [("a", "c", "f")] * 4
    assert all(len(ticks) == 4 for ticks in served_ticks(plans).values())
    for plan in plans:  # (a step's widest share at most twice its narrowest)
        step = [shares[rid] for rid in plan.request_ids]
        assert max(step) <= 2 * min(step)


def test_without_a_ratio_reusing_edits_of_any_share_step_together():
    s = StepBatcher(BatcherConfig(max_share_ratio=None))
    for i, share in enumerate((0.05, 0.3, 0.6)):
        s.add(reusing(str(i), share, arrival=i))
    plans, _ = drain(s)
    assert {p.request_ids for p in plans} == {("0", "1", "2")}
    with pytest.raises(ValueError, match="max_share_ratio: 0.5 is below 1"):
        StepBatcher(BatcherConfig(max_share_ratio=0.5))


def test_the_request_served_least_recently_still_leads_among_shares():
    """A narrow edit beside a stream of wide ones (and the reverse) is never starved: it leads a
    step whenever it is the stalest."""
    s = batcher(16, 16, reusing("narrow", 0.05), reusing("wide1", 0.5, 1), reusing("wide2", 0.45, 2))
    plans, _ = drain(s)
    ticks = served_ticks(plans)
    assert len(ticks["narrow"]) == 4 and max_gap(ticks["narrow"]) <= 2
    assert all(("narrow" in p.request_ids) != ("wide1" in p.request_ids) for p in plans)
