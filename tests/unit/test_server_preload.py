"""The library preloaded into tritonserver (clients/server_preload.c), in a Python process of its
own: shm_open creates without group or other bits, an fchmod cannot add them to a /dev/shm object
(and is left alone elsewhere), and the admin key placeholder in an argument is replaced by the
key from the environment, which is then gone. tests/server/test_admin_surface.py checks the same
in a real tritonserver."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clients import server_preload

PROBE = """
import _posixshmem, os, stat, sys
name = "/easel-preload-probe-%d" % os.getpid()
fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o644)
created = stat.S_IMODE(os.fstat(fd).st_mode)
os.fchmod(fd, 0o666)
after = stat.S_IMODE(os.fstat(fd).st_mode)
os.close(fd)
_posixshmem.shm_unlink(name)
fd = os.open(sys.argv[2], os.O_CREAT | os.O_RDWR, 0o600)
os.fchmod(fd, 0o644)
other = stat.S_IMODE(os.fstat(fd).st_mode)
print(oct(created), oct(after), oct(other), sys.argv[1], os.environ.get("EASEL_SERVER_ADMIN_KEY"))
"""


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    built = server_preload.build(tmp_path_factory.mktemp("preload"))
    if built is None:
        pytest.skip("no C compiler on this host (the server then falls back: clients/server_preload.py)")
    return built


def test_shared_memory_stays_private_and_the_key_is_substituted(library, tmp_path):
    env = dict(os.environ)
    server_preload.apply(env, library, "k3y-of-the-operator-0123")
    out = subprocess.run([sys.executable, "-c", PROBE, f"--key=x:{server_preload.KEY_PLACEHOLDER}:y",
                          str(tmp_path / "plain")], env=env, capture_output=True, text=True,
                         check=True, umask=0o022)
    created, after, other, arg, inherited = out.stdout.split()
    assert (created, after) == ("0o600", "0o600")
    assert other == "0o644"  # (not shared memory: untouched)
    assert arg == "--key=x:k3y-of-the-operator-0123:y"
    assert inherited == "None"


def test_without_the_library_the_probe_sees_what_triton_does(tmp_path):
    """The test's power: the same probe, not preloaded, gets group/other bits."""
    out = subprocess.run([sys.executable, "-c", PROBE, "arg", str(tmp_path / "plain")], capture_output=True,
                         text=True, check=True, umask=0o022)
    created, after, _, _, _ = out.stdout.split()
    assert (created, after) == ("0o644", "0o666")
