"""Latent parallelism through the real server, on the CPU: the `shared` server's denoisers split
each guided request's rows over two copies of the UNet (export's cpu_cfg_parallel; on GPUs
`--cfg-parallel 0:1`). Images equal diffusers' within 1/255 (CPU fp32), LoRAs (merged into both
copies) and ControlNets (residuals split with the rows) included; a request without guidance runs
on one side."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from clients.client import EaselClient
from tests.reference import diffusers_pixels, max_abs_diff
from tests.server.conftest import metric_values
from tests.server.test_controlnet import png
from tests.server.test_exact import TOLERANCE, pixels
from tests.server.test_lora import reference


def test_guided_and_unguided_requests_match_diffusers(shared, tiny_model):
    reqs = [dict(seed=4, steps=4, width=64, height=64, guidance_scale=6.0),
            dict(seed=5, steps=4, width=64, height=64, guidance_scale=1.0)]

    def run(req):
        with EaselClient(shared.url_http) as c:
            return c.generate("a lighthouse at dusk", **req)

    with ThreadPoolExecutor(max_workers=4) as pool:  # batched together where they meet
        results = list(pool.map(run, reqs * 2))
    for req, ours in zip(reqs * 2, results):
        assert max_abs_diff(pixels(ours), diffusers_pixels(tiny_model, "a lighthouse at dusk", **req)) <= TOLERANCE
    # Both denoisers run the split (the runtime names itself in the metrics' labels).
    labels = metric_values(shared, "easel_runtime_eager_steps_total")
    assert len(labels) == 2 and all('runtime="cfg-parallel eager"' in k for k in labels), labels


def test_lora_merged_into_both_copies_matches_diffusers(shared, tiny_model):
    loras = [("papercut", 0.8), ("inkwash", 0.5)]
    req = dict(seed=6, steps=3, width=64, height=64)
    with EaselClient(shared.url_http) as c:
        ours = c.generate("a fox in snow", loras=tuple(n for n, _ in loras), lora_scales=tuple(s for _, s in loras),
                          **req)
    assert max_abs_diff(pixels(ours), reference(tiny_model, loras, **req)) <= TOLERANCE


def test_controlnet_residuals_follow_their_rows(shared, server):
    req = dict(seed=8, steps=3, width=64, height=64, guidance_scale=5.0, controlnets=("canny", "depth"),
               control_images=(png(2), png(3)))
    with EaselClient(server.url_http) as single, EaselClient(shared.url_http) as split:
        want = pixels(single.generate("a boat", **req))  # one device (test_controlnet: diffusers' image)
        assert max_abs_diff(pixels(split.generate("a boat", **req)), want) <= TOLERANCE
