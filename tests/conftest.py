"""Shared fixtures: tiny models written by our own code, exported repositories, real servers."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from export.tiny import write_tiny_pipeline
    from export.tiny_adapters import write_tiny_adapter_store

    path = write_tiny_pipeline(tmp_path_factory.mktemp("models") / "tiny", seed=0)
    write_tiny_adapter_store(path)  # <tiny>/adapters: ControlNets "canny" and "depth"
    return path


@pytest.fixture(scope="session")
def alt_model(tmp_path_factory):
    from export.tiny import write_tiny_pipeline

    return write_tiny_pipeline(tmp_path_factory.mktemp("models") / "alt", seed=3, variant="alt")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip with a reason where no CUDA device is visible (CI, dev machines)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); run tests/gpu/run.sh on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
