"""Files in /dev/shm named after the process that owns them (`<prefix><pid>-...`): the LoRA
loaders' hand-off segments and the denoisers' load board. An owner that was killed never removes
its own, so whoever starts next removes those of owners that are gone."""

from __future__ import annotations

import glob
import os


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
