"""backends/core/serving/load_board.py: what a denoiser publishes, every router reads; files of a server that
is gone are removed; a half-written value is not taken."""

from __future__ import annotations

import os
import stat
import struct

from backends.core.serving.load_board import PREFIX, Load, LoadReader, LoadWriter, board_path


def test_a_router_reads_what_the_denoiser_published(tmp_path):
    folder = str(tmp_path)
    reader = LoadReader(folder)
    assert reader("denoiser_gpu0") is None  # not started yet
    writer = LoadWriter("denoiser_gpu0", folder)
    assert writer.path == board_path("denoiser_gpu0", folder) and f"{PREFIX}{os.getppid()}-" in writer.path
    assert stat.S_IMODE(os.stat(writer.path).st_mode) == 0o600
    assert reader("denoiser_gpu0") == Load(0.0)  # nothing measured: no seconds, no rate
    writer.publish(Load(12.5))
    assert reader("denoiser_gpu0") == Load(12.5)
    measured = Load(12.5, seconds=0.2, row_step_s=0.016, dense=0.4, measured_at=12345.5, measured_steps=21)
    writer.publish(measured)
    assert reader("denoiser_gpu0") == measured
    assert reader("denoiser_gpu1") is None
    assert LoadReader(folder, server_pid=os.getppid() + 1)("denoiser_gpu0") is None  # another server's
    writer.close()
    assert reader("denoiser_gpu0") is None and not os.path.exists(writer.path)


def test_a_restarted_denoiser_is_read_again(tmp_path):
    folder = str(tmp_path)
    reader = LoadReader(folder)
    first = LoadWriter("d", folder)
    first.publish(Load(3.0))
    assert reader("d") == Load(3.0)
    second = LoadWriter("d", folder)  # a new instance in place of the old one
    second.publish(Load(7.0))
    assert reader("d") == Load(7.0)
    second.close()


def test_a_torn_value_is_not_taken(tmp_path):
    writer = LoadWriter("d", str(tmp_path))
    with open(writer.path, "r+b") as f:  # as if read between the two halves of a write
        f.write(struct.pack("<8d", 5.0, 0.1, 0.01, 1.0, 9.0, 0.1, 0.01, 1.0))
    assert LoadReader(str(tmp_path))("d") is None
    writer.publish(Load(9.0))
    assert LoadReader(str(tmp_path))("d") == Load(9.0)


def test_files_of_a_server_that_is_gone_are_removed(tmp_path):
    gone = 2**22 + 12345  # above the default pid_max
    while os.path.exists(f"/proc/{gone}"):
        gone += 1
    orphan = tmp_path / f"{PREFIX}{gone}-denoiser_gpu0"
    orphan.write_bytes(b"\0" * 64)
    alive = tmp_path / f"{PREFIX}{os.getpid()}-denoiser_gpu0"
    alive.write_bytes(b"\0" * 64)
    LoadWriter("d", str(tmp_path)).close()
    assert not orphan.exists() and alive.exists()
