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
on it (the ensemble's and the BLS callers') hang: Triton has no call that fails them, short of
stopping the server. SIGKILL fails them at once (clients see UNAVAILABLE), and a fresh start
has a known state; the price is a full start (the compile cache keeps that short on GPUs).
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from clients import procs
from clients.serve import ServerStartError, TritonServer

log = logging.getLogger(__name__)

MAX_RESTARTS = 5  # within RESTART_WINDOW_S; past that the fault is not transient: give up
RESTART_WINDOW_S = 600.0


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

    @property
    def ports(self) -> tuple[int, int, int]:
        return self.http_port, self.grpc_port, self.metrics_port


def busy_ports(options: ServeOptions) -> list[int]:
    return [p for p in options.ports if p and procs.port_in_use(p)]


class Supervisor:
    def __init__(self, options: ServeOptions, out: TextIO | None = None):
        self.options = options
        self.out = out or sys.stderr
        self.server: TritonServer | None = None
        self._stop = threading.Event()
        self._signum = signal.SIGTERM
        self._serving = False
        self._restarts: deque[float] = deque()

    def _new_server(self) -> TritonServer:
        o = self.options
        return TritonServer(o.repo, o.http_port, o.grpc_port, o.metrics_port, o.log_verbose,
                            ready_timeout=o.ready_timeout, echo=True, admin_key=o.admin_key,
                            exit_timeout=o.exit_timeout)

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
            if not self._start():
                return 1
            o = self.options
            print(f"easel serve: ready (http localhost:{o.http_port}, grpc localhost:{o.grpc_port}, "
                  f"metrics localhost:{o.metrics_port}); Ctrl-C to stop", file=self.out, flush=True)
            return self._watch()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> bool:
        self.server = self._new_server()
        try:
            self.server.start()
            # Port 0 means "any free port" once; a restart must come back on the same ones.
            self.options = replace(self.options, http_port=self.server.http_port,
                                   grpc_port=self.server.grpc_port,
                                   metrics_port=self.server.metrics_port,
                                   admin_key=self.server.admin_key)
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
                continue
            if not self._restart(reason):
                return 1
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

    def _restart(self, reason: str) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > RESTART_WINDOW_S:
            self._restarts.popleft()
        if len(self._restarts) >= MAX_RESTARTS:
            log.error("%s; %d restarts in %.0f s already, giving up", reason, len(self._restarts),
                      RESTART_WINDOW_S)
            self.server.kill()
            return False
        self._restarts.append(now)
        log.error("%s; restarting tritonserver (requests in flight fail with UNAVAILABLE)", reason)
        self._serving = False
        self.server.kill()
        if not self._start():
            return False
        log.warning("recovered: tritonserver ready again %.1f s after the fault was seen",
                    time.monotonic() - now)
        return True

    def _shutdown(self) -> int:
        server = self.server
        assert server is not None
        start = time.monotonic()
        if server.proc is not None and server.proc.poll() is None:
            log.info("stopping: draining admitted requests (up to %.0f s)", self.options.drain_timeout)
            drained = server.drain(self.options.drain_timeout)
            log.info("drain %s after %.1f s; stopping tritonserver",
                     "complete" if drained else "timed out", time.monotonic() - start)
        code = server.stop(signum=self._signum, grace=self.options.exit_timeout + 30.0)
        log.info("stopped %.1f s after the signal", time.monotonic() - start)
        return 128 - code if code is not None and code < 0 else (code or 0)
