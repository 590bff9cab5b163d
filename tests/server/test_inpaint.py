"""Edits (inpainting) through the server: `image`, `mask_image` and `strength` on `easel` and
`easel_stream` reproduce StableDiffusionXLInpaintPipeline with the same seed (uint8 within 1/255,
CPU fp32; the tiny base UNet of 4 input channels, blended after each step: the 9-channel UNet's
exactness is tests/export/test_inpaint_engine.py's); bad edits fail that request alone, naming
the field."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLInpaintPipeline
from PIL import Image

from clients.client import EaselError, GenerateRequest
from tests.reference import _pipeline, max_abs_diff
from tests.server.test_exact import TOLERANCE, pixels

SIZE = 64


def png(array: np.ndarray, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def template(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)


def mask(top=16, bottom=48, left=8, right=40) -> np.ndarray:
    m = np.zeros((SIZE, SIZE), np.uint8)
    m[top:bottom, left:right] = 255
    return m


def reference(model, image, repaint, strength, **req) -> np.ndarray:
    pipe = StableDiffusionXLInpaintPipeline(**_pipeline(str(model)).components, add_watermarker=False)
    kwargs = {} if strength is None else {"strength": strength}
    out = pipe("a red house", image=Image.fromarray(image), mask_image=Image.fromarray(repaint), width=SIZE,
               height=SIZE, num_inference_steps=req["steps"], guidance_scale=5.0,
               generator=torch.Generator("cpu").manual_seed(req["seed"]), output_type="np", **kwargs).images[0]
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("strength", [None, 1.0, 0.6], ids=["default", "1", "0.6"])
def test_edits_match_diffusers(client, tiny_model, strength):
    image, repaint = template(), mask()
    req = dict(seed=5, steps=4)
    ours = client.generate("a red house", image=png(image), mask_image=png(repaint), strength=strength, **req)
    assert ours.info["strength"] == (0.9999 if strength is None else strength)  # the pipeline's default
    assert ours.image().size == (SIZE, SIZE)  # the template's size: the request named none
    assert max_abs_diff(pixels(ours), reference(tiny_model, image, repaint, strength, **req)) <= TOLERANCE


def test_an_edit_with_a_controlnet_matches_diffusers(http_client, tiny_model):
    from diffusers import ControlNetModel, StableDiffusionXLControlNetInpaintPipeline

    image, repaint, control = template(3), mask(), template(8)
    ours = http_client.generate("a red house", seed=5, steps=4, image=png(image), mask_image=png(repaint),
                                strength=0.8, controlnets=("canny",), control_images=(png(control),),
                                control_scales=(0.6,))
    net = ControlNetModel.from_pretrained(tiny_model / "adapters" / "controlnets" / "canny", use_safetensors=True)
    pipe = StableDiffusionXLControlNetInpaintPipeline(**_pipeline(str(tiny_model)).components, controlnet=net,
                                                      add_watermarker=False)
    want = pipe("a red house", image=Image.fromarray(image), mask_image=Image.fromarray(repaint),
                control_image=Image.fromarray(control), width=SIZE, height=SIZE, num_inference_steps=4,
                guidance_scale=5.0, strength=0.8, controlnet_conditioning_scale=0.6,
                generator=torch.Generator("cpu").manual_seed(5), output_type="np").images[0]
    assert max_abs_diff(pixels(ours), (want * 255).round().astype(np.uint8)) <= TOLERANCE


def test_a_streamed_edit_is_the_unary_one(server):
    from clients.client import EaselClient, GenerateResult

    request = GenerateRequest("a red house", seed=6, steps=3, image=png(template(1)), mask_image=png(mask()),
                              strength=0.8)
    with EaselClient(server.url_grpc, "grpc") as unary, EaselClient(server.url_grpc, "grpc", "easel_stream") as stream:
        want = unary.run(request)
        events = list(stream.stream(request, preview_every=1))
    got = events[-1]
    assert isinstance(got, GenerateResult) and got.png == want.png
    assert len(events) == 1 + 2  # strength 0.8 of 3 steps runs int(3 * 0.8) = 2 of them


def bomb(side=20000) -> bytes:
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")  # a few kB on the wire, side^2 pixels decoded
    return buf.getvalue()


@pytest.mark.parametrize("edit, expected", [
    (dict(image=png(template())), "mask_image: is needed for an edit: give image and mask_image together"),
    (dict(mask_image=png(mask())), "image: is needed for an edit"),
    (dict(strength=0.5), "strength: is for edits: give image and mask_image too"),
    (dict(image=png(template()), mask_image=png(mask()), strength=0.0), "strength: 0 is outside (0, 1]"),
    (dict(image=png(template()), mask_image=png(mask()), strength=1.5), "strength: 1.5 is outside (0, 1]"),
    (dict(image=png(template()), mask_image=png(mask()[:48])),
     "mask_image: is 64x48 pixels of uint8 (one channel), not the request's 64x64 uint8"),
    (dict(image=png(template()), mask_image=png(mask()), width=128, height=128),
     "image: is 64x64 pixels of uint8, not the request's 128x128 uint8"),
    (dict(image=png(template()), mask_image=png(mask() // 2)),
     "mask_image: is not binary: use 0 to keep a pixel and 255 to repaint it"),
    (dict(image=png(template()), mask_image=png(mask(13, 47, 5, 37), "JPEG")), "mask_image: is not binary"),
    (dict(image=b"not an image", mask_image=png(mask())), "image: is not a decodable image"),
    (dict(image=bomb(), mask_image=png(mask())), "image: is a decompression bomb"),
    (dict(image=bomb(300), mask_image=png(mask())), "image: is 300x300, over the limit of 65536 pixels"),
    (dict(image=png(template()), mask_image=png(mask()), strength=0.1), "strength: 0.1 leaves no step of 4"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_edits_fail_alone(http_client, edit, expected):
    with pytest.raises(EaselError) as err:
        http_client.generate("a red house", seed=1, steps=4, **edit)
    assert expected in str(err.value)
    assert err.value.status == "400"
    ok = http_client.generate("a red house", seed=1, steps=2, width=64, height=64)
    assert ok.image().size == (64, 64)


@pytest.fixture(scope="module")
def inpaint_model(tmp_path_factory):
    from export.tiny import write_tiny_pipeline

    return write_tiny_pipeline(tmp_path_factory.mktemp("models") / "inpaint", seed=0, variant="inpaint")


@pytest.fixture(scope="module")
def inpaint_server(inpaint_model, tmp_path_factory):
    """A server on the tiny inpainting model (a UNet of 9 input channels: the latents, the mask
    and the masked template's latents)."""
    from tests.server.conftest import start_server

    srv = start_server(inpaint_model, tmp_path_factory.mktemp("repos") / "inpaint")
    srv.wait_ready()
    yield srv
    srv.stop()


def test_an_inpainting_unet_serves_edits_as_diffusers_and_refuses_text_to_image(inpaint_server, inpaint_model):
    from clients.client import EaselClient

    image, repaint = template(2), mask()
    with EaselClient(inpaint_server.url_grpc, "grpc") as client:
        for strength in (1.0, 0.6):
            req = dict(seed=7, steps=4)
            ours = client.generate("a red house", image=png(image), mask_image=png(repaint), strength=strength, **req)
            want = reference(inpaint_model, image, repaint, strength, **req)
            assert max_abs_diff(pixels(ours), want) <= TOLERANCE, strength
        with pytest.raises(EaselError) as err:
            client.generate("a red house", seed=1, steps=2, width=SIZE, height=SIZE)
    assert "image:" in str(err.value) and err.value.status == "StatusCode.INVALID_ARGUMENT", (err.value, err.value.status)


def test_a_template_is_recorded_then_reused(http_client, tiny_model):
    """`template` (runtime/token_subsets.py): the first edit of a template records its activations
    and is exact; the same edit again reuses them (computing only its masked tokens on this CPU
    export's eager runtime) and is still the exact image, as its recording was made by the same
    request; `info` says which it was."""
    image, repaint = template(4), mask()
    req = dict(seed=9, steps=4, image=png(image), mask_image=png(repaint), strength=1.0, template="kitchen-9")
    want = reference(tiny_model, image, repaint, 1.0, seed=9, steps=4)
    first = http_client.generate("a red house", **req)
    second = http_client.generate("a red house", **req)
    assert (first.info["template"], first.info["template_use"]) == ("kitchen-9", "recorded")
    assert second.info["template_use"] == "reused"
    for result in (first, second):
        assert max_abs_diff(pixels(result), want) <= TOLERANCE


@pytest.mark.parametrize("edit, expected", [
    (dict(template="t1"), "template: is for edits: give image and mask_image too"),
    (dict(image=png(template()), mask_image=png(mask()), template="../etc"), "template: '../etc' is not a valid "
                                                                              "template name"),
])
def test_bad_templates_fail_alone(http_client, edit, expected):
    with pytest.raises(EaselError) as err:
        http_client.generate("a red house", seed=1, steps=4, **edit)
    assert expected in str(err.value) and err.value.status == "400"


def test_the_template_cache_reports_its_tiers(http_client, server):
    """After the recorded and reused edits above (or these): hits on the device, misses, the
    block tokens the reused edits computed, and the recordings' bytes, as Prometheus metrics."""
    from tests.server.conftest import metric_values

    req = dict(seed=2, steps=4, image=png(template(5)), mask_image=png(mask()), strength=1.0, template="metrics-2")
    http_client.generate("a red house", **req)
    http_client.generate("a red house", **req)
    hits = metric_values(server, "easel_template_hits_total")
    assert sum(v for labels, v in hits.items() if 'tier="device"' in labels) >= 1, hits
    assert sum(metric_values(server, "easel_template_misses_total").values()) >= 1
    computed = sum(metric_values(server, "easel_template_computed_tokens_total").values())
    assert 0 < computed < sum(metric_values(server, "easel_template_tokens_total").values())
    stored = metric_values(server, "easel_template_bytes")
    assert sum(v for labels, v in stored.items() if 'tier="device"' in labels) > 0, stored
    assert sum(metric_values(server, "easel_template_stall_seconds_total").values()) == 0  # (nothing streamed)
