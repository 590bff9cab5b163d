"""A small library preloaded into tritonserver (server_preload.c): private shared memory from the
first instant, and the admin key off the command line.

Triton 2.51's Python backend creates each stub's /dev/shm region through Boost, which fchmods it
to 0644 after creating it, whatever the umask; the regions carry prompts and images. And
tritonserver takes the key of its restricted APIs only as an argument, which any local user reads
in /proc/<pid>/cmdline. Preloaded, the library clears group and other bits at every shm_open and
at every fchmod of a /dev/shm object, and puts the key (from an environment variable, which only
the server's user can read) into the argument tritonserver parses, leaving a placeholder on the
command line.

It is compiled at each server start into the server's own run folder (made by mkdtemp, so no
other user can swap the library), with the host's C compiler. Without one the server still
starts: the key goes on the command line and clients.procs.RegionGuard tightens regions as they
appear, as before, and a warning says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("server_preload.c")
KEY_PLACEHOLDER = "@EASEL_ADMIN_KEY@"  # as in server_preload.c
KEY_ENV = "EASEL_SERVER_ADMIN_KEY"
COMPILERS = ("cc", "gcc", "clang")


def build(folder: Path) -> Path | None:
    """The library, compiled into `folder`; None (with a warning) where no compiler can build it."""
    compiler = next((c for c in (os.environ.get("CC"), *COMPILERS) if c and shutil.which(c)), None)
    if compiler is None:
        log.warning("no C compiler (cc, gcc or clang): tritonserver's /dev/shm regions are 0644 until "
                    "tightened, and its admin key is on its command line")
        return None
    out = folder / "libeasel_server_preload.so"
    argv = [compiler, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        log.warning("could not build %s (%s): tritonserver's /dev/shm regions are 0644 until tightened, and "
                    "its admin key is on its command line", SOURCE.name, done.stderr.strip()[-500:])
        return None
    return out


def apply(env: dict[str, str], library: Path, admin_key: str) -> None:
    """Preload `library` into the server started with `env`, which then carries the key."""
    env["LD_PRELOAD"] = ":".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    env[KEY_ENV] = admin_key
