"""Bad input gets an error naming the field and the limit; the server stays ready and serves on."""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from clients.client import EaselError
from tests.reference import diffusers_pixels, max_abs_diff
from tests.server.test_exact import TOLERANCE, pixels

GOOD = dict(seed=1, steps=2, width=64, height=64)


@pytest.mark.parametrize("overrides, expected", [
    (dict(prompt=None), "prompt: is required"),
    (dict(width=100), "width: 100 is not a multiple of 8"),
    (dict(height=60), "height: 60 is not a multiple of 8"),
    (dict(width=512), "width: 512 is outside [64, 256]"),
    (dict(height=8), "height: 8 is outside [64, 256]"),
    (dict(steps=0), "steps: 0 is outside [1, 200]"),
    (dict(steps=201), "steps: 201 is outside [1, 200]"),
    (dict(guidance_scale=-1.0), "guidance_scale: -1.0 is outside [0, 50.0]"),
    (dict(scheduler="heun"), "scheduler: unknown name 'heun'; allowed: default, euler, euler_a, dpmpp_2m_karras, ddim"),
    (dict(seed=-5), "seed: -5 is outside [0, 9223372036854775807]"),
])
def test_invalid_values_are_named(client, overrides, expected):
    request = {"prompt": "a cat", **GOOD, **overrides}
    prompt = request.pop("prompt")
    with pytest.raises(EaselError) as err:
        if prompt is None:
            from clients.client import GenerateRequest, build_inputs

            inputs = [i for i in build_inputs(GenerateRequest("x", **request), client.protocol)
                      if i.name() != "prompt"]
            try:
                client._client.infer("easel", inputs)
            except InferenceServerException as e:
                raise EaselError(e.message(), e.status()) from e
        else:
            client.generate(prompt, **request)
    assert expected in str(err.value)
    # The client's mistake, said so: gRPC INVALID_ARGUMENT / HTTP 400, not INTERNAL / 500.
    assert err.value.status in ("StatusCode.INVALID_ARGUMENT", "400"), err.value.status
    assert client.is_ready()


def _raw(module, name, array, dtype):
    tensor = module.InferInput(name, list(array.shape), dtype)
    tensor.set_data_from_numpy(array)
    return tensor


@pytest.mark.parametrize("module", [httpclient, grpcclient], ids=["http", "grpc"])
def test_wrong_dtype_and_shape_are_refused_by_triton(server, module):
    url = server.url_http if module is httpclient else server.url_grpc
    client = module.InferenceServerClient(url)
    prompt = _raw(module, "prompt", np.array([b"a cat"], dtype=np.object_), "BYTES")
    cases = [
        (_raw(module, "width", np.array([64.0], dtype=np.float32), "FP32"), "width"),
        (_raw(module, "steps", np.array([2, 3], dtype=np.int32), "INT32"), "steps"),
        (_raw(module, "nonsense", np.array([1], dtype=np.int32), "INT32"), "nonsense"),
    ]
    for bad, field in cases:
        with pytest.raises(InferenceServerException) as err:
            client.infer("easel", [prompt, bad])
        assert field in err.value.message()
    assert client.is_server_ready()


def test_long_prompt_is_truncated_as_diffusers_does(http_client, tiny_model):
    prompt = " ".join(["a tall mountain at sunset with a lake"] * 40)  # far over 77 tokens
    ours = http_client.generate(prompt, **GOOD)
    ref = diffusers_pixels(tiny_model, prompt, **GOOD)
    assert max_abs_diff(pixels(ours), ref) <= TOLERANCE


def test_server_serves_after_errors(http_client, tiny_model):
    for _ in range(3):
        with pytest.raises(EaselError):
            http_client.generate("x", steps=0)
    ours = http_client.generate("a dog", **GOOD)
    assert max_abs_diff(pixels(ours), diffusers_pixels(tiny_model, "a dog", **GOOD)) <= TOLERANCE
