"""The adapter store's promise holds after start: a LoRA or ControlNet file
swapped for a symlink once the server has indexed the store is never read, whatever it points
to; the request is refused as not found, naming the adapter, never a path."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from clients.client import EaselClient, EaselError
from tests.server.test_controlnet import png

SMALL = dict(seed=1, steps=2, width=64, height=64)


@contextlib.contextmanager
def swapped(path: Path, target: Path):
    """`path` replaced by a symlink to `target` for the block, then put back."""
    saved = path.with_name(path.name + ".saved")
    os.rename(path, saved)
    try:
        os.symlink(target, path)
        yield
    finally:
        path.unlink()
        os.rename(saved, path)


@contextlib.contextmanager
def moved(path: Path, to: Path):
    """`path` renamed out of the store for the block, then put back."""
    os.rename(path, to)
    try:
        yield
    finally:
        os.rename(to, path)


def store(shared) -> Path:
    return Path(shared.repo).parent / "adapters"


@pytest.mark.parametrize("target", ["outside_lora", "/etc/passwd", "moved"])
def test_lora_swapped_for_a_symlink_after_start_is_never_read(shared, target):
    """`truncated` becomes a link to a good LoRA outside the store (followed, the request would
    succeed with it) or to /etc/passwd (followed, it would be read and refused as not a LoRA), or
    is renamed out of the store (the old error named the file's full path)."""
    outside = Path(shared.repo).parent / "outside" / "papercut.safetensors"
    path = store(shared) / "loras" / "truncated.safetensors"
    if target == "moved":
        change = moved(path, Path(shared.repo).parent / "outside" / "moved.safetensors")
    else:
        change = swapped(path, outside if target == "outside_lora" else Path(target))
    with EaselClient(shared.url_http) as c, change:
        with pytest.raises(EaselError) as err:
            c.generate("a fox", **SMALL, loras=("truncated",))
        message = str(err.value)
        assert "LoRA 'truncated' is no longer a file inside the adapter store" in message, message
        assert err.value.status == "404"
        assert "/" not in message.split("'easel', ", 1)[-1], message  # no server path
        assert c.generate("a fox", **SMALL, loras=("papercut",)).image().size == (64, 64)


def test_controlnet_config_swapped_for_a_symlink_after_start_is_never_read(shared):
    folder = store(shared) / "controlnets" / "broken"
    with EaselClient(shared.url_http) as c, swapped(folder / "config.json", Path("/etc/passwd")):
        with pytest.raises(EaselError) as err:
            c.generate("a boat", **SMALL, controlnets=("broken",), control_images=(png(1),))
        message = str(err.value)
        assert "ControlNet 'broken' is no longer a file inside the adapter store" in message, message
        assert err.value.status == "404"
        assert "/etc" not in message and str(folder) not in message
        assert c.is_ready()
