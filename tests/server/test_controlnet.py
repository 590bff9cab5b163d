"""ControlNets through the server reproduce StableDiffusionXLControlNetPipeline (uint8 within 1/255,
CPU fp32); bad ControlNet inputs fail that request alone with the field named."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from diffusers import ControlNetModel, MultiControlNetModel, StableDiffusionXLControlNetPipeline
from PIL import Image

from clients.client import EaselError
from tests.reference import _pipeline, max_abs_diff
from tests.server.test_exact import TOLERANCE, pixels


def png(seed, size=(80, 48)) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def reference(model, names, images, scales, starts, ends, **req):
    base = _pipeline(str(model))
    nets = [ControlNetModel.from_pretrained(model / "adapters" / "controlnets" / n, use_safetensors=True)
            for n in names]
    pipe = StableDiffusionXLControlNetPipeline(**base.components, add_watermarker=False,
                                               controlnet=nets[0] if len(nets) == 1 else MultiControlNetModel(nets))
    pil = [Image.open(io.BytesIO(i)) for i in images]
    out = pipe("a red house", image=pil[0] if len(nets) == 1 else pil, width=req["width"], height=req["height"],
               num_inference_steps=req["steps"], guidance_scale=5.0,
               controlnet_conditioning_scale=scales[0] if len(nets) == 1 else list(scales),
               control_guidance_start=list(starts), control_guidance_end=list(ends),
               generator=torch.Generator("cpu").manual_seed(req["seed"]), output_type="np").images[0]
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("names, scales, starts, ends", [
    (("canny",), (0.7,), (0.0,), (1.0,)),
    (("canny", "depth"), (1.0, 0.5), (0.0, 0.3), (0.6, 1.0)),
], ids=["one", "two"])
def test_controlnets_match_diffusers(http_client, tiny_model, names, scales, starts, ends):
    images = tuple(png(i) for i in range(len(names)))
    req = dict(seed=4, steps=4, width=64, height=64)
    ours = http_client.generate("a red house", controlnets=names, control_images=images, control_scales=scales,
                                control_guidance_start=starts, control_guidance_end=ends, **req)
    ref = reference(tiny_model, names, images, scales, starts, ends, **req)
    assert max_abs_diff(pixels(ours), ref) <= TOLERANCE


def bomb(side=20000) -> bytes:
    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")  # a few kB on the wire, side^2 pixels decoded
    return buf.getvalue()


@pytest.mark.parametrize("controls, expected", [
    (dict(controlnets=("nope",), control_images=(png(0),)), "controlnets: unknown ControlNet 'nope'"),
    (dict(controlnets=("../x",), control_images=(png(0),)), "controlnets[0]: '../x' is not a valid adapter name"),
    (dict(controlnets=("/etc/passwd",), control_images=(png(0),)), "is not a valid adapter name"),
    (dict(controlnets=("a/b",), control_images=(png(0),)), "is not a valid adapter name"),
    (dict(controlnets=("canny", "depth"), control_images=(png(0),)), "control_images: has 1 images for 2"),
    (dict(controlnets=("canny",), control_images=(png(0),), control_scales=(1.0, 2.0)),
     "control_scales: has 2 values for 1"),
    (dict(controlnets=("canny",), control_images=(b"not an image",)), "control_images[0]: is not a decodable"),
    (dict(controlnets=("canny",), control_images=(bomb(),)), "over the limit of 16777216 pixels"),
    (dict(controlnets=("canny",), control_images=(bomb(5000),)), "is 5000x5000, over the limit of 16777216 pixels"),
    (dict(controlnets=("canny",), control_images=(png(0),), control_scales=(11.0,)),
     "control_scales[0]: 11 is outside [0, 10]"),
    (dict(controlnets=("canny",), control_images=(png(0),), control_guidance_start=(0.8,),
          control_guidance_end=(0.2,)), "control_guidance_start[0]: 0.8 is not below control_guidance_end 0.2"),
    (dict(controlnets=("canny",) * 4, control_images=(png(0),) * 4), "controlnets: 4 given, over the limit of 3"),
])
def test_bad_controlnet_inputs_fail_alone(http_client, tiny_model, controls, expected):
    with pytest.raises(EaselError) as err:
        http_client.generate("a red house", seed=1, steps=2, width=64, height=64, **controls)
    assert expected in str(err.value)
    # the client's mistake; a name the store does not hold is "not found"
    assert err.value.status == ("404" if "unknown ControlNet" in expected else "400")
    ok = http_client.generate("a red house", seed=1, steps=2, width=64, height=64)
    assert ok.image().size == (64, 64)


def test_a_requests_image_and_embeddings_cross_once_per_instance(http_client, server):
    """Sessions (backends/core/adapters/control_sessions.py): a ControlNet's first calls of a
    request carry its image and embeddings, one per instance of the service (this export has
    two); the later ones only the sample and timestep, found by their instance or asked for once."""
    from tests.server.conftest import metric_values

    def total(name):
        return sum(metric_values(server, f"easel_controlnet_session_{name}_total").values())

    before = {k: total(k) for k in ("hits", "misses")}
    steps = 5
    http_client.generate("a boat", seed=4, steps=steps, width=64, height=64, controlnets=("canny",),
                         control_images=(png(9),))
    delta = {k: total(k) - before[k] for k in before}
    assert delta["hits"] + delta["misses"] == steps - 2 and delta["misses"] <= 1 and delta["hits"] >= 1, delta
    assert sum(metric_values(server, "easel_controlnet_session_bytes").values()) > 0
