"""What a server start hands tritonserver's Python stub: this interpreter's own libpython."""
from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from clients.triton_install import find_triton, link_own_libpython, project_root, server_env


def test_the_stub_finds_this_interpreters_own_libpython_first(tmp_path):
    """The stub embeds whichever libpython the loader finds first; it must be the build whose
    standard library and compiled modules it imports (a system libpython of another patch release
    failed on pyenv's `_ssl`)."""
    libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and (Path(libdir) / name).is_file()):
        pytest.skip("this Python has no shared libpython: the stub takes the system's")
    folder = link_own_libpython(tmp_path / "libpython")
    assert folder is not None and os.listdir(folder) == [name]
    assert (folder / name).resolve() == (Path(libdir) / name).resolve()
    env = server_env(find_triton(), project_root(), base={"LD_LIBRARY_PATH": "/elsewhere"}, libpython_dir=folder)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(folder)
    assert link_own_libpython(tmp_path / "libpython") == folder  # a second start in the same run dir


def test_a_static_python_leaves_the_loader_alone(tmp_path, monkeypatch):
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda key: 0 if key == "Py_ENABLE_SHARED" else real(key))
    assert link_own_libpython(tmp_path / "libpython") is None
    assert not (tmp_path / "libpython").exists()
    env = server_env(find_triton(), project_root(), base={"LD_LIBRARY_PATH": "/elsewhere"})
    assert str(tmp_path) not in env["LD_LIBRARY_PATH"]
