"""`easel serve`'s public gRPC port (clients/grpc_front.py) in front of a real tritonserver: calls
pass as they are (images, refusals with their status, streams, cancels), and the header
`triton_grpc_error` never reaches Triton. With it, Triton 2.51 ends a stream at its first error
and, under load, crashes: 4 x 300 refusals with the header sent straight to tritonserver crashed
it in 3 of 5 runs on a 2-core CPU machine (tests/server/test_stream.py), so the same load goes
through the front here."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from clients.client import EaselClient, EaselError, GenerateRequest, build_inputs
from clients.grpc_front import GrpcFront
from tests.server.test_cancel import LONG, counters, settled_total, wait_for_cancel
from tests.server.conftest import metric_total
from tests.server.test_exact import pixels

SMALL = dict(seed=3, steps=2, width=64, height=64)
HEADER = {"triton_grpc_error": "true"}


@pytest.fixture(scope="module")
def front(server):
    f = GrpcFront(server.url_grpc, 0, host="127.0.0.1").start()
    yield f"localhost:{f.port}"
    f.stop(grace_s=0)


def stream_answers(url: str, requests: list[GenerateRequest], headers=None) -> list[list]:
    """Each request sent in turn on one stream; the answers (result, error) of each, up to its
    image or its error."""
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=headers)
    out = []
    try:
        for request in requests:
            client.async_stream_infer("easel_stream", build_inputs(request, "grpc"))
            got = []
            while True:
                result, error = answers.get(timeout=120)
                got.append((result, error))
                if error is not None or result.as_numpy("image") is not None:
                    break
            out.append(got)
    finally:
        client.stop_stream()
        client.close()
    return out


def test_calls_pass_the_front_as_they_are(server, front):
    with EaselClient(front, protocol="grpc") as through, EaselClient(server.url_grpc, protocol="grpc") as direct:
        assert through.is_ready()
        a, b = through.generate("a cat", **SMALL), direct.generate("a cat", **SMALL)
        assert a.info["seed"] == b.info["seed"] and int(np.abs(pixels(a).astype(int) - pixels(b)).max()) <= 1
        with pytest.raises(EaselError) as err:
            through.generate("a cat", **{**SMALL, "width": 60})
        assert err.value.status == "StatusCode.INVALID_ARGUMENT" and "width: 60 is not a multiple of 8" in str(err.value)
        steps = list(through.stream(GenerateRequest("a cat", **SMALL)))
        assert len(steps) == SMALL["steps"] + 1 and steps[-1].image().size == (64, 64)


def test_a_cancel_through_the_front_stops_the_denoiser(server, front):
    before = counters(server)
    ran = settled_total(server, "easel_denoiser_step_rows_count")
    client = grpcclient.InferenceServerClient(front)
    call = client.async_infer("easel", build_inputs(GenerateRequest("a lighthouse", **LONG), "grpc"),
                              callback=lambda result, error: None)
    end = time.monotonic() + 60
    while metric_total(server, "easel_denoiser_step_rows_count") < ran + 2:
        assert time.monotonic() < end, "the denoiser never started the request"
        time.sleep(0.1)
    call.cancel()
    assert 2 <= wait_for_cancel(server, before) < LONG["steps"]
    client.close()


def test_the_front_drops_triton_grpc_error(front):
    """The header would have Triton end the stream at the refusal; through the front the refusal
    comes as a message (its status in band) and the same stream serves the next request."""
    refused, served = stream_answers(front, [GenerateRequest("a cat", **{**SMALL, "width": 60}),
                                             GenerateRequest("a cat", **SMALL)], headers=HEADER)
    (_, error), = refused
    assert error.message().startswith("INVALID_ARGUMENT: width: 60"), error.message()
    assert served[-1][1] is None and served[-1][0].as_numpy("image") is not None


def test_refusals_with_the_header_leave_tritonserver_up(server, front):
    refusals = [GenerateRequest("a cat", **{**SMALL, "width": 60}), GenerateRequest("a cat", **{**SMALL, "steps": 0})]
    errors = []

    def refuse(n):
        for i in range(n):
            (answer,) = stream_answers(front, [refusals[i % 2]], headers=HEADER)
            errors.append(answer[-1][1] is not None)

    threads = [threading.Thread(target=refuse, args=(300,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.proc.poll() is None, "tritonserver died"
    assert errors == [True] * 1200
    (served,) = stream_answers(front, [GenerateRequest("a cat", **SMALL)], headers=HEADER)
    assert served[-1][0].as_numpy("image") is not None
