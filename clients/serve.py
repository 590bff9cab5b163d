"""Launch tritonserver for an Easel model repository.

Our models name Python-based backends (`backend: "easel_<component>"`), whose
code lives in `<project>/backends/easel_*`. Triton only finds such backends in
its --backend-directory, next to the `python` backend, so every start
assembles a private backend directory (see `assemble_backend_dir`).
"""
from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

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
LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    """tritonserver exited or timed out before it became ready."""

    def __init__(self, message: str, failed_models: dict[str, str], log_tail: str):
        super().__init__(message)
        self.failed_models = failed_models
        self.log_tail = log_tail


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


def _link_or_copy(src: str, dst: str) -> str:
    # Hard links cost nothing and, unlike symlinks, do not resolve outside the
    # backend directory (Triton refuses libraries that escape it).
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


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
    for src in sorted((project / "backends").glob("easel_*")):
        if (src / "model.py").is_file():
            # Real copies so later edits in the checkout never affect a running server.
            shutil.copytree(src, dest / src.name, ignore=ignore, dirs_exist_ok=True)
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


def server_env(triton: TritonInstall, project: Path,
               base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    add_to_path(env, "LD_LIBRARY_PATH", list(triton.lib_dirs), front=True)
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


def scrape_metrics(port: int, names=(), prefixes: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Prometheus metrics from Triton's metrics port: name -> {label set: value}, for `names`
    (each present, if empty) and for every labelled metric whose name starts with one of `prefixes`."""
    text = urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=10).read().decode()
    values: dict[str, dict[str, float]] = {name: {} for name in names}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in values or (rest and not line.startswith("#") and name.startswith(prefixes)):
            values.setdefault(name, {})[rest.rsplit("}", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return values


def metric_totals(port: int, names) -> dict[str, float]:
    """Each metric summed over its label sets (models, instances)."""
    return {name: sum(by_label.values()) for name, by_label in scrape_metrics(port, names).items()}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_failures(log_text: str) -> dict[str, str]:
    """Model name -> reason for every model the log says failed to load."""
    failures: dict[str, str] = {}
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"failed to load '([^']+)' version \d+: (.*?)\"?$", line)
        if m:
            failures.setdefault(m[1], m[2].split("\\n")[0].strip())
            continue
        m = re.search(r"Poll failed for model directory '([^']+)': (.*?)\"?$", line)
        if m:
            reason = m[2]
            prev = lines[i - 1] if i else ""
            detail = re.search(r"Error parsing text-format \S+: (.*)", prev)
            if detail:
                reason += f" ({detail[1]})"
            failures.setdefault(m[1], reason)
            continue
        m = re.match(r"^\|\s*(\S+)\s*\|\s*\d+\s*\|\s*UNAVAILABLE: (.*?)\s*\|\s*$", line)
        if m:
            failures.setdefault(m[1], m[2])
    return failures


@dataclass(eq=False)
class TritonServer:
    """One tritonserver process. Port 0 picks a free port at start().

    `with TritonServer(repo, http_port=0) as s:` starts, waits until ready
    (raising ServerStartError with the log tail otherwise) and stops on exit.
    """

    repo: Path | str
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    ready_timeout: float = 300.0
    detach: bool = False  # own session, survives this process
    echo: bool = False  # mirror the server log to stderr
    run_dir: Path | None = None  # holds backends/ and server.log
    extra_args: tuple[str, ...] = ()
    project: Path | None = None
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _own_run_dir: bool = field(default=False, init=False, repr=False)
    _final_log: str | None = field(default=None, init=False, repr=False)
    _echo_stop: threading.Event = field(default_factory=threading.Event, init=False,
                                        repr=False)
    _echo_thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def url_http(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def url_grpc(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        assert self.run_dir is not None, "server not started"
        return self.run_dir / "server.log"

    def argv(self, binary: Path, backend_dir: Path) -> list[str]:
        return [
            str(binary),
            f"--model-repository={Path(self.repo).resolve()}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            f"--log-verbose={self.log_verbose}",
            "--exit-on-error=true",
            "--strict-readiness=true",
            *self.extra_args,
        ]

    def start(self) -> "TritonServer":
        if self.proc is not None:
            raise RuntimeError("server already started")
        repo = Path(self.repo)
        if not repo.is_dir():
            raise FileNotFoundError(f"model repository {repo} does not exist")
        for attr in ("http_port", "grpc_port", "metrics_port"):
            if getattr(self, attr) == 0:
                setattr(self, attr, free_port())
        triton = find_triton()
        project = self.project or project_root()
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="easel-triton-"))
            self._own_run_dir = not self.detach
        backend_dir = assemble_backend_dir(self.run_dir / "backends", triton, project,
                                           required_backends(repo))
        argv = self.argv(triton.binary, backend_dir)
        log.info("starting %s (log: %s)", " ".join(argv), self.log_path)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=server_env(triton, project), cwd=self.run_dir,
                # Own session: a terminal Ctrl-C reaches only us, and we forward
                # it once; detached servers also outlive our exit.
                start_new_session=True,
            )
        if not self.detach:
            atexit.register(self.stop)
        if self.echo:
            self._echo_thread = threading.Thread(target=self._follow_log, daemon=True)
            self._echo_thread.start()
        return self

    def _follow_log(self) -> None:
        sink = sys.stderr
        with open(self.log_path, "r", errors="replace") as f:
            while True:
                chunk = f.read()
                if chunk:
                    sink.write(chunk)
                    sink.flush()
                elif self._echo_stop.is_set():
                    return
                else:
                    time.sleep(0.2)

    def is_ready(self) -> bool:
        url = f"http://127.0.0.1:{self.http_port}/v2/health/ready"
        # No proxies: an http_proxy in the environment must not intercept localhost.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(url, timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float | None = None, interval: float = 0.5) -> None:
        if self.proc is None:
            raise RuntimeError("server not started")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self._start_error(f"tritonserver exited with code {code} "
                                        "before it became ready")
            if self.is_ready():
                log.info("tritonserver ready on http %s, grpc %s",
                         self.url_http, self.url_grpc)
                return
            if time.monotonic() > deadline:
                raise self._start_error(f"tritonserver not ready after {timeout:.0f} s")
            time.sleep(interval)

    def _start_error(self, headline: str) -> ServerStartError:
        text = self.log_text()
        failures = model_failures(text)
        tail = "\n".join(text.splitlines()[-LOG_TAIL_LINES:])
        parts = [f"{headline} (log: {self.log_path})"]
        if failures:
            parts.append("models that failed to load:")
            parts += [f"  {name}: {reason}" for name, reason in failures.items()]
        parts.append(f"--- last {LOG_TAIL_LINES} lines of the server log ---\n{tail}")
        return ServerStartError("\n".join(parts), failures, tail)

    def log_text(self) -> str:
        if self._final_log is not None:
            return self._final_log
        try:
            return self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return ""

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, grace: float = 30.0, cleanup: bool = True) -> int | None:
        """SIGTERM, then SIGKILL after `grace` s; returns the exit code.

        cleanup=False keeps the run dir (and so the full log) of a failed start.
        """
        atexit.unregister(self.stop)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver %d ignored SIGTERM for %.0f s; killing",
                            self.proc.pid, grace)
                self.proc.kill()
                self.proc.wait()
        self._echo_stop.set()
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=5)
        if cleanup and self._own_run_dir and self.run_dir is not None:
            self._final_log = self.log_text()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._own_run_dir = False
        return self.proc.returncode

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def serve(repo: Path | str, http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, log_verbose: int = 0, foreground: bool = True,
          timeout: float = 300.0, pid_file: Path | str | None = None,
          out: TextIO | None = None) -> int:
    """Run tritonserver on `repo`; returns a process exit code.

    foreground: stream the log, forward SIGINT/SIGTERM, return the server's
    exit code. Otherwise return 0 once ready, leaving the server running.
    """
    out = out or sys.stdout
    server = TritonServer(repo, http_port, grpc_port, metrics_port, log_verbose,
                          ready_timeout=timeout, detach=not foreground, echo=foreground)
    previous: dict[int, object] = {}
    if foreground:
        def forward(signum: int, _frame) -> None:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signum)
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    try:
        server.start()
        try:
            server.wait_ready()
        except ServerStartError as err:
            server.stop(cleanup=False)
            print(f"easel serve: {err}", file=sys.stderr)
            return 1
        if not foreground:
            if pid_file:
                Path(pid_file).write_text(f"{server.pid}\n")
            print(f"EASEL_SERVER_PID={server.pid}", file=out)
            print(f"EASEL_SERVER_LOG={server.log_path}", file=out)
            print(f"EASEL_SERVER_HTTP={server.url_http}", file=out)
            print(f"EASEL_SERVER_GRPC={server.url_grpc}", file=out)
            out.flush()
            return 0
        print(f"easel serve: ready (http {server.url_http}, grpc {server.url_grpc}, "
              f"metrics localhost:{server.metrics_port}); Ctrl-C to stop",
              file=sys.stderr, flush=True)
        code = server.wait()
        server.stop()
        return _exit_code(code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
