"""`easel serve` in the foreground: start tritonserver, keep it serving, drain it on a stop.

The supervisor owns one tritonserver at a time (a TritonServer) and runs in the main thread:
the server is started with PR_SET_PDEATHSIG, which fires when the *forking thread* exits, so
starts and restarts must happen here and not in a helper thread.

What it watches, every `poll_s`:
- the tritonserver process: an exit we did not ask for is a crash;
- the Python backend stubs it saw at readiness: Triton 2.51 does not recover a dead stub (every
  later request fails with "Stub process ... is not healthy", readiness stays true, the request
  in flight hangs until the client's deadline).

Either way it restarts tritonserver rather than reloading the one model. A dead stub takes its
state with it (the running batch, merged LoRAs, resident ControlNets), and the requests waiting
on it (the public models' BLS calls) hang: Triton has no call that fails them, short of
stopping the server. SIGKILL fails them at once (clients see UNAVAILABLE), and a fresh start
has a known state; the price is a full start (the compile cache keeps that short on GPUs).

The public gRPC port is served by clients/grpc_front.py, which forwards every call to
tritonserver's own gRPC port on loopback without the headers that crash Triton 2.51 (it lives
here, so it outlasts tritonserver's restarts: meanwhile its calls get UNAVAILABLE).

With `openai_port`, `easel openai` (clients/openai_api.py) runs beside the server as a child
process, started once the server is ready and stopped after the drain: its requests in flight
are admitted requests of the server, so they get their answers before it goes. A restart of
tritonserver leaves it running (its gRPC channel reconnects; meanwhile it answers 503).
"""
from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

from clients import procs
from clients.grpc_front import GrpcFront
from clients.serve import DEFAULT_CUDA_POOL_MIB, ServerStartError, TritonServer, free_port

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 600.0
# The wait before each restart (of the server or the API), by how many came within RESTART_WINDOW_S
# before it; the last repeats. A fault a client can cause again and again (a request that crashes
# tritonserver) then costs the service a growing share of its time, never all of it.
RESTART_BACKOFF_S = (0.0, 0.0, 5.0, 15.0, 30.0, 60.0)


@dataclass
class RestartPolicy:
    """When the next restart may happen: after a backoff that grows with the restarts of the last
    `window_s`; never again once there were `max_restarts` in the window. The default, None, is
    no cap: a supervisor that gives up leaves the service down until someone notices."""

    max_restarts: int | None = None
    window_s: float = RESTART_WINDOW_S
    backoff_s: tuple[float, ...] = RESTART_BACKOFF_S
    times: deque = field(default_factory=deque)

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before the restart about to happen (counted from now), or None to give up."""
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if self.max_restarts is not None and len(self.times) >= self.max_restarts:
            return None
        delay = self.backoff_s[min(len(self.times), len(self.backoff_s) - 1)]
        self.times.append(now + delay)
        return delay

    @property
    def recent(self) -> int:
        return len(self.times)


@dataclass(frozen=True)
class ServeOptions:
    repo: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    log_verbose: int = 0
    ready_timeout: float = 300.0
    drain_timeout: float = 30.0  # how long a stop waits for admitted requests
    admin_key: str | None = None  # None: a random key nobody is told (restricted APIs closed)
    poll_s: float = 0.5
    # tritonserver's own wait after our drain: direct calls of internal models, then every
    # model's finalize (stubs exit cleanly and unlink their regions; 5 s was too short on a
    # busy 2-core host).
    exit_timeout: int = 15
    openai_port: int | None = None  # the OpenAI images API beside the server; None: not started
    max_restarts: int | None = None  # within RESTART_WINDOW_S, then stop; None: keep restarting
    # The public gRPC port served by clients/grpc_front.py, tritonserver's on loopback behind it.
    grpc_front: bool = True
    cuda_pool_mib: int = DEFAULT_CUDA_POOL_MIB  # TritonServer.cuda_pool_mib

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.http_port, self.grpc_port, self.metrics_port


def busy_ports(options: ServeOptions) -> list[int]:
    return [p for p in (*options.ports, options.openai_port) if p and procs.port_in_use(p)]


class OpenAIApi:
    """`easel openai` as a child process, forwarding to the server's gRPC port.

    Its own session: a terminal's Ctrl-C reaches only `easel serve`, which stops the API after
    the drain (a Ctrl-C straight to the API would drop the answers of admitted requests). It
    dies with the thread that started it (PR_SET_PDEATHSIG), as tritonserver does. Its log
    goes to our stderr, beside the server's.
    """

    def __init__(self, port: int, triton_grpc: str):
        self.port, self.triton_grpc = port, triton_grpc
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://localhost:{self.port}/v1"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "clients.cli", "openai", "--triton", self.triton_grpc,
                "--port", str(self.port)]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=procs.child_preexec(die_with_parent=True))

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def wait_ready(self, timeout: float, stop: threading.Event) -> str | None:
        """None once GET /v1/models answers from our process; else why not."""
        assert self.proc is not None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        while not stop.is_set():
            code = self.proc.poll()
            if code is not None:
                return f"easel openai exited with code {code}"
            try:
                with opener.open(f"http://127.0.0.1:{self.port}/v1/models", timeout=2) as r:
                    # Another process on the port must not pass for ours.
                    if r.status == 200 and procs.listens_on(self.proc.pid, self.port):
                        return None
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                return f"easel openai not answering on port {self.port} after {timeout:.0f} s"
            time.sleep(0.2)
        return "stopped while starting"

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM (uvicorn finishes the responses it is writing), SIGKILL after `grace` s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("easel openai %d ignored SIGTERM for %.0f s; killing", self.proc.pid, grace)
            self.proc.kill()
            self.proc.wait()


class Supervisor:
    def __init__(self, options: ServeOptions, out: TextIO | None = None):
        self.options = options
        self.out = out or sys.stderr
        self.server: TritonServer | None = None
        self._stop = threading.Event()
        self._signum = signal.SIGTERM
        self._serving = False
        self._restarts = RestartPolicy(options.max_restarts)
        self.api: OpenAIApi | None = None
        self.front: GrpcFront | None = None
        self._triton_grpc_port = 0  # tritonserver's own gRPC port (the public one without the front)

    @property
    def triton_grpc(self) -> str:
        """Where tritonserver itself takes gRPC (the front and the OpenAI API call it there)."""
        return f"127.0.0.1:{self._triton_grpc_port if self.front else self.options.grpc_port}"

    def _new_server(self) -> TritonServer:
        o = self.options
        # Behind the front, tritonserver's gRPC port takes loopback calls only.
        grpc = (self._triton_grpc_port, ("--grpc-address=127.0.0.1",)) if self.front else (o.grpc_port, ())
        return TritonServer(o.repo, o.http_port, grpc[0], o.metrics_port, o.log_verbose,
                            ready_timeout=o.ready_timeout, echo=True, admin_key=o.admin_key,
                            exit_timeout=o.exit_timeout, extra_args=grpc[1], cuda_pool_mib=o.cuda_pool_mib)

    def _on_signal(self, signum: int, _frame) -> None:
        server = self.server
        if self._stop.is_set() or not self._serving:
            # A second signal, or one during a start: no drain, tritonserver's own stop.
            if server is not None and server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signum)
        self._signum = signum
        self._stop.set()

    def run(self) -> int:
        busy = busy_ports(self.options)
        if busy:
            print(f"easel serve: port {', '.join(map(str, busy))} already in use (another "
                  "server?); not starting", file=self.out, flush=True)
            return 1
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            if self.options.grpc_front:
                self._triton_grpc_port = free_port()
                self.front = GrpcFront(f"127.0.0.1:{self._triton_grpc_port}", self.options.grpc_port).start()
                self.options = replace(self.options, grpc_port=self.front.port)
            if not self._start():
                return 1
            o = self.options
            if o.openai_port and not self._start_api():
                if self._stop.is_set():  # a signal during the API's start: stop as usual
                    return self._shutdown()
                self.server.stop(grace=o.exit_timeout + 30.0)
                return 1
            api = f", openai {self.api.url}" if self.api else ""
            print(f"easel serve: ready (http localhost:{o.http_port}, grpc localhost:{o.grpc_port}, "
                  f"metrics localhost:{o.metrics_port}{api}); Ctrl-C to stop", file=self.out, flush=True)
            return self._watch()
        finally:
            if self.api is not None:
                self.api.stop()
            if self.front is not None:  # after the drain: its calls in flight were admitted requests
                self.front.stop(grace_s=0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_api(self) -> bool:
        o = self.options
        if self.api is None:
            self.api = OpenAIApi(o.openai_port, self.triton_grpc)
        self.api.start()
        failed = self.api.wait_ready(o.ready_timeout, self._stop)
        if failed is None:
            return True
        self.api.stop()
        if not self._stop.is_set():
            print(f"easel serve: the OpenAI API did not start: {failed}", file=self.out, flush=True)
        return False

    def _start(self) -> bool:
        self.server = self._new_server()
        try:
            self.server.start()
            # Port 0 means "any free port" once; a restart must come back on the same ones.
            self.options = replace(self.options, http_port=self.server.http_port,
                                   metrics_port=self.server.metrics_port,
                                   admin_key=self.server.admin_key)
            if self.front:
                self._triton_grpc_port = self.server.grpc_port
            else:
                self.options = replace(self.options, grpc_port=self.server.grpc_port)
            self.server.wait_ready()
        except ServerStartError as err:
            self.server.stop(cleanup=False)
            if not self._stop.is_set():
                print(f"easel serve: {err}", file=self.out, flush=True)
            return False
        self._serving = True
        return True

    def _watch(self) -> int:
        while not self._stop.wait(self.options.poll_s):
            reason = self._fault()
            if reason is None:
                if self.api is not None and self.api.exited() is not None and not self._restart_api():
                    # Serving without the API it was asked for is not serving: drain and stop.
                    return self._shutdown() or 1
                continue
            if not self._restart(reason):
                return self._shutdown() if self._stop.is_set() else 1
            if self._stop.is_set():
                break
        return self._shutdown()

    def _fault(self) -> str | None:
        server = self.server
        assert server is not None and server.proc is not None
        code = server.proc.poll()
        if code is not None:
            return f"tritonserver exited with code {code}"
        dead = server.dead_stubs()
        if dead:
            return "stub process died: " + ", ".join(f"{name} (pid {pid})" for pid, name in dead.items())
        return None

    def _may_restart(self, reason: str) -> bool:
        """Waits out the next restart's backoff (of the server or the API; nothing serves
        meanwhile); False if the operator's cap is reached or a stop came."""
        delay = self._restarts.next_delay(time.monotonic())
        if delay is None:
            log.error("%s; %d restarts in %.0f s already (--max-restarts), giving up", reason,
                      self._restarts.recent, RESTART_WINDOW_S)
            return False
        if delay:
            log.warning("%s; %d restarts in the last %.0f s: waiting %.0f s before the next", reason,
                        self._restarts.recent - 1, RESTART_WINDOW_S, delay)
        return not self._stop.wait(delay)

    def _restart_api(self) -> bool:
        """The API process died: start it again (the server keeps serving meanwhile)."""
        assert self.api is not None
        reason = f"easel openai exited with code {self.api.exited()}"
        if not self._may_restart(reason):
            return self._stop.is_set()
        log.error("%s; starting it again", reason)
        return self._start_api() or self._stop.is_set()

    def _restart(self, reason: str) -> bool:
        """tritonserver killed and started again, after each failed start too, until it serves;
        False if the operator's cap stopped it (or a stop came while it was down)."""
        now = time.monotonic()
        log.error("%s; restarting tritonserver (requests in flight fail with UNAVAILABLE)", reason)
        self._serving = False
        self.server.kill()
        while self._may_restart(reason):
            if self._start():
                log.warning("recovered: tritonserver ready again %.1f s after the fault was seen",
                            time.monotonic() - now)
                return True
            if self._stop.is_set():
                return False
            reason = "tritonserver did not start again"
        return False

    def _shutdown(self) -> int:
        server = self.server
        assert server is not None
        start = time.monotonic()
        if server.proc is not None and server.proc.poll() is None:
            log.info("stopping: draining admitted requests (up to %.0f s)", self.options.drain_timeout)
            drained = server.drain(self.options.drain_timeout)
            log.info("drain %s after %.1f s; stopping tritonserver",
                     "complete" if drained else "timed out", time.monotonic() - start)
        if self.api is not None:
            self.api.stop()  # after the drain: the admitted requests' answers have been sent
        code = server.stop(signum=self._signum, grace=self.options.exit_timeout + 30.0)
        log.info("stopped %.1f s after the signal", time.monotonic() - start)
        return 128 - code if code is not None and code < 0 else (code or 0)
