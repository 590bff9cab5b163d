"""`easel openai`: the OpenAI images API in front of a real tritonserver on the
tiny models, called with the official `openai` client and with raw HTTP for the error bodies."""

from __future__ import annotations

import base64
import io
import json
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from openai import OpenAI
from PIL import Image

from clients.client import EaselClient
from clients.openai_api import create_app, uvicorn_config
from tests.server.conftest import metric_values
from tests.server.test_cancel import LONG, counters, wait_for_cancel

SMALL = {"steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def api(server):
    """The API on a free loopback port, served by uvicorn in a background thread; its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn_config(create_app(server.url_grpc, timeout_s=300), lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(timeout=30)
    sock.close()


@pytest.fixture(scope="module")
def oai(api):
    return OpenAI(base_url=api, api_key="unused", max_retries=0, timeout=300)


def decode(b64: str) -> Image.Image:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return img


def rgb(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB")).astype(int)


def test_generate_with_the_openai_client_equals_easel(server, oai):
    res = oai.images.generate(prompt="a yellow car", size="64x64", response_format="b64_json",
                              extra_body=SMALL)
    assert len(res.data) == 1 and res.created > 0
    item = res.data[0]
    img = decode(item.b64_json)
    assert img.format == "PNG" and img.size == (64, 64)
    info = item.model_extra["info"]
    assert info["seed"] == 1 and info["steps"] == 2
    with EaselClient(server.url_grpc, protocol="grpc") as c:
        direct = c.generate("a yellow car", width=64, height=64, **SMALL)
    # The same request through `easel`: the same pixels (one uint8 level if batching differed).
    assert int(np.abs(rgb(img) - rgb(direct.image())).max()) <= 1


def test_n_images_take_consecutive_seeds(server, oai):
    res = oai.images.generate(prompt="a red boat", n=2, size="64x96", response_format="b64_json",
                              extra_body={**SMALL, "seed": 7, "output_format": "webp"})
    assert len(res.data) == 2
    images = [decode(d.b64_json) for d in res.data]
    assert all(i.format == "WEBP" and i.size == (64, 96) for i in images)
    assert [d.model_extra["info"]["seed"] for d in res.data] == [7, 8]
    assert not np.array_equal(rgb(images[0]), rgb(images[1]))
    assert res.size == "64x96" and res.output_format == "webp"  # fields of OpenAI's response too


def test_loras_and_controlnets_go_through(oai):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    control = base64.b64encode(buf.getvalue()).decode()
    res = oai.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body={
        **SMALL, "loras": [{"name": "papercut", "scale": 0.8}],
        "controlnets": [{"name": "canny", "image": control, "scale": 0.5}]})
    assert decode(res.data[0].b64_json).size == (64, 64)


@pytest.mark.parametrize("body, status, param, text", [
    ({"size": "64by64"}, 400, "size", "WIDTHxHEIGHT"),
    ({"size": "100x64"}, 400, "size", "width: 100 is not a multiple of 8"),  # Triton's refusal
    ({"stepz": 2}, 400, "stepz", "unknown parameter"),
    ({"response_format": "url"}, 400, "response_format", "b64_json"),
    ({"n": 5}, 400, "n", "limit of 4"),
    ({"scheduler": "heun"}, 400, "scheduler", "unknown name 'heun'"),
    ({"loras": [{"name": "nosuch"}]}, 404, "loras", "unknown LoRA 'nosuch'"),
    ({"model": "dall-e-3"}, 404, "model", "does not exist"),
    # Integers past int32 are refused, not wrapped to a small value.
    ({"steps": 4294967300}, 400, "steps", "4294967300 is outside [1, "),
    ({"steps": 2**64}, 400, "steps", f"{2**64} is outside [1, "),
    ({"prompt": "a \ud800 cat"}, 400, "prompt", "not valid UTF-8"),
    ({"negative_prompt": "\udfff"}, 400, "negative_prompt", "not valid UTF-8"),
    ({"guidance_scale": 1e9}, 400, "guidance_scale", "outside [0, 50"),
])
def test_errors_are_openai_json_with_the_right_status(api, body, status, param, text):
    # json.dumps escapes a lone surrogate ("\\ud800"), as a JSON client may send it.
    r = httpx.post(f"{api}/images/generations", timeout=300, headers={"content-type": "application/json"},
                   content=json.dumps({"prompt": "a cat", "size": "64x64", **SMALL, **body}))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and text in error["message"], error
    assert "/" not in error["message"].replace("b64_json", ""), error  # no server paths


def test_the_openai_client_raises_its_own_errors(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.images.generate(prompt="a cat", size="64x64", response_format="url", extra_body=SMALL)
    assert err.value.status_code == 400 and "b64_json" in err.value.message
    with pytest.raises(openai.NotFoundError):
        oai.images.generate(prompt="a cat", size="64x64", extra_body={**SMALL, "loras": [{"name": "nosuch"}]})


def test_models_lists_easel(oai, api):
    assert [m.id for m in oai.models.list()] == ["easel"]
    assert httpx.get(f"{api}/models/easel").json()["id"] == "easel"
    assert httpx.get(f"{api}/models/other").status_code == 404


def easel_requests(server) -> float:
    """Requests Triton's `easel` model received, whatever became of them."""
    return sum(v for labels, v in metric_values(server, "nv_inference_request_success").items()
               if 'model="easel"' in labels) + \
        sum(v for labels, v in metric_values(server, "nv_inference_request_failure").items()
            if 'model="easel"' in labels)


def png_b64(side: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (10, 20, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("body, param, text", [
    ({"n": 4, "controlnets": [{"name": "canny", "image": png_b64(8)}] * 100}, "controlnets",
     "100 given, over the limit of 3"),
    ({"controlnets": [{"name": "canny", "image": base64.b64encode(b"not an image").decode()}]}, "controlnets",
     "control_images[0]: is not a decodable image"),
    ({"controlnets": [{"name": "canny", "image": png_b64(8), "scale": 11}]}, "controlnets",
     "control_scales[0]: 11 is outside [0, 10]"),
    ({"loras": [{"name": "../etc"}]}, "loras", "loras[0]"),
    ({"size": "4096x64"}, "size", "width: 4096 is outside"),
    ({"prompt": "x" * 20000}, "prompt", "over the limit of 16384"),
])
def test_the_deployments_limits_are_checked_before_anything_is_forwarded(server, api, body, param, text):
    before = easel_requests(server)
    r = httpx.post(f"{api}/images/generations", timeout=60, json={"prompt": "a cat", "size": "64x64", **SMALL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"], r.json()
    assert easel_requests(server) == before  # Triton never saw it


def test_a_client_that_leaves_has_its_images_cancelled_at_once(server, api):
    """n = 2 long images; the client gives up after 1 s: the denoiser drops both at their next
    step (each image is its own `easel` request), and the server serves the next request."""
    before = counters(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api}/images/generations", timeout=1.0,
                   json={"prompt": "a lighthouse", "n": 2, "size": f"{LONG['width']}x{LONG['height']}",
                         "steps": LONG["steps"], "seed": 1})
    wait_for_cancel(server, before)
    end = time.monotonic() + 30
    while counters(server)[0] < before[0] + 2:
        assert time.monotonic() < end, "the second image was not cancelled"
        time.sleep(0.2)
    assert counters(server)[1] - before[1] < 2 * LONG["steps"]
    assert httpx.post(f"{api}/images/generations", timeout=300, json={"prompt": "a cat", "size": "64x64", **SMALL}
                      ).status_code == 200


def test_readiness_and_no_docs(api):
    root = api.removesuffix("/v1")
    assert httpx.get(f"{root}/health/ready").status_code == 200
    assert httpx.get(f"{root}/docs").status_code == 404 and httpx.get(f"{root}/openapi.json").status_code == 404


def _png_bytes(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _template() -> tuple[np.ndarray, np.ndarray]:
    """A 64 px RGBA template whose fully transparent rectangle is the part to edit (OpenAI's
    convention), and Easel's mask of the same part (255 repaints)."""
    rgba = np.random.default_rng(3).integers(0, 256, (64, 64, 4), dtype=np.uint8)
    rgba[..., 3] = 255
    rgba[16:48, 8:40, 3] = 0
    return rgba, np.where(rgba[..., 3] == 0, 255, 0).astype(np.uint8)


def test_edits_with_the_openai_client_equal_easel(server, oai):
    """The edit's part is the image's transparent pixels, or a mask's: the same image as the
    `easel` request with Easel's mask (one uint8 level if batching differed)."""
    rgba, repaint = _template()
    extra = {**SMALL, "strength": 0.9}
    with EaselClient(server.url_grpc, protocol="grpc") as c:
        direct = c.generate("a red house", image=_png_bytes(rgba[..., :3]), mask_image=_png_bytes(repaint),
                            strength=0.9, **SMALL)
    mask = np.zeros((64, 64, 4), np.uint8)
    mask[..., 3] = np.where(repaint == 255, 0, 255)
    for files in ({"image": ("t.png", _png_bytes(rgba), "image/png")},
                  {"image": ("t.png", _png_bytes(rgba[..., :3]), "image/png"),
                   "mask": ("m.png", _png_bytes(mask), "image/png")}):
        res = oai.images.edit(prompt="a red house", size="64x64", response_format="b64_json", extra_body=extra,
                              **files)
        info = res.data[0].model_extra["info"]
        assert info["strength"] == 0.9 and info["seed"] == 1
        assert int(np.abs(rgb(decode(res.data[0].b64_json)) - rgb(direct.image())).max()) <= 1
    uses = [oai.images.edit(prompt="a red house", size="64x64", response_format="b64_json",
                            image=("t.png", _png_bytes(rgba), "image/png"),
                            extra_body={**extra, "template": "oai-door"}).data[0].model_extra["info"]["template_use"]
            for _ in range(2)]
    assert uses == ["recorded", "reused"]  # the template field goes through


@pytest.mark.parametrize("files, fields, param, text", [
    ({"image": _png_bytes(np.zeros((64, 64, 3), np.uint8))}, {}, "image", "image: has no alpha channel"),
    ({"image": _png_bytes(np.zeros((64, 64, 3), np.uint8)), "mask": _png_bytes(np.zeros((64, 64), np.uint8))}, {},
     "mask", "mask_image: has no alpha channel"),
    ({"image": _png_bytes(_template()[0]), "mask": _png_bytes(np.zeros((32, 64, 4), np.uint8))}, {},
     "mask", "mask_image: is 64x32 pixels"),
    ({}, {}, "image", "image: is required"),
    ({"image": _png_bytes(_template()[0])}, {"stepz": "2"}, "stepz", "unknown parameter"),
    ({"image": _png_bytes(_template()[0])}, {"strength": "2"}, "strength", "strength: 2 is outside (0, 1]"),
    ({"image": _png_bytes(_template()[0])}, {"image": "not a file"}, "image", "image: must be a file"),
])
def test_edit_errors_are_openai_json(api, files, fields, param, text):
    r = httpx.post(f"{api}/images/edits", timeout=300, files={k: (k, v, "image/png") for k, v in files.items()},
                   data={"prompt": "a cat", "steps": "2", "seed": "1", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and text in error["message"], error
