"""`easel serve` as the server's supervisor: a dead stub is recovered,
SIGTERM drains, tritonserver never outlives it, and it never reports ready for a server it did
not start. Each test drives a real `easel serve` process of its own (not the session servers)."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from backends.core.serving.load_board import PREFIX as LOAD_BOARD_PREFIX
from clients import procs
from clients.client import EaselClient, EaselError
from clients.serve import free_port, scrape_metrics
from export.repository import export_repository
from tests.server.conftest import OPTIONS

START_S = 300.0


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("lifecycle") / "repo"
    export_repository(tiny_model, path, dataclasses.replace(OPTIONS, adapters=str(tiny_model / "adapters")))
    return path


class EaselServe:
    """One `easel serve` process in the foreground, its stderr collected as it comes."""

    def __init__(self, repo: Path, ports: tuple[int, int, int] | None = None, drain_timeout: float = 240.0,
                 extra: tuple[str, ...] = ()):
        self.ports = ports or (free_port(), free_port(), free_port())
        http, grpc, metrics = self.ports
        argv = [sys.executable, "-m", "clients.cli", "serve", "--repo", str(repo), "--http-port", str(http),
                "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--drain-timeout", str(drain_timeout),
                "--timeout", str(START_S), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = START_S, after: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, "".join(self.lines[after:]))
            if m:
                return m
            assert self.proc.poll() is None or self._reader.is_alive(), self.text[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"{pattern!r} not seen in {timeout:.0f} s:\n{self.text[-3000:]}")

    @property
    def url_grpc(self) -> str:
        return f"localhost:{self.ports[1]}"

    def ready(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{self.ports[0]}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def steps_run(self) -> float:
        """Batch steps the denoisers have run (the step-rows histogram's count, flushed every 0.5 s)."""
        values = scrape_metrics(self.ports[2], ["easel_denoiser_step_rows_count"])
        return sum(values["easel_denoiser_step_rows_count"].values())

    def wait_for_steps(self, steps: int, before: float, timeout: float = 60.0) -> None:
        """Until `steps` more batch steps than `before` have run: requests are in flight, not guessed by a sleep."""
        _wait_until(lambda: self.steps_run() >= before + steps, timeout, serve=self)

    def region_prefix(self) -> str:
        return re.search(r"shm-region-prefix-name=(\S+)", " ".join(procs.cmdline(self.triton_pid())))[1]

    def triton_pid(self) -> int:
        pids = [p for p in procs.children(self.proc.pid)
                if procs.cmdline(p) and procs.cmdline(p)[0].endswith("/tritonserver")]
        assert len(pids) == 1, pids
        return pids[0]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)  # the second skips the drain
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _wait_until(predicate, timeout: float, step: float = 0.1, serve: EaselServe | None = None) -> float:
    """Seconds until predicate() held; fails after `timeout` (with the end of serve's stderr)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            tail = "\n".join(line for line in (serve.text if serve else "").splitlines()[-400:]
                              if not line.startswith(("I1", "W1", "| ", "+-")))
            raise AssertionError(f"not within {timeout} s\n{tail[-4000:]}")
        time.sleep(step)
    return time.monotonic() - start


class InFlight(threading.Thread):
    """One gRPC request in a thread: its outcome and how long it took."""

    def __init__(self, url: str, seed: int, size: int = 256, steps: int = 200):
        super().__init__(daemon=True)
        self.url, self.seed, self.size, self.steps = url, seed, size, steps
        self.error: EaselError | None = None
        self.ok = False
        self.ended: float | None = None
        self.start()

    def run(self) -> None:
        try:
            with EaselClient(self.url, protocol="grpc") as c:
                c.generate(f"in flight {self.seed}", width=self.size, height=self.size, steps=self.steps,
                           seed=self.seed, timeout_s=300)
            self.ok = True
        except EaselError as e:
            self.error = e
        self.ended = time.monotonic()


@pytest.fixture(scope="module")
def serving(repo):
    s = EaselServe(repo)
    try:
        s.wait_for(r"easel serve: ready")
        yield s
    finally:
        s.close()


def test_second_serve_on_busy_ports_fails_at_once(serving, repo):
    start = time.monotonic()
    second = EaselServe(repo, ports=serving.ports)
    code = second.proc.wait(30)
    second._reader.join(5)
    assert code == 1, second.text
    assert time.monotonic() - start < 20
    assert "already in use" in second.text and "serve: ready" not in second.text, second.text
    assert serving.ready()  # the first one is untouched


def test_dead_stub_fails_in_flight_then_recovers(serving):
    triton = serving.triton_pid()
    prefix = serving.region_prefix()
    denoiser = [pid for pid, name in procs.stub_instances(triton).items() if name.startswith("denoiser")]
    assert denoiser, procs.stub_instances(triton)
    before = serving.steps_run()
    request = InFlight(serving.url_grpc, seed=1)
    serving.wait_for_steps(2, before)  # running, not guessed by a sleep
    assert request.is_alive()
    mark = len(serving.lines)
    os.kill(denoiser[0], signal.SIGKILL)
    killed = time.monotonic()

    request.join(30)
    assert not request.ok and request.error is not None, "the request in flight did not fail"
    assert request.error.status in ("StatusCode.UNAVAILABLE", "UNAVAILABLE"), request.error.status
    failed_after = request.ended - killed
    assert failed_after < 5, failed_after
    _wait_until(lambda: not serving.ready(), 5, serve=serving)

    _wait_until(serving.ready, START_S, step=0.5, serve=serving)
    recovered_after = time.monotonic() - killed
    logged = serving.wait_for(r"recovered: tritonserver ready again ([\d.]+) s", 30, after=mark)
    assert serving.triton_pid() != triton
    assert not list(procs.SHM_DIR.glob(f"{prefix}*"))  # the killed server's regions are gone
    assert not list(procs.SHM_DIR.glob(f"{LOAD_BOARD_PREFIX}{triton}-*"))  # and its denoisers' load board
    assert list(procs.SHM_DIR.glob(f"{LOAD_BOARD_PREFIX}{serving.triton_pid()}-*"))  # the new one's is there
    with EaselClient(serving.url_grpc, protocol="grpc") as c:
        assert c.generate("after the crash", width=64, height=64, steps=2, seed=2).image
    print(f"\nin-flight request failed {failed_after:.1f} s after the kill; ready again after "
          f"{recovered_after:.1f} s (supervisor: {logged[1]} s)")


def test_sigterm_drains_admitted_requests(serving):
    before = serving.steps_run()
    requests = [InFlight(serving.url_grpc, seed=10 + i, size=192, steps=50) for i in range(4)]
    serving.wait_for_steps(2, before)
    assert all(r.is_alive() for r in requests), "requests finished before the signal: make them longer"
    triton = serving.triton_pid()
    family = [triton, *procs.descendants(triton)]
    prefix = serving.region_prefix()
    signalled = time.monotonic()
    serving.proc.send_signal(signal.SIGTERM)

    not_ready_after = _wait_until(lambda: not serving.ready(), 1.0, step=0.05)
    # New requests are refused at once with UNAVAILABLE / 503 (retry elsewhere), not NOT_FOUND / 404.
    refusals = []
    for protocol, url in (("grpc", serving.url_grpc), ("http", f"localhost:{serving.ports[0]}")):
        with EaselClient(url, protocol=protocol) as c:
            start = time.monotonic()
            with pytest.raises(EaselError) as refused:
                c.generate("too late", width=64, height=64, steps=2, seed=3)
        refusals.append(time.monotonic() - start)
        assert refusals[-1] < 2.0, (protocol, refusals)
        assert refused.value.status in ("StatusCode.UNAVAILABLE", "503"), (protocol, refused.value.status, refused.value)
        assert "draining" in str(refused.value), refused.value
    assert not serving.ready()  # still draining

    for r in requests:
        r.join(240)  # a shared 2-core host: 4 of these took from 0.4 to 45 s after the signal
    assert [r.ok for r in requests] == [True] * 4, [str(r.error) for r in requests]
    assert serving.proc.wait(60) == 0, serving.text[-3000:]
    stopped_after = time.monotonic() - signalled
    last = max(r.ended for r in requests) - signalled
    drained = serving.wait_for(r"drain (complete|timed out) after ([\d.]+) s", 5)
    assert drained[1] == "complete", drained[0]
    assert all(not procs.pid_alive(p) for p in family)
    assert not list(procs.SHM_DIR.glob(f"{prefix}*"))
    print(f"\nnot ready {not_ready_after:.2f} s after SIGTERM; new requests refused in "
          f"{', '.join(f'{t:.2f}' for t in refusals)} s (gRPC, HTTP); last admitted request finished "
          f"{last:.1f} s after SIGTERM; drain complete after {drained[2]} s; easel serve exited after "
          f"{stopped_after:.1f} s")


def test_sigkill_of_serve_takes_the_server_and_stubs_along(repo):
    s = EaselServe(repo)
    try:
        s.wait_for(r"easel serve: ready")
        triton = s.triton_pid()
        family = [triton, *procs.descendants(triton)]
        assert len(family) > 5
        prefix = s.region_prefix()
        assert list(procs.SHM_DIR.glob(f"{prefix}*"))
        s.proc.kill()
        s.proc.wait()
        gone_after = _wait_until(lambda: not any(procs.pid_alive(p) for p in family), 10)
        assert not any(procs.port_in_use(p) for p in s.ports)
        # A killed server never unlinks its regions: the next start sweeps them (nothing maps them now).
        procs.sweep_stale_regions()
        assert not list(procs.SHM_DIR.glob(f"{prefix}*"))
        print(f"\ntritonserver and {len(family) - 1} descendants gone {gone_after:.1f} s after SIGKILL")
    finally:
        s.close()
