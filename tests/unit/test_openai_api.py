"""The OpenAI images API's own checks and its mapping of Triton's errors, without a server
(tests/server/test_openai_api.py runs it against a real tritonserver)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

# requirements.txt installs it; the GPU machine's image, which runs tests/unit for the gpu tier, does not.
pytest.importorskip("starlette", reason="starlette (easel openai's dependency) is not installed")

from starlette.testclient import TestClient  # noqa: E402

from clients.client import EaselError  # noqa: E402
from clients.openai_api import create_app, triton_error, uvicorn_config  # noqa: E402


@pytest.mark.parametrize("status, message, http, param", [
    ("StatusCode.INVALID_ARGUMENT", "width: 100 is not a multiple of 8", 400, "size"),
    ("StatusCode.INVALID_ARGUMENT", "controlnets[0]: '../x' is not a valid adapter name", 400, "controlnets"),
    ("StatusCode.NOT_FOUND", "loras: unknown LoRA 'nosuch'", 404, "loras"),
    ("StatusCode.UNAVAILABLE", "denoiser queue is full (8 waiting)", 503, None),
    ("StatusCode.NOT_FOUND", "Request for unknown model: 'easel' has no available versions", 503, None),
    ("StatusCode.RESOURCE_EXHAUSTED", "too many", 429, None),
    ("StatusCode.DEADLINE_EXCEEDED", "Deadline Exceeded", 504, None),
    ("StatusCode.INTERNAL", "steps: boom in /opt/easel/backends/x.py line 3", 500, None),
    ("StatusCode.CANCELLED", "cancelled", 500, None),
    ("400", "seed: -5 is outside [0, 9223372036854775807]", 400, "seed"),
])
def test_triton_statuses_map_to_http(status, message, http, param):
    err = triton_error(EaselError(message, status))
    assert (err.status, err.param) == (http, param), (err.status, err.param, err.message)
    assert "/opt/" not in err.message and "x.py" not in err.message


def test_unreachable_triton_is_503_without_its_address():
    for status in ("StatusCode.UNAVAILABLE", None):
        err = triton_error(EaselError("failed to connect to all addresses; last error: "
                                      "ipv4:10.1.2.3:8001: Connection refused", status))
        assert err.status == 503 and "10.1.2.3" not in err.message


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_client():
    # Nothing listens on the Triton port: requests that pass validation get 503.
    with TestClient(create_app(f"127.0.0.1:{_closed_port()}", timeout_s=10)) as c:
        yield c


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "size": "64by64"}, 400, "size"),
    ({"prompt": "x", "stepz": 2}, 400, "stepz"),
    ({"prompt": "x", "response_format": "url"}, 400, "response_format"),
    ({"prompt": "x", "n": 5}, 400, "n"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"size": "64x64"}, 400, "prompt"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format"),
    ({"prompt": "x", "controlnets": [{"name": "canny", "image": "%%"}]}, 400, "controlnets.0.image"),
    ({"prompt": "x", "loras": [{"name": "papercut", "scal": 1}]}, 400, "loras.0.scal"),
    ({"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model"),
    ({"prompt": "x", "size": "64x64", "quality": "hd", "style": "vivid", "user": "u"}, 503, None),
])
def test_request_checks(app_client, body, status, param):
    r = app_client.post("/v1/images/generations", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_not_json_and_unknown_routes_are_openai_errors(app_client):
    r = app_client.post("/v1/images/generations", content=b"{nope",
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = app_client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert [m["id"] for m in app_client.get("/v1/models").json()["data"]] == ["easel"]


def test_docs_only_when_asked(app_client):
    assert app_client.get("/docs").status_code == 404 and app_client.get("/openapi.json").status_code == 404
    with TestClient(create_app(f"127.0.0.1:{_closed_port()}", docs=True)) as c:
        assert c.get("/docs").status_code == 200 and c.get("/openapi.json").status_code == 200


def test_readiness_follows_triton(app_client):
    r = app_client.get("/health/ready")
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


LIMIT = 1000  # body bytes, for the server below


@pytest.fixture(scope="module")
def small_limits():
    """The API under uvicorn with a 1000-byte body limit, 1 s to send a body and 1 s to send
    headers (real sockets: what a slow or oversized client meets); (host, port)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    app = create_app(f"127.0.0.1:{_closed_port()}", max_body_bytes=LIMIT, body_timeout_s=1.0)
    server = uvicorn.Server(uvicorn_config(app, header_timeout_s=1.0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end
        time.sleep(0.05)
    yield sock.getsockname()
    server.should_exit = True
    thread.join(30)
    sock.close()


def exchange(address, data: bytes, wait_s: float = 10.0) -> bytes:
    """Send `data` (and nothing more), then read until the server closes the connection."""
    with socket.create_connection(address, timeout=wait_s) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


HEAD = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def test_a_body_over_the_limit_is_refused_before_it_is_read(small_limits):
    answer = exchange(small_limits, HEAD + b"Content-Length: 10000000000\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer
    # Without a length (chunked): refused once what arrived passes the limit.
    chunk = b'{"prompt": "' + b"x" * 600
    answer = exchange(small_limits, HEAD + b"Transfer-Encoding: chunked\r\n\r\n"
                      + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 2)
    assert answer.startswith(b"HTTP/1.1 413")


def test_a_slow_body_and_slow_headers_are_cut_off(small_limits):
    start = time.monotonic()
    answer = exchange(small_limits, HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\"")
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
    assert time.monotonic() - start < 5
    start = time.monotonic()
    assert exchange(small_limits, b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n") == b""
    assert time.monotonic() - start < 5
    # A request within the limits still passes them (and meets the unreachable Triton: 503).
    body = b'{"prompt": "a cat"}'
    answer = exchange(small_limits, HEAD + b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert answer.startswith(b"HTTP/1.1 503")
