"""The OpenAI images API's own checks and its mapping of Triton's errors, without a server
(tests/server/test_openai_api.py runs it against a real tritonserver)."""

from __future__ import annotations

import socket

import pytest

# requirements.txt installs it; the GPU machine's image, which runs tests/unit for the gpu tier, does not.
pytest.importorskip("starlette", reason="starlette (easel openai's dependency) is not installed")

from starlette.testclient import TestClient  # noqa: E402

from clients.client import EaselError  # noqa: E402
from clients.openai_api import create_app, triton_error  # noqa: E402


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
