"""A real tritonserver on an exported tiny repository, shared by the server tests."""

from __future__ import annotations

import dataclasses

import pytest

from clients.client import EaselClient
from clients.serve import TritonServer, scrape_metrics
from export.repository import ExportOptions, export_repository

# Small enough for two CPU cores, large enough that the limits tests have room.
OPTIONS = ExportOptions(device="cpu", max_size=256, max_steps=50, default_steps=4)


def start_server(model, repo):
    adapters = model / "adapters"
    options = dataclasses.replace(OPTIONS, adapters=str(adapters) if adapters.is_dir() else None)
    export_repository(model, repo, options)
    return TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=300).start()


@pytest.fixture(scope="session")
def tiny_repo(tiny_model, tmp_path_factory):
    return tmp_path_factory.mktemp("repos") / "tiny"


@pytest.fixture(scope="session")
def server(tiny_model, tiny_repo):
    srv = start_server(tiny_model, tiny_repo)
    srv.wait_ready()
    yield srv
    srv.stop()


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
