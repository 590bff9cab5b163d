"""Process and /dev/shm bookkeeping for the tritonserver we start (Linux: /proc, prctl).

Kept apart from serve.py: these are the facts a supervisor checks (is our server the one on
the port, which stubs are its own, which shared-memory regions are ours) and the two things
a child must do before exec (umask, die with its parent).
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import socket
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
# Triton's Python backend names every region `<prefix><uuid>`; ours start with this (and the
# starting pid, for whoever reads /dev/shm), so a later start can find leftovers of a server
# that was killed (SIGKILL leaves them: nobody runs to unlink them).
REGION_PREFIX = "easel-triton-"
STUB_NAME = "triton_python_backend_stub"
PR_SET_PDEATHSIG = 1


def region_prefix(owner: int | None = None) -> str:
    return f"{REGION_PREFIX}{owner or os.getpid()}-{uuid.uuid4().hex[:8]}-"


def remove_regions(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink every region whose name starts with `prefix`; returns their names."""
    removed = []
    for path in shm_dir.glob(f"{prefix}*"):
        try:
            path.unlink()
            removed.append(path.name)
        except FileNotFoundError:
            pass
    return removed


def mapped_shm_names(shm_dir: Path = SHM_DIR) -> set[str]:
    """Names of the /dev/shm files that some process we may inspect has mapped."""
    names: set[str] = set()
    marker = f" {shm_dir}/"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "maps").read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            i = line.find(marker)
            if i >= 0:
                names.add(line[i + len(marker):].split(" ", 1)[0])
    return names


def sweep_stale_regions(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink our user's Easel regions that no process maps: left by a server that was killed
    (a running server, detached ones included, maps every region it made)."""
    candidates = [p for p in shm_dir.glob(f"{REGION_PREFIX}*") if _owned(p)]
    if not candidates:
        return []
    mapped = mapped_shm_names(shm_dir)
    removed = []
    for path in candidates:
        if path.name not in mapped:
            removed += remove_regions(path.name, shm_dir)
    if removed:
        log.info("removed %d shared-memory regions left by servers that were killed", len(removed))
    return removed


def _owned(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False


def child_preexec(die_with_parent: bool) -> Callable[[], None]:
    """What the tritonserver child runs between fork and exec.

    umask 077: Triton's Python backend creates the stubs' /dev/shm regions (which hold
    prompts and images) with the process umask; with the usual 022 every local user could
    read them. PR_SET_PDEATHSIG: the kernel sends SIGKILL to the server when the thread that
    forked it exits, so a SIGKILLed `easel serve` cannot leave a server holding its ports (the
    stubs notice their parent is gone and exit on their own). The signal follows the forking
    *thread*: start servers from a thread that lives as long as the process (the main one).
    """
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if die_with_parent else None

    def preexec() -> None:
        os.umask(0o077)
        if libc is not None:
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
                os._exit(126)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(126)

    return preexec


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    return text[text.rindex(")") + 2:].split()


def pid_alive(pid: int) -> bool:
    """True for a running process; False for a missing one or a zombie (dead, not reaped)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        for child in children(todo.pop()):
            seen.append(child)
            todo.append(child)
    return seen


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return []


def stub_instances(server_pid: int) -> dict[int, str]:
    """The server's Python backend stubs: pid -> model instance name (e.g. denoiser_0_0).

    The stub's argv is <stub> <model.py> <region> <size> <growth> <parent pid> <lib dir>
    <ipc handle> <instance name> <backend dir> (Python backend of Triton 2.51).
    """
    stubs = {}
    for pid in children(server_pid):
        argv = cmdline(pid)
        if argv and os.path.basename(argv[0]) == STUB_NAME and pid_alive(pid):
            stubs[pid] = argv[8] if len(argv) > 8 else "?"
    return stubs


def identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time in clock ticks since boot) of a live process, None for a gone one. A pid
    alone names another process once its own has exited and the kernel reuses the number: on
    hosts with pid_max 32768 that happens within one test run."""
    fields = _stat_fields(pid)
    return None if fields is None or fields[0] in ("Z", "X") else (pid, int(fields[19]))


def kill_all(identities: Iterable[tuple[int, int] | None]) -> None:
    """SIGKILL each process that still is the one `identity` saw (never a reused pid)."""
    for ident in identities:
        if ident is None or identity(ident[0]) != ident:
            continue
        try:
            os.kill(ident[0], signal.SIGKILL)
        except ProcessLookupError:
            pass


def stub_of(pid: int, region_prefix: str) -> bool:
    """Whether `pid` is a Python backend stub of the server whose regions are named by
    `region_prefix` (its argv's region, see stub_instances: unique to one server start)."""
    argv = cmdline(pid)
    return len(argv) > 2 and os.path.basename(argv[0]) == STUB_NAME and argv[2].startswith(region_prefix)


def port_in_use(port: int, host: str = "0.0.0.0") -> bool:
    """Whether something listens on (or holds) `port`, as tritonserver would bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: a port in TIME_WAIT after our own last server is free; a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(inode)
    return inodes


def listens_on(pid: int, port: int) -> bool:
    """Whether process `pid` itself holds the listening socket of `port`: a readiness answer
    on the port then comes from the server we started, not from another one."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return False
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in wanted:
                return True
        except OSError:
            continue
    return False


class RegionGuard(threading.Thread):
    """Keeps a server's /dev/shm regions at mode 0600 while it runs.

    The umask is not enough: Triton 2.51's Python backend creates its regions through Boost,
    which fchmods them to 0644 after creating them, and they hold prompts and images. We chmod
    each region as soon as it appears (every `interval_s`), long before the server admits its
    first request (regions are made while models load). What this cannot close: a local user
    who opens a region in the window between its creation and our chmod keeps that descriptor.
    """

    def __init__(self, prefix: str, interval_s: float = 0.05, shm_dir: Path = SHM_DIR):
        super().__init__(name="easel-region-guard", daemon=True)
        self.prefix, self.interval_s, self.shm_dir = prefix, interval_s, shm_dir
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.tighten()

    def tighten(self) -> int:
        changed = 0
        for path in self.shm_dir.glob(f"{self.prefix}*"):
            try:
                if path.stat().st_mode & 0o077:
                    path.chmod(0o600)
                    changed += 1
            except FileNotFoundError:
                continue
        return changed

    def halt(self) -> None:
        self._halt.set()
