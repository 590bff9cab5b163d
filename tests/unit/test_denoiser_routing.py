"""backends/core/serving/routing.py: requests go to the denoiser with the least outstanding work, in
predicted seconds (mask-aware) where every denoiser has measured its steps, else in row-steps."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from backends.core.request.params import Limits, validate
from backends.core.engine.step_cost import WINDOW
from backends.core.serving.load_board import Load
from backends.core.serving.routing import STALE_S, LeastLoaded, Pick, RequestCost


def test_work_counts_steps_rows_and_pixels():
    def work(steps, guidance, size, left=None):
        return validate({"prompt": "x", "steps": steps, "guidance_scale": guidance, "width": size,
                         "height": size}, Limits(max_width=1024, max_height=1024)).work(left)

    assert work(50, 5.0, 1024) == 100.0
    assert work(50, 1.0, 1024) == 50.0  # no guidance: one row
    assert work(30, 5.0, 512) == 15.0
    assert work(30, 5.0, 512, left=3) == 1.5  # what is left of it


def names(picks):
    return [p.name for p in picks]


def test_equal_requests_go_round_in_turn():
    router = LeastLoaded(["a", "b", "c"])
    assert names(router.pick(RequestCost(1.0)) for _ in range(6)) == ["a", "b", "c", "a", "b", "c"]


def test_a_busy_denoiser_gets_nothing_until_the_others_catch_up():
    router = LeastLoaded(["a", "b"])
    long = router.pick(RequestCost(100.0))
    assert long.name == "a"
    assert names(router.pick(RequestCost(1.0)) for _ in range(5)) == ["b"] * 5  # round robin: 2 of these to "a"
    router.release(long)
    assert router.pick(RequestCost(1.0)).name == "a"


def test_released_work_never_goes_negative():
    router = LeastLoaded(["a", "b"])
    router.pick(RequestCost(0.1))
    router.release(Pick("a", 0.1 + 1e-12, 0.0))
    assert router.outstanding["a"] == 0.0


def test_concurrent_picks_and_releases_balance_out():
    router = LeastLoaded(["a", "b", "c", "d"])

    def worker():
        for _ in range(500):
            router.release(router.pick(RequestCost(2.5)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert router.outstanding == {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}


def test_no_denoisers_and_unknown_measures_are_refused():
    with pytest.raises(ValueError, match="denoisers: none"):
        LeastLoaded([])
    with pytest.raises(ValueError, match="routing: 'pixels' is not one of seconds, work"):
        LeastLoaded(["a"], measure="pixels")


def test_a_published_load_counts_with_what_this_router_has_not_seen_admitted():
    """The board (what each denoiser says it holds, whoever sent it) decides; work this router
    sent is added until the denoiser admits it (the board shows it from then on); a denoiser
    with nothing on the board is counted by this router's own requests. Nothing measured yet:
    compared in work."""
    board = {"a": Load(40.0), "b": Load(10.0)}
    router = LeastLoaded(["a", "b", "c"], board.get)
    router.outstanding["c"] = 25.0  # not on the board: this router's own count
    to_b = router.pick(RequestCost(20.0))
    assert to_b.name == "b"  # 10 against 40 and 25
    assert router.loads(RequestCost(0.0))[1]["b"] == 30.0  # the board has not seen it yet
    to_c = router.pick(RequestCost(1.0))
    assert to_c.name == "c"  # 25 against 40 and 30
    router.admitted(to_b)
    board["b"] = Load(30.0)  # ... and now the board has
    assert router.loads(RequestCost(0.0))[1]["b"] == 30.0
    board["a"] = Load(0.0)  # a finished what another public model had sent it
    assert router.pick(RequestCost(1.0)).name == "a"
    router.release(to_c, admitted=False)  # failed before its admission
    assert router.pending["c"] == 0.0 and router.outstanding["c"] == 25.0


def measured(work, token_work=None, rate=0.02, dense=0.3, age_s=0.0):
    """A denoiser's board once it has measured steps (the last `age_s` ago): its held work priced
    as the denoiser does."""
    load = Load(work, None, rate, dense)
    return Load(work, load.price(work, work if token_work is None else token_work), rate, dense,
                time.monotonic() - age_s, WINDOW)


def test_seconds_see_what_masks_save_and_work_does_not():
    """Two denoisers with equal row-steps held: one runs whole requests, the other edits that
    reuse a template and compute a tenth of their tokens. In seconds the second is the less
    loaded; in work they tie and the turn decides."""
    board = {"whole": measured(100.0), "edits": measured(100.0, token_work=10.0)}
    assert LeastLoaded(["whole", "edits"], board.get).pick(RequestCost(10.0)).name == "edits"
    by_work = LeastLoaded(["whole", "edits"], board.get, measure="work")
    assert names(by_work.pick(RequestCost(0.0)) for _ in range(2)) == ["whole", "edits"]


def test_a_request_goes_where_it_would_finish_first():
    """A faster denoiser (half the seconds a row-step) with more held still finishes a new
    request sooner; the request's own seconds count, priced by its mask."""
    board = {"slow": measured(40.0, rate=0.04), "fast": measured(60.0, rate=0.02)}
    router = LeastLoaded(["slow", "fast"], board.get)
    mode, loads, own = router.loads(RequestCost(10.0, token_work=1.0))
    assert mode == "seconds" and loads["fast"] < loads["slow"]
    assert own["fast"] == pytest.approx(0.02 * (0.3 * 10.0 + 0.7 * 1.0))
    chosen = router.pick(RequestCost(10.0, token_work=1.0))
    assert chosen.name == "fast" and router.pending_s["fast"] == pytest.approx(own["fast"])
    router.admitted(chosen)
    assert router.pending_s["fast"] == 0.0 and router.pending["fast"] == 0.0


def test_an_idle_denoiser_whose_costs_are_old_is_compared_by_work():
    """The idle denoiser last stepped long ago, on other requests, and learned a rate that prices
    a short request above what the busy one has left (as CI saw: a 64 px request went to the busy
    denoiser). Its costs are too old to price with: compared by work, the idle one takes it."""
    board = {"idle": measured(0.0, rate=200.0, age_s=STALE_S + 5), "busy": measured(4.5, rate=0.34)}
    short = RequestCost(2 / 128)
    assert board["idle"].price(short.work, short.work) > board["busy"].seconds
    mode, loads, _ = LeastLoaded(["idle", "busy"], board.get).loads(short)
    assert mode == "work" and loads == {"idle": 0.0, "busy": 4.5}
    board["idle"] = dataclasses.replace(board["idle"], measured_at=time.monotonic(), measured_steps=2)
    assert LeastLoaded(["idle", "busy"], board.get).loads(short)[0] == "work"  # two first steps: not yet
    board["idle"] = measured(0.0, rate=200.0, age_s=1.0)  # a full window, measured lately: its rate counts
    assert LeastLoaded(["idle", "busy"], board.get).loads(short)[0] == "seconds"


def test_seconds_wait_for_every_denoiser_to_have_measured():
    board = {"a": measured(50.0), "b": Load(10.0)}  # b has not run a step yet
    mode, loads, _ = LeastLoaded(["a", "b"], board.get).loads(RequestCost(1.0))
    assert mode == "work" and loads == {"a": 50.0, "b": 10.0}


def test_a_template_edit_goes_where_its_recording_is_unless_that_denoiser_is_busier_than_it_saves():
    """A template edit costs its mask's share only where the template was served before (the
    recording is there); elsewhere it would record, whole. Measured in work, templates are not seen."""
    board = {"a": measured(10.0), "b": measured(10.0)}
    router = LeastLoaded(["a", "b"], board.get)
    edit = RequestCost(10.0, token_work=1.0, template=("door", 64))
    first = router.pick(edit)  # nobody holds it: priced whole everywhere, the turn decides
    assert first.seconds == pytest.approx(0.02 * 10.0)
    router.admitted(first)
    router.release(first, served=True)
    holder, other = first.name, "b" if first.name == "a" else "a"
    board[holder] = measured(15.0)  # busier than the other by 5 row-steps (0.1 s) ...
    again = router.pick(edit)  # ... less than the recording saves there (10 whole vs 1 masked: 0.126 s)
    assert again.name == holder and again.seconds == pytest.approx(0.02 * (0.3 * 10.0 + 0.7 * 1.0))
    router.admitted(again)
    router.release(again)  # failed: nothing learnt
    board[holder] = measured(30.0)  # now busier by more than it saves
    assert router.pick(edit).name == other
    assert router.pick(RequestCost(10.0, token_work=1.0, template=("window", 64))).seconds == pytest.approx(0.2)
    blind = LeastLoaded(["a", "b"], {"a": measured(15.0), "b": measured(10.0)}.get, measure="work")
    blind.holders[("door", 64)] = {"a"}
    assert blind.pick(edit).name == "b"
