"""The denoiser's queue and step metrics on the metrics port, through a real server:
requests through `easel` and a flood straight into the denoiser (more than it runs at once, so
some queue), and one it refuses; the counts on the port must match what ran."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient

from clients.client import EaselClient
from clients.serve import scrape_metrics
from export.repository import ExportOptions

PREFIXES = ("easel_denoiser_", "easel_requests_total", "easel_denoise_steps_total")
PARTS = ("encoder", "decoder", "sampler", "orchestration")
HISTOGRAMS = ("easel_denoiser_step_rows", "easel_denoiser_step_seconds", "easel_denoiser_time_to_first_step_seconds")
# What preprocess would have made of a request (tests/server/conftest.py: max 256 px, 200 steps).
# 48 steps: the flood holds the running set full for dozens of steps, several of the gauges' periods
# even on a slow machine (with 12 a CI run sampled 8 running at most: full for under one period).
PARAMS = dict(prompt="a cat", negative_prompt=None, width=64, height=64, steps=48, guidance_scale=5.0, seed=1,
              scheduler="default", controls=[], loras=[], output_format="png", quality=None, trace={})
EASEL_STEPS, EASEL_REQUESTS = 6, 4
FLOOD = ExportOptions.max_running + 4  # straight into the denoiser: 4 must wait to join the batch


class Snapshot:
    """Every series of the families above, by name and label set."""

    def __init__(self, port: int):
        self.series: dict[str, list[tuple[dict[str, str], float]]] = {}
        for name, by_labels in scrape_metrics(port, prefixes=PREFIXES).items():
            self.series[name] = [(dict(re.findall(r'(\w+)="([^"]*)"', labels)), value)
                                 for labels, value in by_labels.items()]

    def get(self, name: str, model: str, **labels) -> float:
        """The one series of `name` with these labels (`le` compared as a number)."""
        want = {"model": model, **{k: v for k, v in labels.items() if k != "le"}}
        found = [value for got, value in self.series.get(name, [])
                 if {k: v for k, v in got.items() if k != "le"} == want
                 and ("le" not in labels or float(got["le"]) == labels["le"])]
        assert len(found) == 1, (name, labels, self.series.get(name))
        return found[0]


def denoiser_inputs(params: dict) -> list:
    def tensor(name, array, dtype):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    return [tensor("params", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES"),
            tensor("prompt_embeds", np.zeros((2, 77, 64), np.float32), "FP32"),
            tensor("pooled_embeds", np.zeros((2, 32), np.float32), "FP32"),
            tensor("control_images", np.array([b""], dtype=np.object_), "BYTES")]


def flood_denoiser(server, model: str, requests: list[dict]) -> list:
    """Requests on one gRPC stream into the decoupled denoiser, with the server's internal key;
    (result, error) per request."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.url_grpc)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, params in enumerate(requests):
            client.async_stream_infer(model, denoiser_inputs(params), request_id=str(i),
                                      parameters=server.internal_parameters)
        return [answers.get(timeout=300) for _ in requests]
    finally:
        client.stop_stream()


def settled(server, model: str, timeout: float = 60.0) -> Snapshot:
    """The port once the denoiser is idle and its metrics thread has caught up: nothing queued or
    running and the same numbers over two of its periods."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        snap = Snapshot(server.metrics_port)
        idle = (snap.get("easel_denoiser_queue_depth", model), snap.get("easel_denoiser_running", model)) == (0, 0)
        if idle and last is not None and snap.series == last.series:
            return snap
        assert time.monotonic() < deadline, f"the metrics did not settle: {snap.series}"
        last = snap
        time.sleep(1.2)


def test_queue_running_and_step_metrics_count_what_ran(server):
    with EaselClient(server.url_http) as c:
        model = c.generate("a cat", steps=2, width=64, height=64, seed=1).info["denoiser"]
    before = settled(server, model)

    # Gauges while the load runs, sampled faster than the denoiser refreshes them.
    peaks = {"easel_denoiser_queue_depth": 0.0, "easel_denoiser_running": 0.0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            snap = Snapshot(server.metrics_port)
            for name in peaks:
                peaks[name] = max(peaks[name], snap.get(name, model))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        def one(i):
            with EaselClient(server.url_http if i % 2 else server.url_grpc, protocol="http" if i % 2 else "grpc") as c:
                return c.generate("a lighthouse", steps=EASEL_STEPS, width=64, height=64, seed=10 + i)

        with ThreadPoolExecutor(EASEL_REQUESTS + 1) as pool:
            easel = [pool.submit(one, i) for i in range(EASEL_REQUESTS)]
            flood = pool.submit(flood_denoiser, server, model,
                                [{**PARAMS, "seed": i} for i in range(FLOOD)])
            infos = [f.result().info for f in easel]
            flooded = flood.result()
        (invalid,) = flood_denoiser(server, model, [{**PARAMS, "steps": 600}])
    finally:
        stop.set()
        watcher.join()
    assert all(error is None for _, error in flooded), [str(e) for _, e in flooded if e is not None]
    assert invalid[1] is not None and "steps: 600 is outside" in invalid[1].message()
    assert all(info["denoiser"] == model for info in infos)

    after = settled(server, model)

    def delta(name, **labels):
        return after.get(name, model, **labels) - before.get(name, model, **labels)

    finished, steps = EASEL_REQUESTS + FLOOD, EASEL_REQUESTS * EASEL_STEPS + FLOOD * PARAMS["steps"]
    assert delta("easel_requests_total", outcome="finished") == finished
    assert delta("easel_requests_total", outcome="invalid") == 1
    assert delta("easel_denoise_steps_total") == steps
    # Every request with guidance: 2 UNet rows per step it ran.
    assert delta("easel_denoiser_step_rows_sum") == 2 * steps
    batched = delta("easel_denoiser_step_rows_count")
    assert PARAMS["steps"] <= batched < steps  # requests shared steps
    # The flood filled steps to the row budget (16): more than 2 rows, up to 16, never more.
    assert delta("easel_denoiser_step_rows_bucket", le=2.0) < batched
    assert delta("easel_denoiser_step_rows_bucket", le=8.0) < batched
    assert delta("easel_denoiser_step_rows_bucket", le=16.0) == batched
    for part in PARTS:  # every step timed in each part
        assert delta("easel_denoiser_step_seconds_count", part=part) == batched, part
        assert delta("easel_denoiser_step_seconds_sum", part=part) >= 0, part
    for part in ("encoder", "decoder"):
        assert delta("easel_denoiser_step_seconds_sum", part=part) > 0, part
    # One time to first step per request that ran a step; the refused one never did.
    assert delta("easel_denoiser_time_to_first_step_seconds_count") == finished
    assert delta("easel_denoiser_time_to_first_step_seconds_sum") > sum(info["queue_s"] for info in infos)
    # While it ran: the denoiser's 16 running, the flood's 4 more waiting to join.
    assert peaks["easel_denoiser_running"] == ExportOptions.max_running, peaks
    assert peaks["easel_denoiser_queue_depth"] >= 1, peaks
    assert after.get("easel_denoiser_queue_depth", model) == 0 and after.get("easel_denoiser_running", model) == 0
    for name in HISTOGRAMS:  # each a histogram: the +Inf bucket holds every observation
        part = {"part": "sampler"} if name == "easel_denoiser_step_seconds" else {}
        assert after.get(f"{name}_bucket", model, le=float("inf"), **part) == after.get(f"{name}_count", model, **part)
