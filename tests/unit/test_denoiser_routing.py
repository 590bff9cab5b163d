"""backends/denoiser_routing.py: requests go to the denoiser with the least outstanding work."""

from __future__ import annotations

import threading

import pytest

from backends.denoiser_routing import LeastLoaded, request_work


def test_work_counts_steps_rows_and_pixels():
    assert request_work(50, True, 1024, 1024) == 100.0
    assert request_work(50, False, 1024, 1024) == 50.0
    assert request_work(30, True, 512, 512) == 15.0


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
