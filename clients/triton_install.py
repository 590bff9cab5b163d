"""Where tritonserver comes from and what it needs to run our repository.

Our models name Python-based backends (`backend: "easel_<component>"`), whose
code lives in `<project>/backends/easel_*`. Triton only finds such backends in
its --backend-directory, next to the `python` backend, so every start
assembles a private backend directory (see `assemble_backend_dir`).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from clients.tools import add_to_path, package_dir, site_packages

log = logging.getLogger(__name__)

PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"
STUB = "triton_python_backend_stub"
PYTHON_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
# Model-config platforms served by a C++ backend of a different name.
PLATFORM_BACKENDS = {
    "tensorrt_plan": "tensorrt",
    "onnxruntime_onnx": "onnxruntime",
    "pytorch_libtorch": "pytorch",
    "tensorflow_graphdef": "tensorflow",
    "tensorflow_savedmodel": "tensorflow",
}


@dataclass(frozen=True)
class TritonInstall:
    root: Path  # folder holding bin/tritonserver and backends/
    binary: Path
    python_backend: Path  # folder with libtriton_python.so
    stub: Path
    lib_dirs: tuple[Path, ...] = ()  # needed on LD_LIBRARY_PATH


def find_triton() -> TritonInstall:
    """$TRITON_HOME (NGC image: /opt/tritonserver) wins over pytriton's bundled server."""
    home = os.environ.get("TRITON_HOME")
    pytriton = package_dir("pytriton")
    if home:
        root = Path(home).resolve()
    elif pytriton is not None:
        root = pytriton / "tritonserver"
    else:
        raise FileNotFoundError(
            "no tritonserver: set TRITON_HOME or install nvidia-pytriton"
        )
    binary = root / "bin" / "tritonserver"
    python_backend = root / "backends" / "python"
    # pytriton ships one stub per Python version; the stub embeds the
    # interpreter, so it must match the one whose site-packages we hand it.
    stub_candidates = [
        root / "python_backend_stubs" / PY_VERSION / STUB,
        python_backend / STUB,
    ]
    stub = next((p for p in stub_candidates if p.is_file()), None)
    missing = [p for p in (binary, *(python_backend / f for f in PYTHON_BACKEND_FILES))
               if not p.is_file()]
    if stub is None or missing:
        raise FileNotFoundError(
            f"incomplete tritonserver at {root}: missing "
            + ", ".join(str(p) for p in missing + ([] if stub else stub_candidates))
        )
    # The stub and server link libcudart etc. from the pytriton wheel's vendored libs (also
    # when TRITON_HOME points into an unpacked wheel, as on the GPU machine); their RPATH is
    # relative, which breaks once the stub is copied.
    lib_dirs = [root / "lib", root.parent.parent / "nvidia_pytriton.libs"]
    if pytriton is not None:
        lib_dirs.append(pytriton.parent / "nvidia_pytriton.libs")
    return TritonInstall(root, binary, python_backend, stub,
                         tuple(d for d in lib_dirs if d.is_dir()))


def project_root() -> Path:
    """Parent of the `backends` package, i.e. the repository checkout."""
    backends = package_dir("backends")
    if backends is not None and backends.name == "backends":
        return backends.parent
    return Path(__file__).resolve().parents[1]


def required_backends(repo: Path) -> set[str]:
    """Backends named by the repository's config.pbtxt files (ensembles need none)."""
    names: set[str] = set()
    for cfg in Path(repo).glob("*/config.pbtxt"):
        text = cfg.read_text(errors="replace")
        names.update(re.findall(r'^\s*backend\s*:\s*"([^"]+)"', text, re.M))
        for platform in re.findall(r'^\s*platform\s*:\s*"([^"]+)"', text, re.M):
            if platform in PLATFORM_BACKENDS:
                names.add(PLATFORM_BACKENDS[platform])
    return names


# Triton's CUDA memory pool on each GPU the repository names (tritonserver's default: 64 MiB).
# A BLS call's GPU outputs (a ControlNet's residuals: ~100 MiB at 1024 px with guidance) are
# allocated there; beyond it each output is a cudaMalloc, a CUDA IPC handle opened by both
# stubs and a cudaFree that waits for everything queued on the GPU, the UNet's half included
# (bench/micro/bls_transport.py).
DEFAULT_CUDA_POOL_MIB = 2048


def repository_gpus(repo: Path) -> list[int]:
    """The GPU ids that the repository's instance groups name (read as required_backends reads
    backends: a config Triton will refuse is Triton's to report)."""
    gpus: set[int] = set()
    for cfg in Path(repo).glob("*/config.pbtxt"):
        for ids in re.findall(r"\bgpus\s*:\s*\[([^\]]*)\]", cfg.read_text(errors="replace")):
            gpus.update(int(g) for g in re.findall(r"\d+", ids))
    return sorted(gpus)


def _link_or_copy(src: str, dst: str) -> str:
    # Hard links cost nothing and, unlike symlinks, do not resolve outside the
    # backend directory (Triton refuses libraries that escape it).
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


# What every model.py imports first (backends/triton/bootstrap.py says why), copied beside each
# one: the stub's sys.path holds the model's folder but neither PYTHONPATH nor the checkout.
BOOTSTRAP = Path("backends/triton/bootstrap.py")
BOOTSTRAP_MODULE = "easel_bootstrap.py"


def assemble_backend_dir(dest: Path, triton: TritonInstall, project: Path,
                         needed: set[str] = frozenset()) -> Path:
    """Fill `dest` with python/ (lib, utils, stub), copies of backends/easel_*,
    and any other C++ backend the repository names."""
    dest.mkdir(parents=True, exist_ok=True)
    py = dest / "python"
    py.mkdir(exist_ok=True)
    for name in PYTHON_BACKEND_FILES:
        _link_or_copy(str(triton.python_backend / name), str(py / name))
    _link_or_copy(str(triton.stub), str(py / STUB))
    if not os.access(py / STUB, os.X_OK):  # a hard link shares the source's mode
        os.chmod(py / STUB, 0o755)

    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    bootstrap = project / BOOTSTRAP
    for src in sorted((project / "backends").glob("easel_*")):
        if (src / "model.py").is_file():
            # Real copies so later edits in the checkout never affect a running server.
            shutil.copytree(src, dest / src.name, ignore=ignore, dirs_exist_ok=True)
            if bootstrap.is_file():  # beside model.py: the stub puts only that folder on sys.path
                shutil.copy2(bootstrap, dest / src.name / BOOTSTRAP_MODULE)
    for name in sorted(needed):
        if name == "python" or (dest / name).exists():
            continue
        src = triton.root / "backends" / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=ignore,
                            copy_function=_link_or_copy, dirs_exist_ok=True)
        else:
            log.warning("backend %r is named by a model but exists neither in %s "
                        "nor in %s", name, project / "backends", triton.root / "backends")
    return dest


def link_own_libpython(dest: Path) -> Path | None:
    """`dest` holding a link to this interpreter's own shared libpython, or None where it has none
    (a static build: the stub then links the system's libpython of the same version).

    The stub embeds whichever libpython3.X.so.1.0 the loader finds, but imports the standard
    library and its compiled modules of the Python whose venv it is handed. A system libpython
    of another patch release cannot load them: Debian's 3.11.2 fails on pyenv 3.11.7's `_ssl`
    (undefined symbol _PyModule_Add), which huggingface_hub imports through httpx2. A folder
    with this one file, not the interpreter's whole LIBDIR, so that nothing else is shadowed."""
    name = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if not (sysconfig.get_config_var("Py_ENABLE_SHARED") and name and libdir and (Path(libdir) / name).is_file()):
        return None
    dest.mkdir(parents=True, exist_ok=True)
    link = dest / name
    link.unlink(missing_ok=True)
    link.symlink_to(Path(libdir) / name)
    return dest


def server_env(triton: TritonInstall, project: Path,
               base: dict[str, str] | None = None, libpython_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    add_to_path(env, "LD_LIBRARY_PATH", list(triton.lib_dirs), front=True)
    if libpython_dir is not None:
        add_to_path(env, "LD_LIBRARY_PATH", [libpython_dir], front=True)
    # The stub's embedded interpreter does not know about the venv; model.py
    # files call site.addsitedir on each PYTHONPATH entry (for .pth files too).
    # Folders already on PYTHONPATH keep precedence (the GPU machine's bundle pins numpy<2
    # there, which this Python backend needs).
    add_to_path(env, "PYTHONPATH", [*site_packages(), project], front=False)
    # Folders for the server's Python only, ahead of everything: Triton 2.51's Python backend
    # stub needs numpy<2, so a host whose Python has numpy 2 (the GPU image) points this at a
    # numpy<2 folder without changing its own Python.
    add_to_path(env, "PYTHONPATH", [p for p in env.get("EASEL_SERVER_PYTHONPATH", "").split(os.pathsep) if p],
                front=True)
    return env
