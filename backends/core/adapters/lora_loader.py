"""LoRA files loaded with separate processes, read straight onto the GPU or handed back through
shared memory.

Why processes: reading a LoRA runs diffusers' key conversion in Python; on threads of the
denoiser's process it competes for the GIL with the step loop. The conversion of a usual file
(diffusers/PEFT or kohya layout) only renames its tensors, so a worker first runs it on the file's
header alone (`plan_lora`: shapes, no data) and sends back which file key holds each layer; the
parent then reads the file itself, in one pass through pinned memory onto the GPU, without
a copy in the worker and another through shared memory (on the H200 host a 340 MiB LoRA took
0.35-0.7 s that way, against a cold read of the file at 2 GB/s). A file whose conversion does
more (casts, concatenations) is read and converted by the worker, which writes the tensors as one
file under /dev/shm (RAM, no pickle; backends/core/adapters/shm_tensors.py) and sends back only
small metadata (the segment's path, layer names and scales, bytes); the parent reads the file
and unlinks it at once. Either way tensors never cross the pipe.

Each worker process has its own feeder thread in the parent that hands it one file at a time and
waits for either its reply or its death. A worker that dies (killed, out of memory, a crash in
native code) fails only the file it was loading; its feeder removes that file's segment and
starts a fresh worker in its slot, so the denoiser never goes down with it.

No Triton imports: the adapter (backends/easel_denoiser/model.py) drives this, tests drive it on CPU.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import threading
import time
import uuid
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from backends.core.adapters.lora import LoraLayer, LoraPlan, LoraWeights, load_lora, plan_lora, read_planned
from backends.core.adapters.store import StoreFile
from backends.core.request.params import InvalidInput, UnknownAdapter, no_paths, shorten
from backends.core.adapters.shm_tensors import Staging, read_tensors, write_tensors
from backends.core.serving.shm_files import SHM_DIR, remove_orphans, unlink

log = logging.getLogger(__name__)

# Loading is background work beside the step loop, which is CPU-bound (it launches every kernel
# from Python): the loader processes and the feeder threads run at this niceness, so the scheduler
# favours the loop. (On the H200 host two loads slowed the loop's steps by 4-13 ms each while they
# ran, niced by 6-8 ms: within that host's noise, no gain shown, none lost; bench/micro/lora_interference.py.)
LOADER_NICENESS = 10
SEGMENT_PREFIX = "easel-lora-"  # + <parent pid>-<pool id>-<worker pid>-<uuid>: leftovers are found by owner
LoadStats = tuple[int, float, int]  # files, seconds spent loading them (summed), bytes of weights


class LoraLoaderDied(RuntimeError):
    """The worker loading a file died; the request may simply be sent again."""


def python_executable() -> str:
    """The interpreter for spawned workers: this very Python installation's. Not sys.executable
    first: in Triton's Python-backend stub it names the stub binary or whichever `python3` is on
    PATH, while the stub may run the system libpython (where this Python has no shared one:
    clients/triton_install.link_own_libpython); another build of the same version can lack
    modules the system one has built in (Debian builds `_datetime` into libpython; pyenv's needs
    its own lib-dynload). The workers get this process's sys.path from spawn, so they import
    exactly what this process imports."""
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for prefix in (sys.exec_prefix, sys.base_exec_prefix):  # a venv's own first, then its base
        candidate = os.path.join(prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    if sys.executable and os.access(sys.executable, os.X_OK):
        return sys.executable
    raise RuntimeError(f"no {name} interpreter found under {sys.exec_prefix} to run LoRA loader processes")


@dataclass
class _Task:
    name: str
    path: "str | StoreFile"  # a StoreFile from the store (opened without following symlinks)
    future: Future = field(default_factory=Future)


class _Worker:
    """One loader process and the parent's end of its pipe."""

    def __init__(self, ctx, load):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, load), name="easel-lora-loader", daemon=True)
        self.process.start()
        child.close()  # only the worker holds its end: its death shows up as EOF here
        self.started = False  # it said "ready": its imports worked

    def read_ready(self) -> None:
        """Take the worker's "ready" if it has come (the feeder reads it when idle or before a reply)."""
        try:
            if not self.started and self.conn.poll():
                self.started = self.conn.recv() == ("ready",)
        except (EOFError, OSError):
            pass  # died before it was ready

    def stop(self, timeout: float = 10.0) -> None:
        try:
            if self.process.is_alive():
                self.conn.send(None)
        except OSError:
            pass  # died meanwhile
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class LoraLoaderPool:
    """`workers` loader processes. `load(name, path) -> LoraWeights` runs in them: a module-level
    function (it crosses to the spawned process by name); tests pass one that sleeps or dies."""

    def __init__(self, workers: int = 2, load: Callable[[str, str], LoraWeights] = load_lora,
                 shm_dir: str = SHM_DIR, device: str = "cpu"):
        if workers < 1:
            raise ValueError(f"workers: {workers} is not a positive number of loader processes")
        self.shm_dir = shm_dir
        self.device = torch.device(device)
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        remove_orphans(shm_dir, SEGMENT_PREFIX)  # of a denoiser process killed mid-load
        # spawn, never fork: forking the denoiser would copy its threads' locks mid-state (torch,
        # Triton's stub); a spawned worker starts clean and imports only what loading needs.
        self._ctx = multiprocessing.get_context("spawn")
        self._ctx.set_executable(python_executable())
        self._load = load
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._closed = False
        self._lock = threading.Lock()
        self._workers: list[_Worker | None] = [None] * workers
        # Per feeder, made once (backends/core/adapters/shm_tensors.py says why): a stream to copy on, pinned chunks.
        self._streams = [torch.cuda.Stream(self.device) for _ in range(workers)] if self.device.type == "cuda" else []
        self._staging = [Staging() for _ in range(workers)] if self.device.type == "cuda" else []
        for slot in range(workers):  # started now, so their imports happen before the first request
            self._workers[slot] = _Worker(self._ctx, load)
        self._feeders = [threading.Thread(target=self._feed, args=(slot,), name=f"easel-lora-feeder-{slot}",
                                          daemon=True) for slot in range(workers)]
        for feeder in self._feeders:
            feeder.start()

    def submit(self, loras: list[tuple[str, str | Path, float]],
               on_loaded: Callable[[LoadStats], None] | None = None) -> Future:
        """The LoRAs of one request, (name, path, scale) each, loaded in parallel (one task per
        file). The future gives ((LoraWeights, scale), ...) in the given order, or raises the first
        error. `on_loaded(stats)` runs before the future resolves, so whoever sees the result can
        also see the stats."""
        combined: Future = Future()
        tasks = [_Task(name, path if isinstance(path, StoreFile) else str(path)) for name, path, _ in loras]
        scales = [scale for _, _, scale in loras]
        left = [len(tasks)]
        lock = threading.Lock()

        def one_done(task_future: Future) -> None:
            error = task_future.exception()
            with lock:
                left[0] -= 1
                if combined.done() or (error is None and left[0]):
                    return
            try:
                if error is not None:
                    combined.set_exception(error)
                    return
                results = [t.future.result() for t in tasks]
                weights = tuple((lora, scale) for (lora, _), scale in zip(results, scales))
                if on_loaded is not None:
                    try:
                        on_loaded((len(results), sum(s for _, s in results), sum(w.nbytes for w, _ in weights)))
                    except Exception:  # stats are worth a log line, never the request
                        log.exception("recording LoRA load stats failed")
                combined.set_result(weights)
            except InvalidStateError:
                pass  # the caller cancelled it

        with self._lock:
            if self._closed:
                raise RuntimeError("loras: the LoRA loader is shut down")
            for task in tasks:
                task.future.add_done_callback(one_done)
                self._tasks.put(task)
        if not tasks:
            combined.set_result(())
        return combined

    def wait_started(self, timeout: float) -> bool:
        """Wait until every worker has imported what loading needs (the feeders read their
        "ready"), so that the first request does not pay for it. False if one died or time ran out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            workers = [w for w in list(self._workers) if w is not None]
            if all(w.started for w in workers):
                return True
            if any(not w.started and not w.process.is_alive() for w in workers):
                return False
            time.sleep(0.1)
        return False

    def pids(self) -> list[int]:
        """The loader processes' ids (tests, diagnostics)."""
        return [w.process.pid for w in list(self._workers) if w is not None]

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail what has not started, let each worker finish its file, stop them, and remove any
        segment of this pool left in shared memory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task.future.set_exception(RuntimeError("loras: the LoRA loader is shutting down"))
        for _ in self._feeders:
            self._tasks.put(None)
        for slot, feeder in enumerate(self._feeders):
            feeder.join(timeout)  # its worker finishes the file it has, then stops
            worker = self._workers[slot]
            if feeder.is_alive() and worker is not None:  # hung on a file: kill it
                worker.process.kill()
                feeder.join(timeout)
        self._remove_segments(f"{self.prefix}*")

    # -- the parent's side of one worker -------------------------------------------------------

    def _feed(self, slot: int) -> None:
        if sys.platform == "linux":  # there a thread has its own niceness (its native id names it)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICENESS)
        while True:
            try:
                task = self._tasks.get(timeout=1.0)
            except queue.Empty:  # idle: replace a worker that died meanwhile before a request meets it
                worker = self._workers[slot]
                if worker is not None:
                    worker.read_ready()
                # (one that died before it was ready is replaced by the next request only: it
                # would most likely fail the same way, and a crash loop helps nobody)
                if worker is not None and worker.started and not worker.process.is_alive() and not self._closed:
                    log.warning("LoRA loader process %s died while idle (exit code %s); starting a new one",
                                worker.process.pid, worker.process.exitcode)
                    self._replace(slot)
                continue
            if task is None:
                break
            try:
                task.future.set_result(self._run(slot, task))
            except BaseException as exc:  # every task's future resolves, whatever happened
                task.future.set_exception(exc)
        worker = self._workers[slot]
        if worker is not None:
            self._workers[slot] = None
            worker.stop()

    def _run(self, slot: int, task: _Task) -> tuple[LoraWeights, float]:
        worker = self._workers[slot]
        if worker is None or not worker.process.is_alive():
            worker = self._replace(slot)
        # Named after the worker, so that whatever a dead worker left can be found and removed.
        segment = os.path.join(self.shm_dir, f"{self.prefix}{worker.process.pid}-{uuid.uuid4().hex}")
        start = time.perf_counter()
        try:
            lora = self._exchange(slot, worker, task, segment)
        finally:
            unlink(segment)  # read already, or never written
        return lora, time.perf_counter() - start

    def _exchange(self, slot: int, worker: _Worker, task: _Task, segment: str) -> LoraWeights:
        try:
            worker.conn.send((task.name, task.path, segment))
            while True:
                ready = multiprocessing.connection.wait([worker.conn, worker.process.sentinel])
                if worker.conn not in ready:  # it exited without a word
                    raise EOFError
                reply = worker.conn.recv()  # "ready", the reply, or EOF from a worker that died
                if reply != ("ready",):
                    break
                worker.started = True
        except (EOFError, OSError):
            code = _exit_code(worker)
            self._remove_segments(f"{self.prefix}{worker.process.pid}-*")
            if not worker.started:  # its imports failed: the server log has its traceback
                log.error("LoRA loader process %s could not start (exit code %s)", worker.process.pid, code)
                raise LoraLoaderDied(f"loras: the LoRA loader process could not start (exit code {code}); "
                                     "the server log says why") from None
            log.warning("LoRA loader process %s died (exit code %s) while loading %r; starting a new one",
                        worker.process.pid, code, task.name)
            if not self._closed:  # (shutdown kills a worker that hangs: no new one then)
                self._replace(slot)
            raise LoraLoaderDied(f"loras: the LoRA loader process died while loading {task.name!r} "
                                 f"(exit code {code}); try again") from None
        kind, *body = reply
        if kind == "plan":
            # the parent reads the file itself, opened as the worker opened it (through the store)
            plan, start = LoraPlan(**body[0]), time.perf_counter()
            lora = read_planned(plan, task.path, lambda file: self._read(slot, file))
            seconds = time.perf_counter() - start
            # The read's own speed, beside the load's total (stats): what a bound waits on is the disk
            # or what slows this thread, and the server log tells which.
            log.info("LoRA %r: read %.1f MiB in %.3f s (%.2f GB/s)", task.name, plan.file_bytes / 2**20, seconds,
                     plan.file_bytes / max(seconds, 1e-9) / 1e9)
            return lora
        if kind == "invalid":
            raise InvalidInput(*body)
        if kind == "not_found":
            raise UnknownAdapter(*body)
        if kind == "error":
            raise RuntimeError(f"loras: loading {task.name!r} failed ({shorten(no_paths(body[0]))})")
        return self._read_segment(slot, segment, body[0])

    def _read(self, slot: int, path: str) -> dict[str, torch.Tensor]:
        """A file's tensors into this process, onto the denoiser's GPU when it has one: read here,
        on a stream of this feeder thread, so a merge on the step loop only reads device memory (host
        copies there would stall the loop behind the queued UNet work). The loop adopts them onto its
        stream when they arrive (TorchDenoiser.adopt_loras)."""
        if self.device.type == "cuda":
            with torch.cuda.stream(self._streams[slot]):
                return read_tensors(path, self.device, self._staging[slot])
        return read_tensors(path)

    def _read_segment(self, slot: int, segment: str, meta: dict) -> LoraWeights:
        """The worker's tensors from its segment (the caller unlinks it right after)."""
        tensors = self._read(slot, segment)
        parts = {component: {module: LoraLayer(tensors[f"{component}/{module}/down"],
                                               tensors[f"{component}/{module}/up"], scale)
                             for module, scale in scales.items()}
                 for component, scales in meta["layers"].items()}
        unet = parts.pop("unet")
        return LoraWeights(meta["name"], unet, meta["nbytes"], text_encoders=parts)

    def _replace(self, slot: int) -> _Worker:
        old = self._workers[slot]
        if old is not None:
            old.stop(timeout=0)
        self._workers[slot] = _Worker(self._ctx, self._load)
        return self._workers[slot]

    def _remove_segments(self, pattern: str) -> None:
        for path in glob.glob(os.path.join(self.shm_dir, pattern)):
            unlink(path)


def _exit_code(worker: _Worker) -> int | None:
    worker.process.join(5)
    return worker.process.exitcode


# -- the worker process -----------------------------------------------------------------------

def _warm_up() -> None:
    """One tiny LoRA through the whole path (diffusers' converters import more on first use)."""
    import tempfile

    from safetensors.torch import save_file

    module = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    with tempfile.TemporaryDirectory(prefix="easel-lora-warm-up-") as folder:
        path = os.path.join(folder, "warm_up.safetensors")
        save_file({f"{module}.lora_A.weight": torch.zeros(1, 8, dtype=torch.float16),
                   f"{module}.lora_B.weight": torch.zeros(8, 1, dtype=torch.float16)}, path)
        write_tensors(os.path.join(folder, "segment"), _segment_tensors(load_lora("warm_up", path)))
        plan_lora("warm_up", path)


def _segment_tensors(lora: LoraWeights) -> dict[str, torch.Tensor]:
    """Every part of a LoRA (UNet, text encoders), keyed "<component>/<module>/down|up"."""
    parts = {"unet": lora.unet, **lora.text_encoders}
    return {f"{component}/{module}/{which}": tensor for component, layers in parts.items()
            for module, layer in layers.items() for which, tensor in (("down", layer.down), ("up", layer.up))}


def _hand_over(lora: LoraWeights, segment: str) -> tuple:
    """Write the loaded LoRA to its segment; the reply describes it. A function of its own so that
    the LoRA dies with it: a worker that kept its last LoRA would hold its memory (and keep the
    file mapped, so that its pages can not be dropped from the page cache) until the next load."""
    write_tensors(segment, _segment_tensors(lora))
    parts = {"unet": lora.unet, **lora.text_encoders}
    return ("ok", {"name": lora.name, "nbytes": lora.nbytes,
                   "layers": {component: {module: layer.scale for module, layer in layers.items()}
                              for component, layers in parts.items()}})


def _worker_main(conn, load) -> None:
    import signal
    import site

    # Spawn gives the worker the parent's sys.path but not what the .pth files of the PYTHONPATH
    # folders did in the parent (the model.py preamble runs site.addsitedir on them; a deployment
    # can use one to pin or hide packages): do it again here.
    for folder in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if folder:
            site.addsitedir(folder)

    import torch

    # Loading is I/O and copies: one thread. With torch's default (a thread per core) in every
    # worker, two loads at once oversubscribe the cores and take 12 s instead of 0.7 s (H200 host).
    torch.set_num_threads(1)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the parent stops us
    os.nice(LOADER_NICENESS)
    if load is load_lora:  # imports and first calls take seconds: pay them now, not on the first request
        _warm_up()
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if message is None:
            return
        name, path, segment = message
        try:
            plan = plan_lora(name, path) if load is load_lora else None
            if plan is not None:  # the parent reads the file itself: nothing written here
                reply = ("plan", dataclasses.asdict(plan))
            else:
                reply = _hand_over(load(name, path), segment)
        except InvalidInput as exc:
            unlink(segment)
            reply = ("not_found" if isinstance(exc, UnknownAdapter) else "invalid", exc.field,
                     str(exc)[len(exc.field) + 2:])
        except Exception as exc:
            unlink(segment)
            reply = ("error", f"{exc.__class__.__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:  # the parent is gone: nobody will read or remove the segment
            unlink(segment)
            return
