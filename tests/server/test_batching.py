"""Continuous batching does not change results: concurrent requests equal their lone runs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from clients.client import EaselClient
from tests.server.test_exact import pixels


def test_eight_concurrent_requests_equal_single_runs(server):
    # Two sizes, different seeds and step counts, so requests join and leave mid-flight.
    requests = [dict(seed=100 + i, steps=4 + i % 3, width=64 if i % 2 else 96, height=64,
                     guidance_scale=5.0) for i in range(8)]

    def run(req):
        with EaselClient(server.url_http) as c:
            return c.generate("a lighthouse in a storm", **req)

    singles = [pixels(run(r)) for r in requests]
    with ThreadPoolExecutor(max_workers=8) as pool:
        together = list(pool.map(run, requests))
    # A batch sums rows in another order: allow one uint8 level, as against diffusers.
    for single, result in zip(singles, together):
        assert int(np.abs(single.astype(int) - pixels(result).astype(int)).max()) <= 1
    assert all(0 < r.info["admit_s"] <= r.info["queue_s"] for r in together)
    # They really shared steps: some request ran in a batch of several.
    assert max(r.info["max_batch"] for r in together) > 1
