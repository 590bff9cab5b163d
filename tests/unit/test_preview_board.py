"""Previews from a denoiser to easel_stream through /dev/shm files (backends/core/serving/preview_board.py):
the caller makes the file, the denoiser writes into it only if it exists, a read mid-write
takes nothing, keys cannot name a path."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from backends.core.serving.preview_board import PREFIX, PreviewFile, preview_path, remove_orphan_previews, write_preview


def latents(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, 8, 16), dtype=np.float32)


def test_a_preview_goes_from_the_writer_to_the_callers_file(tmp_path):
    where = dict(folder=str(tmp_path), server_pid=1)
    previews = PreviewFile("k1", **where)
    assert previews.read() is None  # nothing written yet
    assert os.stat(previews.path).st_mode & 0o777 == 0o600
    for step in (2, 4):
        assert write_preview("k1", step, latents(step), **where)
        got_step, got = previews.read()
        assert got_step == step and np.array_equal(got, latents(step))
    previews.close()
    assert not os.path.exists(previews.path)
    assert previews.read() is None


def test_the_denoiser_writes_no_file_its_caller_did_not_make(tmp_path):
    """A request sent to a denoiser directly, with previews and a key: nothing lands in /dev/shm."""
    assert not write_preview("direct", 1, latents(0), folder=str(tmp_path), server_pid=1)
    assert list(tmp_path.iterdir()) == []


def test_a_read_during_a_write_takes_nothing(tmp_path):
    where = dict(folder=str(tmp_path), server_pid=1)
    previews = PreviewFile("k", **where)
    write_preview("k", 3, latents(3), **where)
    with open(previews.path, "r+b") as f:  # a write in progress: the counter is odd
        count = int.from_bytes(f.read(8), "little")
        f.seek(0)
        f.write((count + 1).to_bytes(8, "little"))
    assert previews.read() is None
    assert write_preview("k", 4, latents(4), **where)  # the next write recovers
    assert previews.read()[0] == 4


@pytest.mark.parametrize("key", ["", "../etc/passwd", "a/b", "x" * 65, "k\0", "ké"])
def test_a_key_never_names_a_path(key, tmp_path):
    with pytest.raises(ValueError, match="preview key"):
        preview_path(key, str(tmp_path), 1)
    with pytest.raises(ValueError, match="preview key"):
        write_preview(key, 1, latents(0), folder=str(tmp_path), server_pid=1)


def test_a_files_name_does_not_give_its_key_away(tmp_path):
    """The key also cancels its request: a local user listing /dev/shm must not learn it."""
    key = uuid.uuid4().hex
    path = preview_path(key, str(tmp_path), 1)
    assert key not in path and key[:8] not in os.path.basename(path)
    assert path == preview_path(key, str(tmp_path), 1) != preview_path(uuid.uuid4().hex, str(tmp_path), 1)


def test_a_symlink_in_place_of_the_file_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    os.symlink(target, preview_path("k", str(tmp_path), 1))
    with pytest.raises(OSError):
        write_preview("k", 1, latents(0), folder=str(tmp_path), server_pid=1)
    with pytest.raises(OSError):
        PreviewFile("k", folder=str(tmp_path), server_pid=1)
    assert target.read_bytes() == b"keep"


def test_files_of_a_server_that_is_gone_are_removed(tmp_path):
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    PreviewFile("old", folder=str(tmp_path), server_pid=dead)
    live = PreviewFile("new", folder=str(tmp_path), server_pid=os.getpid())
    remove_orphan_previews(str(tmp_path))
    assert [str(p) for p in tmp_path.iterdir()] == [live.path]
    assert os.path.basename(live.path).startswith(f"{PREFIX}{os.getpid()}-")
    live.close()
