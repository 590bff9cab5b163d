"""LoRAs through the server reproduce diffusers' load_lora_weights + set_adapters + fuse_lora
(uint8 within 1/255, CPU fp32; today the request waits for its LoRAs before its first step),
text-encoder layers included (applied by `text_encoder`, unfused); bad LoRA inputs fail that
request alone."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLPipeline

from clients.client import EaselClient, EaselError
from tests.reference import max_abs_diff
from tests.server.conftest import PAPERCUT_LAYER, metric_total
from tests.server.test_controlnet import png
from tests.server.test_exact import TOLERANCE, pixels


def reference(model, loras, controlnet=None, **req):
    pipe = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
    for name, _ in loras:
        pipe.load_lora_weights(str(model / "adapters" / "loras" / f"{name}.safetensors"), adapter_name=name)
    pipe.set_adapters([n for n, _ in loras], adapter_weights=[s for _, s in loras])
    pipe.fuse_lora(adapter_names=[n for n, _ in loras])
    image = pipe("a fox in snow", generator=torch.Generator("cpu").manual_seed(req.pop("seed")), output_type="np",
                 num_inference_steps=req.pop("steps"), **req).images[0]
    return (image * 255).round().astype(np.uint8)


@pytest.mark.parametrize("loras", [
    [("papercut", 1.0)], [("inkwash", 0.7)], [("papercut", 0.8), ("inkwash", 0.5)],
    [("charcoal", 0.7)], [("charcoal", 1.2), ("inkwash", 0.6)],
], ids=["peft-layout", "kohya-layout", "two", "text-encoder-layers", "text-encoder-layers-and-unet-only"])
def test_loras_match_diffusers(http_client, tiny_model, loras):
    req = dict(seed=6, steps=3, width=64, height=64)
    ours = http_client.generate("a fox in snow", loras=tuple(n for n, _ in loras),
                                lora_scales=tuple(s for _, s in loras), **req)
    assert max_abs_diff(pixels(ours), reference(tiny_model, loras, **req)) <= TOLERANCE


@pytest.mark.parametrize("loras, scales, expected", [
    (("nope",), None, "loras: unknown LoRA 'nope'"),
    (("../loras/papercut",), None, "loras[0]: '../loras/papercut' is not a valid adapter name"),
    (("papercut.safetensors",), None, "loras: unknown LoRA 'papercut.safetensors'"),
    (("papercut",), (1.0, 2.0), "lora_scales: has 2 values for 1 names"),
    (("papercut",), (9.0,), "lora_scales[0]: 9 is outside [-4, 4]"),
    (("papercut", "papercut"), None, "loras: names a LoRA twice"),
    (("papercut", "inkwash", "a", "b"), None, "loras: 4 given, over the limit of 3"),
])
def test_bad_lora_inputs_fail_alone(http_client, loras, scales, expected):
    with pytest.raises(EaselError) as err:
        http_client.generate("a fox", seed=1, steps=2, width=64, height=64, loras=loras, lora_scales=scales)
    assert expected in str(err.value)
    assert http_client.generate("a fox", seed=1, steps=2, width=64, height=64).image().size == (64, 64)


LAYER = PAPERCUT_LAYER.removeprefix("unet.")


@pytest.mark.parametrize("name, expected", [
    ("misfit", re.escape(f"loras: 'misfit': layer {LAYER} is (32, 33), the base model's is (32, 32)")),
    ("absent", r"loras: 'absent': layer down_blocks\.1\.attentions\.7\.\S+ does not exist in the base model"),
    ("truncated", "loras: 'truncated' cannot be read as a LoRA"),
    ("pickled", "loras: unknown LoRA 'pickled'"),
    ("escape", "loras: unknown LoRA 'escape'"),
])
def test_broken_lora_fails_its_request_alone(shared, name, expected):
    """Sent while a good LoRA request runs: the broken one fails with its reason, the good one is
    untouched, the server stays ready and no segment is left in /dev/shm."""
    def good():
        with EaselClient(shared.url_http) as c:
            return pixels(c.generate("a fox", seed=4, steps=8, width=64, height=64, loras=("papercut",)))

    alone = good()
    with ThreadPoolExecutor(max_workers=1) as pool, EaselClient(shared.url_http) as c:
        beside = pool.submit(good)
        with pytest.raises(EaselError, match=expected) as err:
            c.generate("a fox", seed=1, steps=8, width=64, height=64, loras=("inkwash", name))
        # the client's mistake, passed on through BLS; a name the store does not hold: not found
        assert err.value.status == ("404" if "unknown LoRA" in expected else "400")
        assert np.array_equal(beside.result(), alone)
        assert c.is_ready()
    assert not _segments_left(shared)


def test_lora_with_controlnet_matches_diffusers(http_client, tiny_model):
    import io

    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline
    from PIL import Image

    hint = png(3)
    ours = http_client.generate("a fox in snow", seed=2, steps=3, width=64, height=64, loras=("papercut",),
                                lora_scales=(0.9,), controlnets=("canny",), control_images=(hint,))
    base = StableDiffusionXLPipeline.from_pretrained(tiny_model, add_watermarker=False)
    base.load_lora_weights(str(tiny_model / "adapters" / "loras" / "papercut.safetensors"), adapter_name="papercut")
    base.set_adapters(["papercut"], adapter_weights=[0.9])
    base.fuse_lora(adapter_names=["papercut"])
    controlnet = ControlNetModel.from_pretrained(tiny_model / "adapters" / "controlnets" / "canny")
    pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=controlnet, add_watermarker=False)
    ref = pipe("a fox in snow", image=Image.open(io.BytesIO(hint)), width=64, height=64, num_inference_steps=3,
               generator=torch.Generator("cpu").manual_seed(2), output_type="np").images[0]
    assert max_abs_diff(pixels(ours), (ref * 255).round().astype(np.uint8)) <= TOLERANCE


def test_info_says_where_the_lora_landed(server, http_client):
    """With its loaders stopped (SIGSTOP), a request at bound 0 is held before its first step until they
    resume: its info and the wait metrics count that hold. (Unstopped, a tiny LoRA may finish loading
    before the request's first step, and then nothing is held: a 0 s wait is right there.)"""
    before = {n: metric_total(server, n) for n in ("easel_lora_bound_waits_total", "easel_lora_bound_wait_seconds_total")}
    loaders = _loaders(server)
    hold = 1.0
    with ThreadPoolExecutor(1) as pool:
        for pid in loaders:
            os.kill(pid, signal.SIGSTOP)
        try:
            reply = pool.submit(_generate, server.url_http, "a fox", seed=1, steps=2, width=64, height=64,
                                loras=("papercut",))
            deadline = time.monotonic() + 30
            while metric_total(server, "easel_denoiser_pending") < 1:  # admitted; no load can end while its loaders stop
                assert time.monotonic() < deadline and not reply.done(), "the request never reached the denoiser"
                time.sleep(0.05)
            time.sleep(hold)
        finally:
            for pid in loaders:
                os.kill(pid, signal.SIGCONT)
        info = reply.result(timeout=60).info
    assert info["lora_merged_at_step"] == 0  # bound 0: the request waits for its LoRA
    # Held from its first schedule, a moment after admission, to the step after the loaders resumed.
    assert hold / 2 < info["lora_wait_s"] < 30
    assert metric_total(server, "easel_lora_bound_waits_total") - before["easel_lora_bound_waits_total"] == 1
    assert metric_total(server, "easel_lora_bound_wait_seconds_total") - before["easel_lora_bound_wait_seconds_total"] \
        == pytest.approx(info["lora_wait_s"], rel=1e-6)
    plain = http_client.generate("a fox", seed=1, steps=2, width=64, height=64).info
    assert plain["lora_merged_at_step"] is None and plain["lora_wait_s"] == 0


def test_lora_metrics(server, http_client):
    before = {n: metric_total(server, n) for n in ("easel_lora_loads_total", "easel_lora_loaded_bytes_total",
                                    "easel_lora_merged_requests_total")}
    http_client.generate("a fox", seed=1, steps=2, width=64, height=64, loras=("papercut", "inkwash"))
    assert metric_total(server, "easel_lora_loads_total") - before["easel_lora_loads_total"] == 2
    assert metric_total(server, "easel_lora_loaded_bytes_total") > before["easel_lora_loaded_bytes_total"]
    assert metric_total(server, "easel_lora_merged_requests_total") - before["easel_lora_merged_requests_total"] == 1
    assert metric_total(server, "easel_lora_load_seconds_total") > 0
    assert metric_total(server, "easel_lora_merge_seconds_total") > 0


def _generate(url: str, prompt: str, **req):
    """From a thread of its own: a client is not shared across threads."""
    with EaselClient(url) as c:
        return c.generate(prompt, **req)


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
        except OSError:
            pass  # gone meanwhile
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _denoiser_stubs(server) -> list[int]:
    return [p for p in _children(server.proc.pid) if "denoiser" in _cmdline(p)]


def _loaders(server) -> list[int]:
    """The denoisers' LoRA loader processes: children of their stubs running spawn_main."""
    stubs = _denoiser_stubs(server)
    loaders = [p for stub in stubs for p in _children(stub) if "spawn_main" in _cmdline(p)]
    assert stubs and len(loaders) == 2 * len(stubs)  # lora_loaders defaults to 2
    return loaders


def _segments_left(server) -> list[str]:
    """LoRA segments in /dev/shm owned by the server's denoisers (named after their stub's pid)."""
    stubs = _children(server.proc.pid)
    return [n for n in os.listdir("/dev/shm") for stub in stubs if n.startswith(f"easel-lora-{stub}-")]


def test_killed_lora_loaders_are_replaced(server, http_client):
    """The denoiser's LoRA loader processes (children of its stub running spawn_main) killed with SIGKILL: the
    next LoRA request still succeeds, the server stays ready, no segment is left in /dev/shm."""
    stubs = _denoiser_stubs(server)
    loaders = _loaders(server)
    for pid in loaders:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in loaders):  # the denoiser notices and reaps them
        assert time.monotonic() < deadline, "the killed loaders were never reaped"
        time.sleep(0.2)

    reply = http_client.generate("a fox", seed=1, steps=2, width=64, height=64, loras=("papercut", "inkwash"))
    assert reply.image().size == (64, 64) and reply.info["lora_merged_at_step"] == 0
    assert server.is_ready()
    fresh = [p for stub in stubs for p in _children(stub) if "spawn_main" in _cmdline(p)]
    assert len(fresh) == len(loaders) and not set(fresh) & set(loaders)
    assert not _segments_left(server)
