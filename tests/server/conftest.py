"""A real tritonserver on an exported tiny repository, shared by the server tests."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clients.client import EaselClient
from clients.serve import LOG_TAIL_LINES, TritonServer, scrape_metrics
from export.repository import ExportOptions, export_repository

# Small enough for two CPU cores, large enough that the limits tests have room. 200 steps: a
# request that must still be running seconds later (cancel, deadline, crash) takes 200 steps at
# 256 px, about 3.6 s here; 50 of them took 0.9 s on a 2-core machine, inside a 1 s deadline.
OPTIONS = ExportOptions(device="cpu", max_size=256, max_steps=200, default_steps=4)


def start_server(model, repo):
    adapters = model / "adapters"
    options = dataclasses.replace(OPTIONS, adapters=str(adapters) if adapters.is_dir() else None)
    export_repository(model, repo, options)
    return TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300).start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test whose shared server has died carries the end of that server's log: CI keeps
    nothing else of it, and the tests after it fail only with "connection refused"."""
    report = (yield).get_result()
    if report.when != "call" or not report.failed:
        return
    for name, value in getattr(item, "funcargs", {}).items():
        if isinstance(value, TritonServer) and value.proc is not None and value.proc.poll() is not None:
            tail = "\n".join(value.log_text().splitlines()[-LOG_TAIL_LINES:])
            report.sections.append((f"tritonserver `{name}` exited with {value.proc.returncode}", tail))


@pytest.fixture(scope="package")
def tiny_repo(tiny_model, tmp_path_factory):
    return tmp_path_factory.mktemp("repos") / "tiny"


@pytest.fixture(scope="package")
def server(tiny_model, tiny_repo):
    srv = start_server(tiny_model, tiny_repo)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="package")
def shared(tiny_model, tmp_path_factory):
    """A second server: two CPU denoisers sharing one ControlNet service, on a copy of the tiny
    store with broken adapters added (tests/server/test_controlnet_service.py, test_lora.py). Each
    denoiser splits guidance over two copies of the UNet (latent parallelism's wiring on the CPU),
    so what these tests compare with `server` also checks that path (test_cfg_parallel.py)."""
    root = tmp_path_factory.mktemp("shared")
    store = root / "adapters"
    shutil.copytree(tiny_model / "adapters", store)
    broken = store / "controlnets" / "broken"
    shutil.copytree(store / "controlnets" / "canny", broken)
    weights = broken / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    write_broken_loras(store / "loras", root / "outside")
    options = dataclasses.replace(OPTIONS, adapters=str(store), cpu_denoisers=2, cpu_cfg_parallel=True)
    export_repository(tiny_model, root / "repo", options)
    srv = TritonServer(root / "repo", http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300).start()
    srv.wait_ready()
    yield srv
    srv.stop()


# papercut's first layer, as named in its (diffusers/PEFT) file
PAPERCUT_LAYER = "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k"


def write_broken_loras(loras, outside):
    """LoRAs that must fail their request alone: a layer a column too wide for the UNet, a layer
    the UNet does not have, a truncated file; a pickle and a symlink out of the store, which the
    store never indexes."""
    papercut = load_file(loras / "papercut.safetensors")
    down = papercut[f"{PAPERCUT_LAYER}.lora_A.weight"]
    save_file({**papercut, f"{PAPERCUT_LAYER}.lora_A.weight": torch.ones(down.shape[0], down.shape[1] + 1)},
              loras / "misfit.safetensors")
    save_file({k.replace("attentions.0.", "attentions.7."): v for k, v in papercut.items()},
              loras / "absent.safetensors")
    (loras / "truncated.safetensors").write_bytes((loras / "papercut.safetensors").read_bytes()[:5000])
    (loras / "pickled.ckpt").write_bytes(b"\x80\x04K\x01.")  # pickle.dumps(1): must never be opened
    outside.mkdir()
    shutil.copy(loras / "papercut.safetensors", outside / "papercut.safetensors")
    (loras / "escape.safetensors").symlink_to(outside / "papercut.safetensors")


@pytest.fixture(params=["http", "grpc"])
def client(request, server):
    url = server.url_http if request.param == "http" else server.url_grpc
    with EaselClient(url, protocol=request.param) as c:
        yield c


@pytest.fixture
def http_client(server):
    with EaselClient(server.url_http, protocol="http") as c:
        yield c


def metric_values(server, name: str) -> dict[str, float]:
    """The values of one Prometheus metric on the server's metrics port, by label set."""
    return scrape_metrics(server.metrics_port, [name])[name]


def metric_total(server, name: str) -> float:
    """One Prometheus metric on the server's metrics port, summed over its label sets."""
    return sum(metric_values(server, name).values())
