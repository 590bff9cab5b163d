"""Latent parallelism through a real tritonserver on two GPUs: `easel export --cfg-parallel 0:1`
(graphs runtime, fp32, the tiny model with its ControlNets), a guided request with a ControlNet
and one without guidance, against diffusers' CPU images of the same seeds.

Tolerance: PSNR >= 35 dB (CPU fp32 against GPU fp32, whose convolutions may run in TF32 and whose
kernels differ from the CPU's; the CPU server tests hold the split to 1/255). Needs two GPUs:
`tests/gpu/run.sh` on a host with two GPUs; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from clients.bench.image_metrics import psnr
from clients.client import EaselClient
from clients.serve import TritonServer
from export.repository import ExportOptions, export_repository
from tests.reference import diffusers_pixels
from tests.server.conftest import metric_values
from tests.server.test_controlnet import png
from tests.server.test_exact import pixels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="latent parallelism needs two GPUs")]


def test_cfg_parallel_server_on_two_gpus(tiny_model, tmp_path):
    options = ExportOptions(device="cuda", dtype="fp32", gpus=(0,), cfg_parallel=((0, 1),), runtime="graphs",
                            max_size=256, adapters=str(tiny_model / "adapters"), default_steps=4)
    repo = export_repository(tiny_model, tmp_path / "repo", options)
    server = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=600).start()
    try:
        server.wait_ready()
        with EaselClient(server.url_grpc, protocol="grpc") as c:
            for req in (dict(seed=4, steps=4, width=64, height=64, guidance_scale=6.0),
                        dict(seed=5, steps=4, width=64, height=64, guidance_scale=1.0)):
                ours = pixels(c.generate("a lighthouse", **req))
                want = diffusers_pixels(tiny_model, "a lighthouse", **req)
                assert psnr(ours, want) >= 35, req
            with_control = c.generate("a boat", seed=3, steps=4, width=64, height=64, controlnets=("canny",),
                                      control_images=(png(5),))
            assert with_control.image().size == (64, 64) and with_control.info["denoiser"] == "denoiser_gpu0"
        labels = metric_values(server, "easel_runtime_graph_steps_total")
        assert any('runtime="cfg-parallel graphs"' in k and v > 0 for k, v in labels.items()), labels
        # The guided ControlNet request's calls went per row, its constants kept by the service.
        assert sum(metric_values(server, "easel_controlnet_calls_total").values()) == 4 * 2
        assert sum(metric_values(server, "easel_controlnet_graph_replays_total").values()) == 4 * 2
    finally:
        server.stop()
