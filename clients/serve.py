"""Launch tritonserver for an Easel model repository.

TritonServer: one tritonserver process (start, readiness, stop, drain, the admin API); where the
server and its backends come from is clients/triton_install.py.
"""
from __future__ import annotations

import atexit
import json
import logging
import re
import secrets
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

from backends.core.request.contract import DRAIN_FLAG_ENV, INTERNAL_KEY_ENV, INTERNAL_KEY_PARAMETER
from backends.core.serving.load_board import PREFIX as LOAD_BOARD_PREFIX
from clients import procs, server_preload
from clients.triton_install import (DEFAULT_CUDA_POOL_MIB, assemble_backend_dir, find_triton, link_own_libpython,
                                     project_root, repository_gpus, required_backends, server_env)

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
# The header that carries the admin key. gRPC metadata keys are lower case, and Triton expects
# them prefixed: a gRPC client sends GRPC_ADMIN_HEADER.
ADMIN_HEADER = "easel-admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"
ADMIN_KEY_CHARS = re.compile(r"[A-Za-z0-9._~-]{16,}")
# Closed to ordinary clients (Triton's restricted-API categories of 2.51). Client shared memory
# let a client map a stub's /dev/shm region as its own tensor (reading other requests' data)
# and abort the server; logging, tracing and the model repository (load/unload, in explicit
# mode) are operators' tools. Open: health, metadata, model-config, inference and statistics:
# perf_analyzer reads the statistics API and stops with an error without it, and the open
# metrics port publishes the same counters anyway.
RESTRICTED_APIS = ("shared-memory", "logging", "trace", "model-repository")
# What marks a model clients call (and the drain switches): `easel` and `easel_stream` (their backend).
PUBLIC_CONFIG = r'^\s*backend\s*:\s*"easel_pipeline"'
DRAIN_FLAG_FILE = "draining"


class ServerStartError(RuntimeError):
    """tritonserver exited or timed out before it became ready."""

    def __init__(self, message: str, failed_models: dict[str, str], log_tail: str):
        super().__init__(message)
        self.failed_models = failed_models
        self.log_tail = log_tail


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
    # None: a random key that only this object knows, so the restricted APIs stay closed to
    # everyone but us (we need the model-repository API to drain).
    admin_key: str | None = field(default=None, repr=False)
    restricted_apis: tuple[str, ...] = RESTRICTED_APIS
    exit_timeout: int = 30  # tritonserver --exit-timeout-secs: its own wait for in-flight work
    cuda_pool_mib: int = DEFAULT_CUDA_POOL_MIB  # per GPU of the repository; 0: tritonserver's default
    die_with_parent: bool | None = None  # None: unless detached (procs.child_preexec)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    region_prefix: str | None = field(default=None, init=False, repr=False)
    # What opens the internal models to a call (backends/triton/adapter.check_caller), new at each start.
    internal_key: str | None = field(default=None, init=False, repr=False)
    _stubs: dict[int, str] = field(default_factory=dict, init=False, repr=False)
    _guard: procs.RegionGuard | None = field(default=None, init=False, repr=False)
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

    @property
    def drain_flag(self) -> Path:
        assert self.run_dir is not None, "server not started"
        return self.run_dir / DRAIN_FLAG_FILE

    @property
    def internal_parameters(self) -> dict[str, str]:
        """Request parameters that let a call reach an internal model directly (tests, tools)."""
        assert self.internal_key is not None, "server not started"
        return {INTERNAL_KEY_PARAMETER: self.internal_key}

    @property
    def admin_headers(self) -> dict[str, str]:
        assert self.admin_key is not None, "server not started"
        return {ADMIN_HEADER: self.admin_key}

    def argv(self, binary: Path, backend_dir: Path, key: str | None = None) -> list[str]:
        """`key`: what stands for the admin key on the command line (default: the key itself)."""
        assert self.admin_key is not None and self.region_prefix is not None
        restricted = f"{','.join(self.restricted_apis)}:{ADMIN_HEADER}={key or self.admin_key}"
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
            # Explicit model control with every model loaded at start, as mode "none" would:
            # draining loads and unloads the public models (see drain()), which only this mode allows.
            "--model-control-mode=explicit",
            "--load-model=*",
            *([f"--http-restricted-api={restricted}",
               f"--grpc-restricted-protocol={restricted}"] if self.restricted_apis else []),
            f"--backend-config=python,shm-region-prefix-name={self.region_prefix}",
            f"--exit-timeout-secs={self.exit_timeout}",
            *self.cuda_pool_args(),
            *self.extra_args,
        ]

    def cuda_pool_args(self) -> list[str]:
        if not self.cuda_pool_mib or any(a.startswith("--cuda-memory-pool-byte-size") for a in self.extra_args):
            return []
        return [f"--cuda-memory-pool-byte-size={gpu}:{self.cuda_pool_mib * 2**20}"
                for gpu in repository_gpus(Path(self.repo))]

    def start(self) -> "TritonServer":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("server already started")
        self.proc = None
        repo = Path(self.repo)
        if not repo.is_dir():
            raise FileNotFoundError(f"model repository {repo} does not exist")
        procs.sweep_stale_regions()
        if self.admin_key is None:
            self.admin_key = secrets.token_urlsafe(32)
        if not ADMIN_KEY_CHARS.fullmatch(self.admin_key):
            # It goes inside tritonserver's "<apis>:<header>=<key>" option.
            raise ValueError("the admin key must be 16 or more of A-Z a-z 0-9 . _ ~ -")
        self.region_prefix = procs.region_prefix()
        self._guard = None
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
        self.drain_flag.unlink(missing_ok=True)  # a run dir given again must not start draining
        env = server_env(triton, project, libpython_dir=link_own_libpython(self.run_dir / "libpython"))
        env[DRAIN_FLAG_ENV] = str(self.drain_flag)
        self.internal_key = env[INTERNAL_KEY_ENV] = secrets.token_urlsafe(32)
        preload = server_preload.build(self.run_dir)
        if preload is not None:
            server_preload.apply(env, preload, self.admin_key)
        argv = self.argv(triton.binary, backend_dir, server_preload.KEY_PLACEHOLDER if preload else None)
        shown = [re.sub(rf"{ADMIN_HEADER}=\S+", f"{ADMIN_HEADER}=***", a) for a in argv]
        log.info("starting %s (log: %s)", " ".join(shown), self.log_path)
        die_with_parent = (not self.detach) if self.die_with_parent is None else self.die_with_parent
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.run_dir,
                # Own session: a terminal Ctrl-C reaches only us, and we forward
                # it once; detached servers also outlive our exit.
                start_new_session=True,
                preexec_fn=procs.child_preexec(die_with_parent),
            )
        if preload is None:  # (preloaded, the regions are private from the start)
            self._guard = procs.RegionGuard(self.region_prefix)
            self._guard.start()
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
            # Ready only if the answer comes from our process: another server on the port
            # (an orphan, a second deployment) must not make us report ready.
            if self.is_ready() and procs.listens_on(self.proc.pid, self.http_port):
                self._stubs = procs.stub_instances(self.proc.pid)
                if self._guard is not None:
                    self._guard.tighten()  # a detached server keeps no guard after we exit
                log.info("tritonserver ready on http %s, grpc %s (%d stubs)",
                         self.url_http, self.url_grpc, len(self._stubs))
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

    def stop(self, grace: float = 30.0, cleanup: bool = True,
             signum: int = signal.SIGTERM) -> int | None:
        """`signum` (SIGTERM), then SIGKILL after `grace` s; returns the exit code.

        cleanup=False keeps the run dir (and so the full log) of a failed start.
        """
        atexit.unregister(self.stop)
        if self.proc is None:
            return None
        family = self._family()
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver %d ignored signal %d for %.0f s; killing",
                            self.proc.pid, signum, grace)
                self.proc.kill()
                self.proc.wait()
        self._reap(family)
        self._echo_stop.set()
        if self._echo_thread is not None:
            self._echo_thread.join(timeout=5)
        if cleanup and self._own_run_dir and self.run_dir is not None:
            self._final_log = self.log_text()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._own_run_dir = False
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL the server and everything it started, then remove its regions."""
        atexit.unregister(self.stop)
        if self.proc is None:
            return None
        family = self._family()
        self.proc.kill()
        self.proc.wait()
        self._reap(family)
        return self.proc.returncode

    def _family(self) -> list[tuple[int, int] | None]:
        """The server's descendants by identity (pid and start time: their pids may be reused once
        they exit during a stop's grace period). Only while our child is alive (or an unreaped
        zombie) is its pid surely still its own, so a gone server has none."""
        return [procs.identity(p) for p in procs.descendants(self.proc.pid)] if self.proc.poll() is None else []

    def _reap(self, family: list[tuple[int, int] | None]) -> None:
        if self._guard is not None:
            self._guard.halt()
        # Stubs exit on their own once the server is gone, but a killed server never unlinks
        # its /dev/shm regions, and a stub stuck in C code may not notice for a while.
        # A server that is already gone left no tree to walk: its stubs seen at readiness stand
        # in, those whose pid still names a stub of this server (its regions' prefix is in the
        # stub's argv), not another server's stub that was given the same pid since.
        family = family or [procs.identity(pid) for pid in self._stubs
                            if self.region_prefix and procs.stub_of(pid, self.region_prefix)]
        procs.kill_all(family)
        if self.region_prefix:
            removed = procs.remove_regions(self.region_prefix)
            if removed:
                log.info("removed %d shared-memory regions the server left", len(removed))
        # and the denoisers' load board (backends/core/serving/load_board.py), named by the server's pid
        procs.remove_regions(f"{LOAD_BOARD_PREFIX}{self.proc.pid}-")

    def dead_stubs(self) -> dict[int, str]:
        """Stubs seen at readiness that are gone now (killed, crashed): pid -> instance."""
        return {pid: name for pid, name in self._stubs.items() if not procs.pid_alive(pid)}

    def admin_request(self, path: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
        """An HTTP call of a restricted API with our admin key: (status, body)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", data=data,
                                         headers=self.admin_headers,
                                         method="GET" if data is None else "POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def public_models(self) -> list[str]:
        """The entry points clients call: `easel` and `easel_stream`, which run the pipeline by BLS
        (backends/triton/bls_pipeline.py)."""
        return sorted(cfg.parent.name for cfg in Path(self.repo).glob("*/config.pbtxt")
                      if re.search(PUBLIC_CONFIG, cfg.read_text(errors="replace"), re.M))

    def drain(self, timeout: float) -> bool:
        """Stop admitting requests, let every admitted one finish; True when none is left.

        Triton's own shutdown cannot drain a pipeline: it stops every model at once, so the
        later steps of a request in flight (new internal requests) are refused. So, first:
        - the drain flag: from now on `preprocess`, the pipeline's first step, refuses every
          request with UNAVAILABLE / 503 (retry elsewhere), at once;
        - each public model switches to its spare version (export: `easel` and `easel_stream`
          serve version 1 and have an identical version 2), loaded with a config override.
          Triton then unloads the serving version, and keeps it UNLOADING until its last request
          in flight has finished (the models its steps call stay loaded): that is our signal
          that the admitted requests are done. New requests meanwhile reach the spare version,
          whose preprocess refuses them; and the server is not ready (strict readiness counts a
          LOADING or UNLOADING model).
        A repository without a spare version (exported before) is unloaded instead, as before:
        new requests then get NOT_FOUND / 404 during the drain. tritonserver is stopped after
        this returns (from the moment the drain ends to tritonserver's SIGTERM, milliseconds,
        the server reads ready again; the flag still refuses new requests).
        """
        deadline = time.monotonic() + timeout
        self.drain_flag.touch()
        leaving: set[tuple[str, str]] = set()  # (model, version) that must finish unloading
        for name in self.public_models():
            serving = self._switch_to_spare_version(name)
            if serving is None:
                status, body = self.admin_request(f"/v2/repository/models/{name}/unload", {})
                if status != 200:
                    log.warning("drain: unloading %s failed (%d): %s", name, status, body[:200])
                serving = {"*"}
            leaving |= {(name, v) for v in serving}
        while time.monotonic() < deadline and self.proc is not None and self.proc.poll() is None:
            states = self._model_states()
            # No answer (a busy HTTP front end) is not an answer that the drain is done.
            if states and not any(state == "UNLOADING" for (name, version), state in states.items()
                                  if (name, version) in leaving or (name, "*") in leaving):
                return True
            time.sleep(0.2)
        log.warning("drain: requests still in flight after %.0f s", timeout)
        return False

    def _switch_to_spare_version(self, name: str) -> set[str] | None:
        """Load `name`'s spare version in place of the serving one; the versions it replaced
        (now UNLOADING until their requests finish), or None where it has no spare version."""
        serving = {v for (n, v), state in self._model_states().items() if n == name and state == "READY"}
        folders = {p.name for p in (Path(self.repo) / name).iterdir() if p.is_dir() and p.name.isdigit()}
        spare = sorted(folders - serving, key=int)
        if not serving or not spare:
            return None
        status, body = self.admin_request(f"/v2/models/{name}/config")
        if status != 200:
            log.warning("drain: reading %s's config failed (%d): %s", name, status, body[:200])
            return None
        config = json.loads(body)
        config["version_policy"] = {"specific": {"versions": [int(spare[0])]}}
        status, body = self.admin_request(f"/v2/repository/models/{name}/load",
                                          {"parameters": {"config": json.dumps(config)}})
        if status != 200:
            log.warning("drain: loading %s version %s failed (%d): %s", name, spare[0], status, body[:200])
            return None
        return serving

    def _model_states(self) -> dict[tuple[str, str], str]:
        """(model, version) -> state, from the repository index."""
        try:
            status, body = self.admin_request("/v2/repository/index", {}, timeout=5)
        except (urllib.error.URLError, OSError):
            return {}
        if status != 200:
            return {}
        return {(m["name"], str(m.get("version", ""))): m.get("state", "") for m in json.loads(body)}

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


def serve(repo: Path | str, http_port: int = 8000, grpc_port: int = 8001,
          metrics_port: int = 8002, log_verbose: int = 0, foreground: bool = True,
          timeout: float = 300.0, pid_file: Path | str | None = None,
          out: TextIO | None = None, drain_timeout: float = 30.0,
          admin_key: str | None = None, openai_port: int | None = None,
          max_restarts: int | None = None, grpc_front: bool = True,
          cuda_pool_mib: int = DEFAULT_CUDA_POOL_MIB) -> int:
    """Run tritonserver on `repo`; returns a process exit code.

    foreground: supervise it (clients/supervise.py: restarts on a crash, with a growing backoff,
    until `max_restarts` within ten minutes if given; drains on SIGINT/SIGTERM; the public gRPC
    port behind clients/grpc_front.py unless `grpc_front` is off; with `openai_port`, `easel
    openai` beside it) and return its exit code.
    Otherwise return 0 once ready, leaving the server running unsupervised.
    """
    from clients.supervise import ServeOptions, Supervisor, busy_ports

    if openai_port and not foreground:
        raise ValueError("--openai-port needs the foreground (the API is supervised with the server)")
    options = ServeOptions(Path(repo), http_port, grpc_port, metrics_port, log_verbose,
                           ready_timeout=timeout, drain_timeout=drain_timeout, admin_key=admin_key,
                           openai_port=openai_port, max_restarts=max_restarts, grpc_front=grpc_front,
                           cuda_pool_mib=cuda_pool_mib)
    if foreground:
        return Supervisor(options).run()
    out = out or sys.stdout
    busy = busy_ports(options)
    if busy:
        print(f"easel serve: port {', '.join(map(str, busy))} already in use (another server?); "
              "not starting", file=sys.stderr)
        return 1
    server = TritonServer(repo, http_port, grpc_port, metrics_port, log_verbose,
                          ready_timeout=timeout, detach=True, admin_key=admin_key, cuda_pool_mib=cuda_pool_mib)
    server.start()
    try:
        server.wait_ready()
    except ServerStartError as err:
        server.stop(cleanup=False)
        print(f"easel serve: {err}", file=sys.stderr)
        return 1
    if pid_file:
        Path(pid_file).write_text(f"{server.pid}\n")
    print(f"EASEL_SERVER_PID={server.pid}", file=out)
    print(f"EASEL_SERVER_LOG={server.log_path}", file=out)
    print(f"EASEL_SERVER_HTTP={server.url_http}", file=out)
    print(f"EASEL_SERVER_GRPC={server.url_grpc}", file=out)
    out.flush()
    return 0
