"""The denoiser's loop thread on the real engine (tiny model, CPU): join, leave, cancel, fail, stop."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.engine.loop import DenoiseLoop, DenoiseResult
from backends.core.request.params import Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.engine.step_batcher import BatcherConfig
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository

# A request batched with another rounds differently from one run alone (CPU fp32 GEMMs pick
# other paths): latents of magnitude ~10 moved by up to 1.6e-5 here.
BATCHED_TOL = 5e-5


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    repo = export_repository(tiny_model, tmp_path_factory.mktemp("loop") / "repo", ExportOptions())
    return TorchDenoiser(repo / "denoiser" / "1", Placement()), PromptEncoder(repo / "text_encoder" / "1", Placement())


class Results:
    def __init__(self):
        self.done: dict[str, DenoiseResult] = {}
        self.event = threading.Condition()

    def __call__(self, result: DenoiseResult) -> None:
        with self.event:
            self.done[result.request_id] = result
            self.event.notify_all()

    def wait(self, ids, timeout=120):
        with self.event:
            assert self.event.wait_for(lambda: all(i in self.done for i in ids), timeout), self.done.keys()
        return [self.done[i] for i in ids]


def job(encoder, rid, steps=4, size=64, seed=1, scheduler=None, **kw):
    params = validate({"prompt": "a cat", "steps": steps, "width": size, "height": size, "seed": seed,
                       "scheduler": scheduler}, Limits())
    embeds, pooled = encoder.encode(params)
    return DenoiseJob(request_id=rid, params=params, prompt_embeds=embeds, pooled_embeds=pooled, **kw)


def run(engine, jobs, config=BatcherConfig()):
    results = Results()
    loop = DenoiseLoop(engine, results, config)
    loop.start()
    for j in jobs:
        loop.submit(j)
    out = results.wait([j.request_id for j in jobs])
    loop.shutdown()
    return out


def test_cancelled_request_leaves_and_others_finish_unchanged(engines):
    engine, encoder = engines
    alone = run(engine, [job(encoder, "a", steps=6)])[0]
    cancelled = threading.Event()
    cancelled.set()  # the client is gone from the start: b must leave long before its 40 steps
    a, b = run(engine, [job(encoder, "a", steps=6), job(encoder, "b", steps=40, is_cancelled=cancelled.is_set)])
    assert b.error == "cancelled by the client" and b.latents is None and b.steps < 40 and b.outcome == "cancelled"
    assert a.error is None and np.abs(a.latents - alone.latents).max() <= BATCHED_TOL


def test_bad_job_is_refused_alone(engines):
    engine, encoder = engines
    good = job(encoder, "good")
    bad = job(encoder, "bad")
    bad.prompt_embeds = bad.prompt_embeds[:1]  # one row where CFG needs two
    good_out, bad_out = run(engine, [good, bad])
    assert "prompt_embeds: has shape (1, 77, 64), expected (2, 77, 64)" in bad_out.error and bad_out.latents is None
    assert bad_out.outcome == "invalid"  # the caller's mistake (the denoiser can be called directly)
    assert good_out.error is None and good_out.steps == 4 and good_out.outcome == "finished"


def test_embeddings_of_another_width_never_join_a_batch(engines):
    """They would fail the whole step, the good request's too."""
    engine, encoder = engines
    good, bad = job(encoder, "good"), job(encoder, "bad")
    bad.prompt_embeds = np.zeros((2, 77, 65), np.float32)
    good_out, bad_out = run(engine, [good, bad])
    assert bad_out.outcome == "invalid" and "expected (2, 77, 64)" in bad_out.error
    assert good_out.outcome == "finished"


def test_a_passed_deadline_stops_the_request_at_a_step_boundary(engines):
    engine, encoder = engines
    import time

    late = job(encoder, "late", steps=150, deadline=time.monotonic() + 0.3)
    (out,) = run(engine, [late])
    assert out.outcome == "cancelled" and out.latents is None and out.steps < 150
    assert "its deadline passed" in out.error


def test_requests_of_two_sizes_interleave_and_share_steps(engines):
    engine, encoder = engines
    jobs = [job(encoder, f"r{i}", steps=3 + i, size=64 if i % 2 else 96, seed=i) for i in range(6)]
    out = run(engine, jobs, BatcherConfig(max_running=6, max_batch_rows=6))
    assert all(r.error is None and r.steps == 3 + i for i, r in enumerate(out))
    assert max(r.max_batch for r in out) == 3  # three CFG requests of one size fill 6 rows


def test_shutdown_fails_what_is_left(engines):
    engine, encoder = engines
    results = Results()
    loop = DenoiseLoop(engine, results)
    loop.start()
    loop.submit(job(encoder, "long", steps=150))
    loop.shutdown()
    (left,) = results.wait(["long"], timeout=10)
    assert left.error == "the denoiser is shutting down"


def lora_job(engine_encoder, tiny_model, rid, bound, pending=None, steps=6):
    from backends.core.adapters.store import AdapterStore
    from backends.core.adapters.lora import load_lora

    _, encoder = engine_encoder
    j = job(encoder, rid, steps=steps)
    store = AdapterStore(tiny_model / "adapters")
    loras = ((load_lora("papercut", store.lora("papercut").path), 1.0),)
    if pending is None:
        j.loras = loras
    else:
        j.loras_pending, j.lora_bound = pending, bound
    return j, loras


def test_lora_bound_zero_waits_and_is_exact(engines, tiny_model):
    from concurrent.futures import Future

    engine, _ = engines
    exact_job, loras = lora_job(engines, tiny_model, "exact", 0)
    exact = run(engine, [exact_job])[0]
    pending: Future = Future()
    threading.Timer(0.5, pending.set_result, args=(loras,)).start()  # the load lands later
    waited_job, _ = lora_job(engines, tiny_model, "waited", 0, pending)
    waited = run(engine, [waited_job])[0]
    assert waited.lora_step == 0 and exact.lora_step == 0
    assert np.array_equal(waited.latents, exact.latents)


def test_lora_lands_at_the_bound_and_moves_the_result_a_little(engines, tiny_model):
    from concurrent.futures import Future

    engine, _ = engines
    exact_job, loras = lora_job(engines, tiny_model, "exact", 0)
    exact = run(engine, [exact_job])[0]
    pending: Future = Future()
    results = Results()
    loop = DenoiseLoop(engine, results)
    loop.start()
    bounded, _ = lora_job(engines, tiny_model, "bounded", 2, pending)
    loop.submit(bounded)
    seq = None
    for _ in range(200):  # it runs steps 0 and 1 without the LoRA, then waits at the bound
        seq = loop.batcher.find("bounded")
        if seq is not None and seq.steps_done == 2:
            break
        threading.Event().wait(0.05)
    threading.Event().wait(0.3)
    assert seq is not None and seq.steps_done == 2  # still waiting: not past the bound
    pending.set_result(loras)
    (out,) = results.wait(["bounded"])
    loop.shutdown()
    assert out.error is None and out.lora_step == 2 and out.lora_waited
    assert out.lora_wait_s >= 0.3  # held at least as long as the test kept the load pending
    deviation = np.abs(out.latents - exact.latents).max()
    assert 0 < deviation < np.abs(exact.latents).max()


def test_lora_bound_past_the_last_step_still_applies_the_lora(engines, tiny_model):
    from concurrent.futures import Future

    engine, _ = engines
    pending: Future = Future()
    threading.Timer(1.0, pending.set_result, args=(lora_job(engines, tiny_model, "x", 0)[1],)).start()
    late, _ = lora_job(engines, tiny_model, "late", 50, pending, steps=4)
    (out,) = run(engine, [late])
    assert out.error is None and out.lora_step == 3 and out.lora_waited


def test_failed_lora_load_fails_its_request(engines, tiny_model):
    from concurrent.futures import Future

    engine, encoder = engines
    pending: Future = Future()
    pending.set_exception(ValueError("loras: 'x' cannot be read as a LoRA"))
    bad, _ = lora_job(engines, tiny_model, "bad", 1, pending)
    good = job(encoder, "good")
    bad_out, good_out = run(engine, [bad, good])
    assert "cannot be read" in bad_out.error and good_out.error is None


def misfit(loras):
    """The LoRA set with one layer a column too wide for the UNet; that layer and its right shape."""
    ((lora, scale),) = loras
    module, layer = next(iter(lora.unet.items()))
    wide = dataclasses.replace(layer, down=torch.ones(layer.down.shape[0], layer.down.shape[1] + 1))
    return ((dataclasses.replace(lora, unet={**lora.unet, module: wide}), scale),), module, \
        (layer.up.shape[0], layer.down.shape[1])


@pytest.mark.parametrize("bound", [0, 2], ids=["before-step-0", "mid-denoise"])
def test_lora_that_does_not_fit_fails_its_request_alone(engines, tiny_model, bound):
    """It arrives while another request runs beside it: it fails with the layer named, the other
    finishes as if alone, and the UNet keeps its base weights."""
    from concurrent.futures import Future

    engine, encoder = engines
    base = {k: v.clone() for k, v in engine.unet.state_dict().items()}
    alone = run(engine, [job(encoder, "alone", steps=6)])[0]
    pending: Future = Future()
    bad_job, loras = lora_job(engines, tiny_model, "bad", bound, pending)
    wrong, module, shape = misfit(loras)
    threading.Timer(0.2, pending.set_result, args=(wrong,)).start()
    good_out, bad_out = run(engine, [job(encoder, "good", steps=6), bad_job])
    assert bad_out.error == (f"loras: 'papercut': layer {module} is ({shape[0]}, {shape[1] + 1}), "
                             f"the base model's is {shape}")
    assert good_out.error is None and np.abs(good_out.latents - alone.latents).max() <= BATCHED_TOL
    assert all(torch.equal(v, base[k]) for k, v in engine.unet.state_dict().items())


def test_lora_given_up_front_that_does_not_fit_is_refused_alone(engines, tiny_model):
    engine, encoder = engines
    bad_job, loras = lora_job(engines, tiny_model, "bad", 0)
    bad_job.loras, module, _ = misfit(loras)
    bad_out, good_out = run(engine, [bad_job, job(encoder, "good")])
    assert f"layer {module} is" in bad_out.error and good_out.error is None


def test_the_loop_publishes_the_work_it_holds(engines):
    """What the routers read (backends/core/serving/load_board.py): the submitted requests' work at once, then
    less at every step (steps left x rows x pixels), and 0 when they are done; predicted seconds
    once a step was measured, from the seconds a row-step took."""
    engine, encoder = engines
    published: list = []
    results = Results()
    loop = DenoiseLoop(engine, results, publish_load=published.append)
    jobs = [job(encoder, "a", steps=6), job(encoder, "b", steps=4, size=128)]
    for j in jobs:  # before the loop starts: only the submissions are counted
        loop.submit(j)
    total = sum(j.params.work() for j in jobs)
    assert [p.work for p in published] == [jobs[0].params.work(), total]
    assert published[-1].seconds is None  # nothing measured yet
    loop.start()
    results.wait(["a", "b"])
    loop.shutdown()
    work = [p.work for p in published]
    assert work[-1] == 0.0 and max(work) == pytest.approx(total)
    steps_done = [total - w for w in work[2:]]
    assert steps_done == sorted(steps_done)  # never more work than before: it only goes down
    assert len(set(work)) > 4  # every step told
    measured = [p for p in published if p.seconds is not None]
    assert measured and all(p.seconds == pytest.approx(p.work * p.row_step_s) for p in measured)  # no edits: dense
    assert loop.stats.cost.row_step_s > 0


@pytest.mark.parametrize("scheduler", ["euler", "euler_a", "dpmpp_2m_karras", "ddim"])
def test_requests_leave_the_shared_scheduler_prototype_as_it_was(engines, scheduler):
    """Vectorized requests read the (scheduler, steps) prototype they all share: running two
    (one batched beside the other) changes none of its state, and a third alike gives what the
    first gave."""
    engine, encoder = engines
    prototype = engine.schedulers.shared(scheduler, 4)
    before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(prototype).items()
              if not k.startswith("_config") and k != "config"}
    first = run(engine, [job(encoder, "a", steps=4, seed=5, scheduler=scheduler)])[0]
    run(engine, [job(encoder, "b", steps=4, seed=6, scheduler=scheduler),
                 job(encoder, "c", steps=4, seed=7, scheduler=scheduler)])
    again = run(engine, [job(encoder, "d", steps=4, seed=5, scheduler=scheduler)])[0]
    assert engine.schedulers.shared(scheduler, 4) is prototype
    after = vars(prototype)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(after[key], value), key
        else:
            assert after[key] == value, key
    np.testing.assert_array_equal(again.latents, first.latents)


def test_a_workflow_plugs_into_the_runner_and_an_unknown_one_is_refused(engines):
    """A new task is a workflow file: the runner asks the job's workflow for the UNet input and
    hands it the noise prediction. One that wraps txt2img gives txt2img's latents, sharing each
    step with txt2img's requests (the runner gives each workflow its own requests' rows)."""
    from backends.core.engine.workflows.txt2img import Txt2Img

    engine, encoder = engines
    calls = []

    class Recorded(Txt2Img):
        name = "recorded"

        def model_input(self, states):
            calls.append(("model_input", [s.job.request_id for s in states]))
            return super().model_input(states)

        def advance(self, states, noise, failed):
            calls.append(("advance", [s.job.request_id for s in states]))
            super().advance(states, noise, failed)

    engine.workflows["recorded"] = Recorded(engine.workflows["txt2img"].model)
    try:
        plain, recorded, unknown = run(engine, [job(encoder, "p"), job(encoder, "r", workflow="recorded"),
                                                job(encoder, "u", workflow="nosuch")])
    finally:
        del engine.workflows["recorded"]
    assert calls == [("model_input", ["r"]), ("advance", ["r"])] * 4
    assert plain.error is None and recorded.error is None and plain.max_batch == recorded.max_batch == 2
    np.testing.assert_allclose(plain.latents, recorded.latents, rtol=0, atol=BATCHED_TOL)
    assert unknown.latents is None and unknown.error.startswith("workflow: 'nosuch' is not one of [")
