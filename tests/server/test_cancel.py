"""Cancellation frees the work: once a request's deadline passes, or its client
cancels it, the denoiser drops it at its next step boundary. Shown by the denoiser's own counters
(the steps it ran, the outcome), not only by the client's error."""

from __future__ import annotations

import time

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from clients.client import EaselClient, EaselError, GenerateRequest, build_inputs
from tests.server.conftest import metric_total, metric_values

# backends/triton/metrics.StepMetrics.PERIOD_S (that module needs Triton's stub to import)
STEP_METRICS_PERIOD_S = 0.5
LONG = dict(seed=1, steps=200, width=256, height=256)  # several seconds of CPU denoising (3.6 s on 2 cores)


def counters(server) -> tuple[float, float]:
    cancelled = sum(v for labels, v in metric_values(server, "easel_requests_total").items()
                    if 'outcome="cancelled"' in labels)
    return cancelled, metric_total(server, "easel_denoise_steps_total")


def settled_total(server, name: str) -> float:
    """`name`'s total once a whole flush period of the step metrics passed without it moving."""
    total = metric_total(server, name)
    while True:
        time.sleep(STEP_METRICS_PERIOD_S + 0.2)
        again = metric_total(server, name)
        if again == total:
            return total
        total = again


def wait_for_cancel(server, before: tuple[float, float], timeout: float = 30.0) -> float:
    """The steps the cancelled request ran, once the denoiser counted it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        cancelled, steps = counters(server)
        if cancelled > before[0]:
            return steps - before[1]
        time.sleep(0.2)
    pytest.fail("the denoiser never counted the request as cancelled")


def test_client_deadline_stops_the_denoiser_at_a_step_boundary(server):
    before = counters(server)
    with EaselClient(server.url_grpc, protocol="grpc") as c:
        with pytest.raises(EaselError) as err:
            c.generate("a lighthouse", timeout_s=1.0, **LONG)
        assert err.value.status in ("StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED")
        steps = wait_for_cancel(server, before)
        assert 0 <= steps < LONG["steps"], steps
        assert c.generate("a lighthouse", seed=1, steps=2, width=64, height=64).image().size == (64, 64)


def test_a_listening_client_gets_cancelled(server):
    """A client that sets only the request's timeout (the protocol's, in microseconds) and still
    listens gets CANCELLED, and the message says why."""
    before = counters(server)
    client = grpcclient.InferenceServerClient(server.url_grpc)
    inputs = build_inputs(GenerateRequest("a lighthouse", **LONG), "grpc")
    start = time.monotonic()
    with pytest.raises(InferenceServerException) as err:
        client.infer("easel", inputs, timeout=1_000_000, client_timeout=120)
    assert err.value.status() == "StatusCode.CANCELLED", err.value
    assert "deadline passed" in err.value.message()
    assert wait_for_cancel(server, before) < LONG["steps"]
    assert time.monotonic() - start < 30


def test_a_grpc_cancel_of_a_unary_request_stops_the_denoiser(server):
    """A client that cancels its unary gRPC request, with no deadline of its own: `easel` sees the
    cancel and has the denoiser drop the request at its next step (an ensemble would not: Triton
    2.51 passes the cancel on to none of its steps)."""
    before = counters(server)
    # Steps reach easel_denoise_steps_total when a request ends; the step histogram counts them as
    # they run, flushed every STEP_METRICS_PERIOD_S: an earlier test's last steps may still be on
    # their way, and counted as this request's they let the cancel come after one step, not two.
    ran = settled_total(server, "easel_denoiser_step_rows_count")
    client = grpcclient.InferenceServerClient(server.url_grpc)
    inputs = build_inputs(GenerateRequest("a lighthouse", **LONG), "grpc")
    call = client.async_infer("easel", inputs, callback=lambda result, error: None)
    end = time.monotonic() + 60
    while metric_total(server, "easel_denoiser_step_rows_count") < ran + 2:
        assert time.monotonic() < end, "the denoiser never started the request"
        time.sleep(0.1)
    call.cancel()
    steps = wait_for_cancel(server, before)
    assert 2 <= steps < LONG["steps"], steps
    with EaselClient(server.url_grpc, protocol="grpc") as c:
        assert c.is_ready()
        assert c.generate("a lighthouse", seed=1, steps=2, width=64, height=64).image().size == (64, 64)
