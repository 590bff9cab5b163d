"""`easel` sends each request to the denoiser with the least outstanding work
(backends/core/serving/routing.py), on the two-denoiser server of conftest: while one denoiser runs a
long request, short ones go to the other (a round robin would send every second one to the busy
denoiser, where it would wait on or slow the long one), also when the long one came through the
other public model, `easel_stream`, whose requests only the denoisers' load board shows."""

from __future__ import annotations

import threading
import time

import pytest

from backends.core.serving.load_board import LoadReader
from clients.client import EaselClient, GenerateRequest, GenerateResult
from tests.server.conftest import metric_values

STEPS = "easel_denoiser_step_rows_count"


def run_long_unary(url: str) -> GenerateResult:
    with EaselClient(url, protocol="grpc") as c:
        return c.generate("a long one", seed=1, steps=50, width=256, height=256, timeout_s=300)


def run_long_streamed(url: str) -> GenerateResult:
    with EaselClient(url, protocol="grpc") as c:
        *_, result = c.stream(GenerateRequest("a long one", seed=1, steps=50, width=256, height=256), timeout_s=300)
        return result


def settled_steps(server, period_s: float = 0.6, timeout_s: float = 30.0) -> dict:
    """The step counts once they stop moving: the denoisers flush their histograms every 0.5 s, so
    an earlier test's last steps may still arrive (and would look like this test's long request)."""
    last, deadline = metric_values(server, STEPS), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(period_s)
        now = metric_values(server, STEPS)
        if now == last:
            return now
        last = now
    raise AssertionError("the denoisers' step counts never settled")


@pytest.mark.parametrize("run_long", [run_long_unary, run_long_streamed], ids=["unary", "streamed"])
def test_short_requests_go_around_a_denoiser_busy_with_a_long_one(shared, run_long):
    before = settled_steps(shared)
    long: dict = {}

    def long_one():
        long["result"] = run_long(shared.url_grpc)

    thread = threading.Thread(target=long_one, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while True:  # until the long request's denoiser has run steps (the histogram flushes every 0.5 s)
        busy = [labels for labels, v in metric_values(shared, STEPS).items() if v >= before.get(labels, 0) + 2]
        if busy:
            break
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.1)
    board = LoadReader(server_pid=shared.proc.pid)
    seen = []  # the boards before each short request (what the routers read): in the failure message
    with EaselClient(shared.url_grpc, protocol="grpc") as c:
        short = []
        for i in range(3):
            seen.append({name: board(name) for name in ("denoiser_cpu0", "denoiser_cpu1")})
            short.append(c.generate("a short one", seed=i, steps=2, width=64, height=64).info["denoiser"])
    assert thread.is_alive(), "the long request ended before the short ones: make it longer"
    thread.join(300)
    busy_model = long["result"].info["denoiser"]
    assert busy == [f'model="{busy_model}"'], (busy, busy_model)
    # One string (a tuple's repr is cut short in pytest's report, and with it the idle board's rate)
    read = "; ".join(f"{name}: work {load.work}, seconds {load.seconds}, row_step_s {load.row_step_s}"
                     if load is not None else f"{name}: no board" for boards in seen for name, load in boards.items())
    assert len(set(short)) == 1 and short[0] != busy_model, f"shorts {short}, long on {busy_model}; boards: {read}"
