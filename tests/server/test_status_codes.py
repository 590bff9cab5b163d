"""Each failure carries the status of what happened: the client's mistake
INVALID_ARGUMENT / 400, an adapter the store does not hold NOT_FOUND / 404, and only our own
faults INTERNAL / 500; messages echo at most ~100 characters of a value and a refused request
logs one line, not a traceback."""

from __future__ import annotations

import time
import uuid

import pytest

from clients.client import EaselClient, EaselError

SMALL = dict(seed=1, steps=2, width=64, height=64)
NOT_FOUND = {"grpc": "StatusCode.NOT_FOUND", "http": "404"}
INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}


@pytest.mark.parametrize("controls, expected", [
    (dict(loras=("nosuch",)), "loras: unknown LoRA 'nosuch'"),
    (dict(controlnets=("nosuch",), control_images=()), "controlnets: unknown ControlNet 'nosuch'"),
])
def test_unknown_adapter_is_not_found(client, controls, expected):
    if "controlnets" in controls:
        from tests.server.test_controlnet import png

        controls = {**controls, "control_images": (png(0),)}
    with pytest.raises(EaselError) as err:
        client.generate("a cat", **SMALL, **controls)
    assert expected in str(err.value)
    assert err.value.status == NOT_FOUND[client.protocol], err.value.status
    assert client.generate("a cat", **SMALL).image().size == (64, 64)


def test_a_huge_value_comes_back_short(client):
    """A 9,000-byte scheduler name: refused with a short message (gRPC used to drop the stream
    with RESOURCE_EXHAUSTED, the whole value no longer fitting its metadata)."""
    with pytest.raises(EaselError) as err:
        client.generate("a cat", **SMALL, scheduler="x" * 9000)
    message = str(err.value)
    assert "scheduler: unknown name 'xxxx" in message and "(9000 long)" in message
    assert len(message) < 400, len(message)
    assert err.value.status == INVALID[client.protocol]
    assert client.generate("a cat", **SMALL).image().size == (64, 64)


def test_a_refused_request_logs_one_line(server, http_client):
    marker = f"nosuch-{uuid.uuid4().hex[:8]}"
    for kwargs in (dict(scheduler=marker), dict(loras=(marker,))):
        with pytest.raises(EaselError):
            http_client.generate("a cat", **SMALL, **kwargs)
    time.sleep(1.0)  # the server's log is written by its own threads
    lines = [line for line in server.log_text().splitlines() if marker in line]
    assert len(lines) == 2, lines  # one a request, at warning level
    assert all(line.startswith("W") for line in lines), lines
    log = server.log_text()
    assert "Traceback" not in log[log.index(marker):], "a refused request logged a traceback"
