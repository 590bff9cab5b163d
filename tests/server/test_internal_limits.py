"""Every internal model re-checks the limits it relies on: Triton cannot hide them, so a client
that calls the denoiser, text_encoder, vae_encoder or vae_decoder directly with params preprocess
would refuse is refused the same way (INVALID_ARGUMENT, naming the field and the limit)."""

from __future__ import annotations

import json
import os
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# What preprocess would have made of a good request (tests/server/conftest.py: max 256 px, 50 steps).
GOOD = dict(prompt="a cat", negative_prompt=None, width=64, height=64, steps=2, guidance_scale=5.0, seed=1,
            scheduler="default", controls=[], loras=[], output_format="png", quality=None, trace={})

BAD = [
    (dict(steps=600), "steps: 600 is outside [1, 200]"),
    (dict(width=60), "width: 60 is not a multiple of 8"),
    (dict(height=4096), "height: 4096 is outside [64, 256]"),
    (dict(seed=-5), "seed: -5 is outside [0, 9223372036854775807]"),
    (dict(guidance_scale=1e9), "guidance_scale: 1000000000.0 is outside [0, 50.0]"),
    (dict(loras=[{"name": "../../etc/passwd", "scale": 1.0}]), "is not a valid adapter name"),
    (dict(loras=[{"name": f"l{i}", "scale": 1.0} for i in range(9)]), "loras: 9 given, over the limit of 3"),
    (dict(output_format="gif"), "output_format: unknown format 'gif'"),
    (dict(width="64"), "width: '64' is not an integer"),
    (dict(unknown=1), "params: is not valid"),
]


def _tensor(name, array, dtype):
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def _inputs(model: str, params: dict) -> list:
    tensors = [_tensor("params", np.array([json.dumps(params).encode()], dtype=np.object_), "BYTES")]
    embeds = [_tensor("prompt_embeds", np.zeros((2, 77, 64), np.float32), "FP32"),
              _tensor("pooled_embeds", np.zeros((2, 32), np.float32), "FP32")]
    images = _tensor("control_images", np.array([b""], dtype=np.object_), "BYTES")
    return tensors + {
        "text_encoder": [],
        "denoiser": [*embeds, images],
        "vae_decoder": [_tensor("latents", np.zeros((1, 4, 8, 8), np.float32), "FP32")],
        "vae_encoder": [_tensor(name, np.array([_png(64, 64, channels)], dtype=np.object_), "BYTES")
                        for name, channels in (("image", 3), ("mask_image", 1))],
    }[model]


def _png(width: int, height: int, channels: int, value: int = 0) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, channels), value, np.uint8).squeeze(-1) if channels == 1
                    else np.full((height, width, channels), value, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def stream_denoiser(server, inputs: list, parameters: dict | None = None) -> list:
    """Every answer of one direct denoiser request (decoupled: by a gRPC stream), as (result,
    error) pairs up to the final one or the first error. `parameters`: default, the server's
    internal key (what the pipeline's calls carry)."""
    client = grpcclient.InferenceServerClient(server.url_grpc)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    got = []
    try:
        client.async_stream_infer("denoiser", inputs, enable_empty_final_response=True,
                                  parameters=server.internal_parameters if parameters is None else parameters)
        while True:
            result, error = answers.get(timeout=60)
            got.append((result, error))
            if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()


def call(server, model: str, params: dict) -> InferenceServerException:
    """The error a direct call of `model` (with the internal key) gets."""
    if model != "denoiser":
        with pytest.raises(InferenceServerException) as err:
            grpcclient.InferenceServerClient(server.url_grpc).infer(model, _inputs(model, params),
                                                                   parameters=server.internal_parameters)
        return err.value
    error = stream_denoiser(server, _inputs(model, params))[-1][1]
    assert error is not None, "the denoiser accepted out-of-limit params"
    return error


@pytest.mark.parametrize("model", ["denoiser", "text_encoder", "vae_decoder", "vae_encoder"])
@pytest.mark.parametrize("overrides, expected", BAD, ids=[str(i) for i in range(len(BAD))])
def test_internal_models_refuse_params_out_of_limits(server, model, overrides, expected):
    err = call(server, model, {**GOOD, **overrides})
    assert expected in err.message(), err.message()
    assert_invalid(model, err)


def assert_invalid(model, err):
    if model == "denoiser":  # a stream's error carries no status: the denoiser's mark says it (triton/adapter.MARKS)
        assert err.message().startswith("[invalid input] "), err.message()
    else:
        assert err.status() == "StatusCode.INVALID_ARGUMENT", (err.status(), err.message())


def test_denoiser_refuses_embeddings_of_another_shape(server):
    """They would fail the whole batch's step, other requests' too, so they never join one."""
    inputs = _inputs("denoiser", GOOD)
    inputs[1] = _tensor("prompt_embeds", np.zeros((2, 77, 65), np.float32), "FP32")
    error = stream_denoiser(server, inputs)[-1][1]
    assert error is not None and "prompt_embeds: has shape (2, 77, 65), expected (2, 77, 64)" in error.message()
    assert_invalid("denoiser", error)


@pytest.mark.parametrize("model, name, array, expected", [
    ("vae_decoder", "latents", np.zeros((1, 4, 64, 64), np.float32), "latents: has shape (1, 4, 64, 64), expected (1, 4, 8, 8)"),
    ("vae_encoder", "image", np.array([_png(128, 64, 3)], dtype=np.object_),
     "image: is 128x64 pixels of uint8, not the request's 64x64 uint8"),
    ("vae_encoder", "mask_image", np.array([_png(64, 64, 1, value=7)], dtype=np.object_),
     "mask_image: is not binary: use 0 to keep a pixel and 255 to repaint it"),
])
def test_tensors_must_match_the_checked_params(server, model, name, array, expected):
    """The size was checked in the params; a tensor of another size would bypass it. The VAE
    encoder decodes and checks an edit's files again."""
    params = {**GOOD, "strength": 1.0} if model == "vae_encoder" else GOOD
    inputs = [t if t.name() != name else _tensor(name, array, "BYTES" if array.dtype == object else "FP32")
              for t in _inputs(model, params)]
    with pytest.raises(InferenceServerException) as err:
        grpcclient.InferenceServerClient(server.url_grpc).infer(model, inputs,
            parameters=server.internal_parameters)
    assert expected in err.value.message()
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


@pytest.mark.parametrize("session, constants, status, expected", [
    (None, False, "INVALID_ARGUMENT", "image: give image, prompt_embeds, pooled_embeds, time_ids together"),
    ("x" * 300, True, "INVALID_ARGUMENT", "session: has 300 characters, outside 1 to 256"),
    ("never-sent", False, "NOT_FOUND", "session: this instance holds no session 'never-sent'"),
])
def test_controlnet_service_checks_its_session_inputs(server, session, constants, status, expected):
    """The ControlNet service called directly: a call without a request's image and embeddings
    names a session an instance holds (backends/core/adapters/control_sessions.py), or fails."""
    inputs = [_tensor("name", np.array([b"canny"], dtype=np.object_), "BYTES"),
              _tensor("scale", np.ones(1, np.float32), "FP32"),
              _tensor("sample", np.zeros((1, 4, 8, 8), np.float32), "FP32"),
              _tensor("timestep", np.full(1, 500.0, np.float32), "FP32")]
    if constants:
        inputs += [_tensor("prompt_embeds", np.zeros((1, 77, 64), np.float32), "FP32"),
                   _tensor("pooled_embeds", np.zeros((1, 32), np.float32), "FP32"),
                   _tensor("time_ids", np.zeros((1, 6), np.float32), "FP32"),
                   _tensor("image", np.zeros((1, 3, 64, 64), np.float32), "FP32")]
    if session is not None:
        inputs.append(_tensor("session", np.array([session.encode()], dtype=np.object_), "BYTES"))
    with pytest.raises(InferenceServerException) as err:
        grpcclient.InferenceServerClient(server.url_grpc).infer("controlnet", inputs,
            parameters=server.internal_parameters)
    assert err.value.status() == f"StatusCode.{status}" and expected in err.value.message(), err.value.message()


def _controlnet_call(rows=1, latent=8, image=64, tokens=77) -> list:
    return [_tensor("name", np.array([b"canny"], dtype=np.object_), "BYTES"),
            _tensor("scale", np.ones(1, np.float32), "FP32"),
            _tensor("sample", np.zeros((rows, 4, latent, latent), np.float32), "FP32"),
            _tensor("timestep", np.full(rows, 500.0, np.float32), "FP32"),
            _tensor("prompt_embeds", np.zeros((rows, tokens, 64), np.float32), "FP32"),
            _tensor("pooled_embeds", np.zeros((rows, 32), np.float32), "FP32"),
            _tensor("time_ids", np.zeros((rows, 6), np.float32), "FP32"),
            _tensor("image", np.zeros((rows, 3, image, image), np.float32), "FP32")]


@pytest.mark.parametrize("call, expected", [
    (dict(rows=64), "sample: has 64 rows; a call takes one request's 1 or 2"),
    (dict(latent=384, image=3072), "image: is 3072x3072, over the limit of 256x256"),
    (dict(latent=8, image=60), "sample: 8x8 latents do not scale to the 60x60 image"),
    (dict(tokens=5000), "prompt_embeds: has shape (1, 5000, 64)"),
])
def test_controlnet_service_checks_its_own_sizes(server, call, expected):
    """Called directly with what no request of this deployment makes, the ControlNet service
    refuses before computing (it ran 3072 px latents of 64 rows before it checked)."""
    with pytest.raises(InferenceServerException) as err:
        grpcclient.InferenceServerClient(server.url_grpc).infer("controlnet", _controlnet_call(**call),
            parameters=server.internal_parameters)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and expected in err.value.message(), err.value.message()
    ok = grpcclient.InferenceServerClient(server.url_grpc).infer("controlnet", _controlnet_call(rows=2),
        parameters=server.internal_parameters)
    assert ok.as_numpy("mid").shape[0] == 2


def test_a_cancel_key_never_names_a_file(server):
    """Previews go through a file named by the request's cancel_key (backends/core/serving/preview_board.py):
    a key that could name a path is refused, naming the field and what a key may hold."""
    extra = [_tensor("cancel_key", np.array([b"../../etc/x"], dtype=np.object_), "BYTES"),
             _tensor("preview_every", np.array([1], np.int32), "INT32")]
    (_, error), = stream_denoiser(server, _inputs("denoiser", GOOD) + extra)
    assert "cancel_key: must be 1 to 64 letters, digits, '_' or '-'" in error.message(), error.message()
    assert_invalid("denoiser", error)


def test_direct_previews_leave_no_file_and_steps_carry_no_tensor(server):
    """A request sent to the denoiser directly with previews and a key: an empty response on
    admission and at each step (no tensor: contract.DENOISER), then the latents; no file made."""
    key = "direct-preview-test"
    extra = [_tensor("cancel_key", np.array([key.encode()], dtype=np.object_), "BYTES"),
             _tensor("preview_every", np.array([1], np.int32), "INT32")]
    answers = stream_denoiser(server, _inputs("denoiser", GOOD) + extra)
    assert all(error is None for _, error in answers), answers
    outputs = [[o.name for o in result.get_response().outputs] for result, _ in answers]
    assert outputs[:-1] == [[]] * (1 + GOOD["steps"]), outputs
    assert sorted(outputs[-1]) == ["latents", "params"]
    assert not any(key in name for name in os.listdir("/dev/shm"))


@pytest.mark.parametrize("key", [None, "a-guess-of-the-key"])
@pytest.mark.parametrize("model", ["preprocess", "text_encoder", "vae_decoder", "vae_encoder", "controlnet"])
def test_internal_models_refuse_calls_without_the_servers_key(server, model, key):
    """A client cannot call a part of the pipeline: without the server's per-start key (or with a
    wrong one) the call is NOT_FOUND, naming the models to call, before any input is read."""
    inputs = _controlnet_call() if model == "controlnet" else _inputs(model, GOOD) if model != "preprocess" \
        else [_tensor("prompt", np.array([b"a cat"], dtype=np.object_), "BYTES")]
    with pytest.raises(InferenceServerException) as err:
        grpcclient.InferenceServerClient(server.url_grpc).infer(
            model, inputs, parameters={} if key is None else {"easel_internal_key": key})
    assert err.value.status() == "StatusCode.NOT_FOUND", err.value.message()
    assert f"{model} is a part of Easel's pipeline, not a model to call: call easel or easel_stream" \
        in err.value.message()


def test_the_denoiser_refuses_requests_and_cancels_without_the_key(server):
    """Not even a cancel: with a request's cancel key a client could stop others' requests."""
    (_, error), = stream_denoiser(server, _inputs("denoiser", GOOD), parameters={})
    assert error is not None and "denoiser is a part of Easel's pipeline" in error.message(), error
    cancel = [_tensor("cancel", np.array([b"someone-elses-key"], dtype=np.object_), "BYTES")]
    (_, error), = stream_denoiser(server, cancel, parameters={"easel_internal_key": "wrong"})
    assert error is not None and "denoiser is a part of Easel's pipeline" in error.message(), error
