"""Every multi-GPU placement `easel export` accepts, through a real tritonserver: ControlNets on a
GPU of their own, a denoiser on GPU 1, replicas with ControlNets on each GPU or on one shared GPU,
latent parallelism with ControlNets, (three GPUs) a guided request's ControlNet split by rows over
two ControlNet GPUs, and (four GPUs) the ControlNets on GPUs 2-3. Each server takes
guided one-ControlNet requests at once (so that both replicas and every service instance work) and
each image is compared with diffusers' StableDiffusionXLControlNetPipeline on the CPU.

Tolerance: PSNR >= 35 dB (CPU fp32 against GPU fp32, as test_cfg_parallel_server.py). The
ControlNet runs at scale 4 so that it moves the tiny model's image well past that: the same request
without it is below 35 dB (at scale 1 it was 37.9 dB away), so residuals that went missing or
stale fail.
The graphs runtime: the ControlNet service, the text encoders and the VAE replay CUDA graphs
captured in stubs whose threads start on GPU 0. Needs two GPUs (`tests/gpu/run.sh` on
such a machine), four for the last placements; skipped elsewhere."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from clients.bench.image_metrics import psnr
from clients.client import EaselClient
from clients.serve import TritonServer
from export.repository import ExportOptions, export_repository
from tests.reference import diffusers_pixels
from tests.server.conftest import metric_values
from tests.server.test_controlnet import png, reference
from tests.server.test_exact import pixels

pytestmark = pytest.mark.gpu

MIN_PSNR = 35.0
REQUEST = dict(steps=4, width=64, height=64)
SEEDS = (11, 12, 13, 14)
SCALE = 4.0


def gpus(n: int):
    return pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < n,
                              reason=f"this placement needs {n} GPUs")


PLACEMENTS = [
    pytest.param(dict(gpus=(0,), controlnet_gpus=(1,)), marks=gpus(2), id="controlnet-on-gpu1"),
    pytest.param(dict(gpus=(1,)), marks=gpus(2), id="denoiser-on-gpu1"),
    pytest.param(dict(gpus=(0, 1)), marks=gpus(2), id="replicas"),
    pytest.param(dict(gpus=(0, 1), controlnet_gpus=(1,)), marks=gpus(2), id="replicas-controlnets-on-gpu1"),
    pytest.param(dict(gpus=(0,), cfg_parallel=((0, 1),)), marks=gpus(2), id="cfg-parallel"),
    pytest.param(dict(gpus=(0,), controlnet_gpus=(2, 3)), marks=gpus(4), id="controlnets-on-gpus2-3"),
    pytest.param(dict(gpus=(0,), cfg_parallel=((0, 1),), controlnet_gpus=(2, 3)), marks=gpus(4),
                 id="cfg-parallel-controlnets-on-gpus2-3"),
    pytest.param(dict(gpus=(0,), controlnet_gpus=(1, 2), controlnet_instances=1, controlnet_row_split=True),
                 marks=gpus(3), id="row-split-controlnets-on-gpus1-2"),
]


@pytest.fixture(scope="module")
def references(tiny_model):
    """diffusers' images of each seed, with its ControlNet and without (the test's power)."""
    image = png(5)
    threads = torch.get_num_threads()
    torch.set_num_threads(min(threads, 8))  # a tiny model on a GPU host's many cores: mostly overhead
    try:
        with_control = {s: reference(tiny_model, ("canny",), (image,), (SCALE,), (0.0,), (1.0,), seed=s, **REQUEST)
                        for s in SEEDS}
        plain = {s: diffusers_pixels(tiny_model, "a red house", seed=s, **REQUEST) for s in SEEDS}
    finally:
        torch.set_num_threads(threads)
    assert max(psnr(with_control[s], plain[s]) for s in SEEDS) < MIN_PSNR
    return image, with_control


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_guided_controlnet_requests_match_diffusers(tiny_model, tmp_path, references, placement):
    image, want = references
    options = ExportOptions(device="cuda", dtype="fp32", runtime="graphs", max_size=256,
                            adapters=str(tiny_model / "adapters"), default_steps=4, **placement)
    server = TritonServer(export_repository(tiny_model, tmp_path / "repo", options),
                          http_port=0, grpc_port=0, metrics_port=0, ready_timeout=600).start()
    try:
        server.wait_ready()

        def one(seed):
            with EaselClient(server.url_grpc, protocol="grpc") as c:
                return seed, c.generate("a red house", seed=seed, controlnets=("canny",), control_images=(image,),
                                        control_scales=(SCALE,), **REQUEST)

        with ThreadPoolExecutor(len(SEEDS)) as pool:
            results = dict(pool.map(one, SEEDS))
        for seed, result in results.items():
            got = psnr(pixels(result), want[seed])
            assert got >= MIN_PSNR, (seed, got, result.info.get("denoiser"))
        served = {r.info["denoiser"] for r in results.values()}
        assert served == set(options.denoiser_names()), served
        replays = metric_values(server, "easel_controlnet_graph_replays_total")
        # Guided: one call of both rows a step, or one per row (a latent-parallel pair, a row split).
        calls = len(SEEDS) * REQUEST["steps"] * (2 if options.cfg_parallel or options.controlnet_row_split else 1)
        assert sum(replays.values()) == calls, replays
    finally:
        server.stop()
