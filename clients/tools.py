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


LAUNCHER_MARK = "# easel perf_analyzer launcher"


def install_perf_launcher(prefix: Path | None = None) -> Path | None:
    """Make `<venv>/bin/perf_analyzer` run as it is, with no LD_LIBRARY_PATH set by hand.

    tritonclient 2.50 installs the binary there, but it links libcudart.so.12 from pip's
    nvidia-cuda-runtime-cu12, which the loader does not search. The binary moves to
    `<venv>/libexec/perf_analyzer` and a launcher that adds the library folder takes its place.
    Idempotent, and safe to re-run after pip reinstalls tritonclient (`make setup` does).
    Returns the launcher, or None when there is no perf_analyzer to wrap.
    """
    prefix = Path(sys.prefix if prefix is None else prefix)
    launcher, real = prefix / "bin" / "perf_analyzer", prefix / "libexec" / "perf_analyzer"
    if not launcher.is_file():
        return None
    if launcher.read_bytes()[:4] == b"\x7fELF":  # the binary itself: (re)installed by pip
        real.parent.mkdir(parents=True, exist_ok=True)
        os.replace(launcher, real)
    if not real.is_file():
        return None
    libs = os.pathsep.join(str(d) for d in (sp / "nvidia" / "cuda_runtime" / "lib" for sp in site_packages())
                           if d.is_dir())
    launcher.write_text(
        "#!/bin/sh\n"
        f"{LAUNCHER_MARK} (clients/tools.py install_perf_launcher): the binary links\n"
        "# libcudart.so.12 from pip's nvidia-cuda-runtime-cu12, which the loader does not search.\n"
        f'LD_LIBRARY_PATH="{libs}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" exec "{real}" "$@"\n')
    launcher.chmod(0o755)
    return launcher


if __name__ == "__main__":
    if sys.argv[1:] == ["perf-launcher"]:
        print(install_perf_launcher() or "no perf_analyzer in this environment")
    else:
        sys.exit("usage: python -m clients.tools perf-launcher")
