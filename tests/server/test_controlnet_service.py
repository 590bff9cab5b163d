"""One ControlNet service shared by two denoisers; its cache metrics; a broken ControlNet file
fails its request alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from clients.client import EaselClient, EaselError
from tests.server.conftest import metric_total, metric_values
from tests.server.test_controlnet import png
from tests.server.test_exact import pixels


def test_two_denoisers_share_one_controlnet_service(shared, server):
    req = dict(seed=3, steps=3, width=64, height=64, controlnets=("canny",), control_images=(png(5),))
    with EaselClient(server.url_http) as single:  # the one-denoiser repository of conftest
        expected = pixels(single.generate("a boat", **req))

    def run(_):
        with EaselClient(shared.url_http) as c:
            return c.generate("a boat", **req)

    counters = {"hits": "easel_controlnet_cache_hits_total", "misses": "easel_controlnet_cache_misses_total",
                "calls": "easel_controlnet_calls_total"}
    before = {k: metric_total(shared, name) for k, name in counters.items()}
    # `easel` sends each to the denoiser with the least outstanding work: concurrent equal requests
    # spread over both; rounds go on until both have served.
    results = []
    with ThreadPoolExecutor(max_workers=6) as pool:
        while len({r.info["denoiser"] for r in results}) < 2 and len(results) < 18:
            results += pool.map(run, range(6))
    assert {r.info["denoiser"] for r in results} == {"denoiser_cpu0", "denoiser_cpu1"}
    for r in results:
        assert int(abs(pixels(r).astype(int) - expected.astype(int)).max()) <= 1
    # 3 steps x one ControlNet call per row (this server's denoisers split guidance over two sides,
    # and the ControlNets with it: test_cfg_parallel.py), at most one miss per instance.
    calls = 3 * 2 * len(results)
    delta = {k: metric_total(shared, name) - before[k] for k, name in counters.items()}
    assert delta["hits"] + delta["misses"] == calls and delta["misses"] <= 2
    assert metric_total(shared, "easel_controlnet_resident") >= 1
    # Where the time went: the denoisers count the same calls, whose BLS wall time covers the
    # service's own time; the decoder half waited some of it.
    assert delta["calls"] == calls
    call_s, compute_s = (metric_total(shared, f"easel_controlnet_{k}_seconds_total") for k in ("call", "compute"))
    assert call_s >= compute_s > 0
    # The wall time's parts add up to it, and the BLS request holds the service's compute.
    parts = {k: metric_total(shared, f"easel_controlnet_call_{k}_seconds_total") for k in ("ready", "exec", "outputs")}
    assert sum(parts.values()) == pytest.approx(call_s, rel=1e-3) and parts["exec"] >= compute_s
    assert 0 < metric_total(shared, "easel_controlnet_wait_seconds_total") <= call_s


def test_broken_controlnet_file_fails_its_request_only(shared):
    """Truncated weights in the store are refused as a corrupt config or a truncated LoRA is: a
    400 that names the ControlNet (it was a 500)."""
    with EaselClient(shared.url_http) as c:
        with pytest.raises(EaselError, match="ControlNet 'broken' cannot be read") as err:
            c.generate("a boat", seed=1, steps=2, width=64, height=64, controlnets=("broken",),
                       control_images=(png(1),))
        assert err.value.status == "400", err.value.status
        ok = c.generate("a boat", seed=1, steps=2, width=64, height=64, controlnets=("depth",),
                        control_images=(png(1),))
        assert ok.image().size == (64, 64)
        assert c.is_ready()


def per_instance(server, name: str) -> dict[str, float]:
    return {labels.split('instance="', 1)[1].split('"', 1)[0]: value
            for labels, value in metric_values(server, name).items()}


def test_controlnets_of_one_request_spread_over_service_instances(shared):
    before = {k: per_instance(shared, f"easel_controlnet_cache_{k}_total") for k in ("hits", "misses")}
    with EaselClient(shared.url_http) as c:
        c.generate("a boat", seed=2, steps=3, width=64, height=64, controlnets=("canny", "depth"),
                   control_images=(png(1), png(2)))
    after = {k: per_instance(shared, f"easel_controlnet_cache_{k}_total") for k in ("hits", "misses")}
    calls = {i: sum(after[k].get(i, 0) - before[k].get(i, 0) for k in after) for i in after["hits"]}
    # Both ControlNets of each step, on each of the request's two rows (split with guidance), are
    # submitted at once; the two instances take them together.
    assert sum(calls.values()) == 3 * 2 * 2 and len([i for i, n in calls.items() if n > 0]) == 2, calls
