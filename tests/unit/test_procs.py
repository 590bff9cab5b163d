"""clients/procs.py on real processes, sockets and /dev/shm files (no tritonserver)."""
from __future__ import annotations

import mmap
import os
import socket
import stat
import subprocess
import sys
import time
import uuid

from clients import procs


def _region(name: str, mode: int = 0o644):
    path = procs.SHM_DIR / name
    fd = os.open(path, os.O_CREAT | os.O_RDWR, mode)
    os.fchmod(fd, mode)  # what Boost does in Triton's Python backend
    os.ftruncate(fd, 4096)
    return path, fd


def test_sweep_removes_only_regions_nobody_maps():
    tag = uuid.uuid4().hex[:8]
    left, fd_left = _region(f"{procs.REGION_PREFIX}1-{tag}-left")
    used, fd_used = _region(f"{procs.REGION_PREFIX}1-{tag}-used")
    os.close(fd_left)
    mapping = mmap.mmap(fd_used, 4096)
    try:
        procs.sweep_stale_regions()
        assert not left.exists()
        assert used.exists()  # a live server (ours, detached, another user's tests) maps it
    finally:
        mapping.close()
        os.close(fd_used)
        used.unlink()


def test_region_guard_tightens_to_0600():
    prefix = procs.region_prefix()
    path, fd = _region(f"{prefix}a")
    os.close(fd)
    try:
        assert procs.RegionGuard(prefix).tighten() == 1
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        path.unlink()


def test_listens_on_tells_whose_port_it_is():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert procs.port_in_use(port)
        assert procs.listens_on(os.getpid(), port)
        assert not procs.listens_on(os.getppid(), port)
    assert not procs.port_in_use(port)
    assert not procs.listens_on(os.getpid(), port)


def test_child_gets_umask_077():
    done = subprocess.run(["sh", "-c", "umask"], preexec_fn=procs.child_preexec(False),
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "0077"


def test_child_dies_with_its_parent():
    # A middle process starts `sleep` the way TritonServer starts tritonserver, prints its pid and
    # exits (as a SIGKILLed easel serve would): the kernel must kill the sleep.
    code = ("import subprocess, sys; from clients import procs; "
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=procs.child_preexec(True)); print(p.pid)")
    middle = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    pid = int(middle.stdout)
    deadline = time.monotonic() + 5
    while procs.pid_alive(pid):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)


def test_kill_all_spares_a_process_that_is_not_the_one_seen():
    """A pid seen earlier may name another process by the time it is killed (pid reuse): kill_all
    takes identities (pid, start time) and kills only a process that still matches one."""
    proc = subprocess.Popen(["sleep", "60"])
    try:
        seen = procs.identity(proc.pid)
        assert seen is not None and seen[0] == proc.pid
        procs.kill_all([(proc.pid, seen[1] + 1), None])  # the same pid, started at another time
        time.sleep(0.2)
        assert proc.poll() is None, "a process that was not the one seen was killed"
        procs.kill_all([seen])
        assert proc.wait(timeout=5) == -9
        assert procs.identity(proc.pid) is None
    finally:
        proc.kill()
        proc.wait()
