"""Bounded admission: past max_running + max_queue a denoiser refuses a request at
once with UNAVAILABLE instead of queueing it without end, and so does `easel` itself past
max_in_flight requests in flight. A flood of 64 shows it: some succeed, the rest
are refused quickly, the server stays ready and serves the next request."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from clients.bench.soak import rss_bytes
from clients.client import EaselClient, EaselError
from clients.procs import descendants
from clients.serve import TritonServer
from export.repository import export_repository
from tests.server.conftest import OPTIONS, metric_values

FLOOD = 64
REQUEST = dict(seed=1, steps=8, width=64, height=64)


@pytest.fixture(scope="module")
def bounded(tiny_model, tmp_path_factory):
    """A denoiser that holds at most 2 requests (1 running, 1 waiting); `easel` runs 9 at once
    (max_in_flight), more than that."""
    repo = tmp_path_factory.mktemp("bounded") / "repo"
    export_repository(tiny_model, repo, dataclasses.replace(OPTIONS, max_running=1, max_queue=1, max_in_flight=9))
    srv = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300).start()
    srv.wait_ready()
    yield srv
    srv.stop()


def one(url: str):
    start = time.monotonic()
    try:
        with EaselClient(url, protocol="grpc") as c:
            c.generate("a kite", **REQUEST)
        return "ok", time.monotonic() - start, ""
    except EaselError as err:
        return err.status, time.monotonic() - start, str(err)


def rss(server) -> int:
    """Resident bytes of tritonserver and every process under it (stubs, LoRA loaders)."""
    return sum(rss_bytes(pid) or 0 for pid in [server.pid, *descendants(server.pid)])


def test_a_flood_is_refused_at_once_past_the_bound(bounded):
    one(bounded.url_grpc)  # warm: first requests allocate what every later one reuses
    before = rss(bounded)
    with ThreadPoolExecutor(FLOOD) as pool:
        results = list(pool.map(one, [bounded.url_grpc] * FLOOD))
    # Memory stays bounded while it lasts: what was refused holds nothing (stated margin: the
    # soak's per-process bound, clients/bench/soak.py, for the whole tree).
    assert rss(bounded) - before < 160 * 2**20, (before, rss(bounded))
    served = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] != "ok"]
    assert served and refused, [r[0] for r in results]
    by_denoiser = [r for r in refused if r[2].startswith("denoiser: overloaded")]
    for status, _, message in refused:
        assert status == "StatusCode.UNAVAILABLE", (status, message)
        assert "overloaded" in message and "retry later" in message, message  # the denoiser's, or easel's
    # Refused at once: never waiting for a denoising of its own.
    slowest_refusal = sorted(r[1] for r in refused)[len(refused) // 2]
    assert slowest_refusal < sorted(r[1] for r in served)[-1], (slowest_refusal, served)
    refusals = metric_values(bounded, "easel_requests_total")
    assert by_denoiser and sum(v for k, v in refusals.items() if 'outcome="refused"' in k) == len(by_denoiser)
    assert max(metric_values(bounded, "easel_denoiser_pending").values()) == 0
    with EaselClient(bounded.url_grpc, protocol="grpc") as c:
        assert c.is_ready()
        assert c.generate("a kite", **REQUEST).image().size == (64, 64)
