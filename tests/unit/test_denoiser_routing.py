"""backends/core/serving/routing.py: requests go to the denoiser with the least outstanding work."""

from __future__ import annotations

import threading

import pytest

from backends.core.request.params import Limits, validate
from backends.core.serving.routing import LeastLoaded


def test_work_counts_steps_rows_and_pixels():
    def work(steps, guidance, size, left=None):
        return validate({"prompt": "x", "steps": steps, "guidance_scale": guidance, "width": size,
                         "height": size}, Limits(max_width=1024, max_height=1024)).work(left)

    assert work(50, 5.0, 1024) == 100.0
    assert work(50, 1.0, 1024) == 50.0  # no guidance: one row
    assert work(30, 5.0, 512) == 15.0
    assert work(30, 5.0, 512, left=3) == 1.5  # what is left of it


def test_equal_requests_go_round_in_turn():
    router = LeastLoaded(["a", "b", "c"])
    assert [router.pick(1.0) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_a_busy_denoiser_gets_nothing_until_the_others_catch_up():
    router = LeastLoaded(["a", "b"])
    assert router.pick(100.0) == "a"  # one long request
    assert [router.pick(1.0) for _ in range(5)] == ["b"] * 5  # round robin would send 2 of these to "a"
    router.release("a", 100.0)
    assert router.pick(1.0) == "a"


def test_released_work_never_goes_negative():
    router = LeastLoaded(["a", "b"])
    router.pick(0.1)
    router.release("a", 0.1 + 1e-12)
    assert router.outstanding["a"] == 0.0


def test_concurrent_picks_and_releases_balance_out():
    router = LeastLoaded(["a", "b", "c", "d"])

    def worker():
        for _ in range(500):
            router.release(router.pick(2.5), 2.5)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert router.outstanding == {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.0}


def test_no_denoisers_is_refused():
    with pytest.raises(ValueError, match="denoisers: none"):
        LeastLoaded([])


def test_a_published_load_counts_with_what_this_router_has_not_seen_admitted():
    """The board (what each denoiser says it holds, whoever sent it) decides; work this router
    sent is added until the denoiser admits it (the board shows it from then on); a denoiser
    with nothing on the board is counted by this router's own requests."""
    board = {"a": 40.0, "b": 10.0}
    router = LeastLoaded(["a", "b", "c"], board.get)
    router.outstanding["c"] = 25.0  # not on the board: this router's own count
    assert router.pick(20.0) == "b"  # 10 against 40 and 25
    assert router.load("b") == 30.0  # the board has not seen it yet
    assert router.pick(1.0) == "c"  # 25 against 40 and 30
    router.admitted("b", 20.0)
    board["b"] = 30.0  # ... and now the board has
    assert router.load("b") == 30.0
    board["a"] = 0.0  # a finished what another public model had sent it
    assert router.pick(1.0) == "a"
    router.release("c", 1.0, admitted=False)  # failed before its admission
    assert router.pending["c"] == 0.0 and router.outstanding["c"] == 25.0
