"""Locate binaries and shared libraries that pip wheels ship without wiring up.

Nothing here imports the packages it inspects: `find_spec` only resolves paths,
so this stays cheap and safe in processes that must not load CUDA.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import site
import sys
from pathlib import Path


def site_packages() -> list[Path]:
    """Site-packages dirs of the running interpreter (the venv's, inside a venv)."""
    dirs = [Path(p) for p in site.getsitepackages()]
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and user and Path(user).is_dir():
        dirs.append(Path(user))
    return [d for d in dirs if d.is_dir()]


def package_dir(name: str) -> Path | None:
    """Directory of an installed top-level package, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    if spec.origin:
        return Path(spec.origin).resolve().parent
    return None


def add_to_path(env: dict[str, str], key: str, entries: list[Path | str], *, front: bool) -> None:
    """Put `entries` in front of (or after) the os.pathsep list `env[key]`, skipping duplicates."""
    current = [p for p in env.get(key, "").split(os.pathsep) if p]
    new = [e for e in dict.fromkeys(map(str, entries)) if e not in current]
    env[key] = os.pathsep.join(new + current if front else current + new)


def perf_analyzer_path() -> Path:
    """perf_analyzer from tritonclient[all]: the venv's bin/, else $PATH."""
    candidate = Path(sys.prefix) / "bin" / "perf_analyzer"
    if candidate.is_file():
        return candidate
    found = shutil.which("perf_analyzer")
    if found:
        return Path(found)
    raise FileNotFoundError(
        "perf_analyzer not found: install tritonclient[all] into this venv"
    )


def perf_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for perf_analyzer.

    The 2.50 wheel links libcudart.so.12 but does not depend on a CUDA wheel;
    pip's nvidia-cuda-runtime-cu12 provides it under nvidia/cuda_runtime/lib.
    (libb64.so.0d must come from the OS: Debian package libb64-0d.)
    """
    env = dict(os.environ if base is None else base)
    libs = [sp / "nvidia" / "cuda_runtime" / "lib" for sp in site_packages()]
    add_to_path(env, "LD_LIBRARY_PATH", [p for p in libs if p.is_dir()], front=True)
    return env
