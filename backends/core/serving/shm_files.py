"""Files in /dev/shm named after the process that owns them (`<prefix><pid>-...`): the LoRA
loaders' hand-off segments, the denoisers' load board and the streams' preview files. An owner
that was killed never removes its own, so whoever starts next removes those of owners that are
gone."""

from __future__ import annotations

import glob
import os

SHM_DIR = "/dev/shm"


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_orphans(folder: str, prefix: str) -> None:
    """Unlink every `<prefix><pid>-*` file in `folder` whose process no longer exists."""
    for path in glob.glob(os.path.join(folder, f"{prefix}*")):
        pid = os.path.basename(path)[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            unlink(path)


def server_file(prefix: str, name: str, folder: str = SHM_DIR, server_pid: int | None = None) -> str:
    """`<prefix><server pid>-<name>` in `folder`, owned by the tritonserver process: the parent of
    every model's stub, so one server's models find each other's files and two servers on one
    host do not."""
    return os.path.join(folder, f"{prefix}{server_pid if server_pid is not None else os.getppid()}-{name}")
