"""Templates' recorded activations, kept for the edits that reuse them (runtime/token_subsets.py).

A recording belongs to a key: the template's name and everything that changes what its blocks
output besides the edit's own masked tokens (engine/workflows/inpaint.py, `template_key`). The
first edit of a key records; once it has run all its steps, later edits of the key reuse it.
An edit that finds a recording still being made records one of its own (the first may have been
cancelled), which replaces it.

Three tiers, each least recently used first out past its byte budget: the device (where edits
read recordings), host memory (a block per recording, page-locked on a GPU host:
engine/host_block.py) and a folder of safetensors files, one per
recording, written when it completes, so recordings survive a restart (the folder's files are
indexed at start from their metadata; nothing but safetensors is read, nothing is unpickled). A
recording leaving the device goes to the host tier, one leaving the host tier is dropped (its
file stays). Replicas that share weights share the folder: a file another one dropped is a miss.

A hit in a lower tier is loaded to the device by the cache's loader thread (the file read, then
the copy on a CUDA stream of its own), never on the denoiser's loop: `take` hands the edit a
Future, and the loop holds that request (as a LoRA bound holds one) while the others step, until
the recording is on the device. `prefetch` starts the same load when a request is submitted, so a
request that queues finds its recording loaded or on its way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backends.core.engine import host_block
from backends.core.runtime.token_subsets import TemplateActivations

log = logging.getLogger(__name__)

DEFAULT_DEVICE_BYTES = 8 << 30
TIERS = ("device", "host", "disk")


@dataclass
class TemplateCacheStats:
    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: int = 0
    loaded_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("host", "disk"), 0))
    # Seconds the loader thread spent bringing recordings to the device (off the loop), and the
    # seconds edits were held waiting for one (their own latency; the loop kept stepping others)
    load_seconds: float = 0.0
    wait_seconds: float = 0.0
    # GPU seconds the compute stream waited for streamed recordings' copies (engine/template_stream.py):
    # zero while every copy hides behind the step before it
    stall_seconds: float = 0.0
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))


class TemplateCache:
    def __init__(self, device: torch.device | str = "cpu", device_bytes: int = DEFAULT_DEVICE_BYTES,
                 host_bytes: int = 0, disk_bytes: int = 0, folder: str | os.PathLike | None = None):
        self.device = torch.device(device)
        self.budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes if folder else 0}
        self.folder = Path(folder) if folder and disk_bytes else None
        self.stats = TemplateCacheStats()
        self._tiers: dict[str, OrderedDict] = {tier: OrderedDict() for tier in TIERS}  # key -> recording (disk: _File)
        self._lock = threading.Lock()
        self._loading: dict[str, Future] = {}  # recordings on their way to the device
        self._loader: ThreadPoolExecutor | None = None
        self._stream = None  # the loader's CUDA stream
        self._step_stream = None  # edits' copies of streamed recordings (load_stream)
        self._waits: list = []  # (compute reached the wait, copy done) event pairs not yet read
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._index_folder()

    def take(self, key: tuple, rows: int) -> tuple[bool, TemplateActivations | Future]:
        """(True, the recording on the device) for an edit that reuses one; (True, the recording in
        host memory) when it is over the device's budget: the edit streams it step by step
        (engine/template_stream.py); (True, a Future of either) when it is in a lower tier (its load
        started, or joined); (False, a new one to fill)."""
        name = _key_text(key)
        with self._lock:
            kept = self._tiers["device"].get(name)
            if kept is not None and kept.complete:
                self.stats.hits["device"] += 1
                self._tiers["device"].move_to_end(name)
                return True, kept
            kept = self._streamed(name)
            if kept is not None:
                self.stats.hits["host"] += 1
                self._tiers["host"].move_to_end(name)
                return True, kept
            future = self._start_load(name, count=True)
            if future is not None:
                return True, future
            self.stats.misses += 1
            fresh = self._tiers["device"][name] = TemplateActivations(rows)
            self._tiers["device"].move_to_end(name)
            return False, fresh

    def prefetch(self, key: tuple) -> None:
        """A request with this key is on its way: start loading its recording if a lower tier has it."""
        name = _key_text(key)
        with self._lock:
            kept = self._tiers["device"].get(name)
            if (kept is None or not kept.complete) and self._streamed(name) is None:
                self._start_load(name, count=False)

    def load_stream(self) -> torch.cuda.Stream | None:
        """The stream edits copy streamed recordings on (the loop's thread; None on a CPU)."""
        if self.device.type != "cuda":
            return None
        if self._step_stream is None:
            self._step_stream = torch.cuda.Stream(self.device)
        return self._step_stream

    def streamed_bytes(self, nbytes: int) -> None:
        """An edit copied this much of a streamed recording to the device."""
        with self._lock:
            self.stats.loaded_bytes["host"] += nbytes

    def streamed_wait(self, reached, done) -> None:
        """(The loop thread.) The compute stream waits, from the event `reached`, for a streamed
        copy that ends at the event `done` (both timed CUDA events)."""
        with self._lock:
            self._waits.append((reached, done))
            self._add_stalls()  # (those of earlier steps: the list stays short if nobody reads it)

    def read_stalls(self) -> float:
        """The stall seconds so far (stats.stall_seconds), with the waits whose events have
        completed added; never blocks."""
        with self._lock:
            self._add_stalls()
            return self.stats.stall_seconds

    def _add_stalls(self) -> None:
        pending = []
        for reached, done in self._waits:
            if reached.query() and done.query():
                self.stats.stall_seconds += max(0.0, reached.elapsed_time(done)) / 1000
            else:
                pending.append((reached, done))
        self._waits = pending

    def _streamed(self, name: str) -> TemplateActivations | None:
        """(Under the lock.) The recording in host memory, if edits stream it from there: it is
        over the device's budget."""
        kept = self._tiers["host"].get(name)
        return kept if kept is not None and kept.nbytes > self.budgets["device"] else None

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

    def _start_load(self, name: str, count: bool) -> Future | None:
        """(Under the lock.) The load of a host or disk recording, started or already running."""
        running = self._loading.get(name)
        if running is not None:
            if count:
                self.stats.hits[running.tier] += 1
            return running
        for tier in ("host", "disk"):
            kept = self._tiers[tier].get(name)
            if kept is not None:
                break
        else:
            return None
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="easel-template-load")
        future = self._loader.submit(self._load, tier, name, kept)
        future.tier = tier
        self._loading[name] = future
        if count:
            self.stats.hits[tier] += 1
        return future

    def completed(self, recording: TemplateActivations, key: tuple) -> None:
        """Its edit ran every step: later edits may reuse it. Its file is written (with a disk
        tier), and each tier sheds its least recently used recordings past its budget."""
        name = _key_text(key)
        if self.device.type == "cuda":  # (the loop's thread: its current stream is the engine's)
            recording.written = torch.cuda.Event()
            recording.written.record(torch.cuda.current_stream(self.device))
        with self._lock:
            recording.complete = True
            if self.folder is not None:
                self._write(name, recording)
            fits = recording.nbytes <= self.budgets["device"]
            if not fits:
                log.warning("template cache: a recording of %.1f GiB is over the device's budget of %.1f GiB; it "
                            "moves down the tiers at once", recording.nbytes / 2**30, self.budgets["device"] / 2**30)
            self._shed("device", keep=recording if fits else None)
            self._shed("host")
            self._shed("disk")

    def nbytes(self, tier: str) -> int:
        with self._lock:
            return self._bytes(tier)

    def _bytes(self, tier: str) -> int:
        if tier == "disk":
            return sum(f.nbytes for f in self._tiers["disk"].values())
        return sum(r.nbytes for r in self._tiers[tier].values())

    def _shed(self, tier: str, keep: TemplateActivations | None = None) -> None:
        entries = self._tiers[tier]
        total = self._bytes(tier)
        for name in list(entries):
            if total <= self.budgets[tier]:
                return
            kept = entries[name]
            if kept is keep or (tier == "device" and not kept.complete):
                continue  # the one just made, or one being recorded
            entries.pop(name)
            self.stats.evictions[tier] += 1
            if tier == "disk":
                total -= kept.nbytes
                kept.path.unlink(missing_ok=True)
                continue
            total -= kept.nbytes
            if tier == "device" and self.budgets["host"]:
                self._tiers["host"][name] = self._hosted(kept)

    def _load(self, tier: str, name: str, kept) -> TemplateActivations:
        """(The loader thread.) Read (disk) and copy to the device on the loader's own stream, then
        put the recording in the device tier."""
        start = time.perf_counter()
        try:
            if tier == "disk":
                from safetensors.torch import load_file

                recording = _from_file(load_file(str(kept.path), device="cpu"), kept.path)
            else:
                recording = kept
            if recording.nbytes > self.budgets["device"]:  # (from disk) edits stream it from host memory
                return self._to_host(name, recording)
            if self.device.type == "cuda":
                if self._stream is None:
                    self._stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(self._stream):
                    moved = _moved(recording, self.device)
                self._stream.synchronize()  # this thread waits; the loop does not
            else:
                moved = _moved(recording, self.device)
            with self._lock:
                self.stats.loaded_bytes[tier] += kept.nbytes
                if tier == "host":
                    self._tiers["host"].pop(name, None)
                elif name in self._tiers["disk"]:
                    self._tiers["disk"].move_to_end(name)
                self._tiers["device"][name] = moved
                self._tiers["device"].move_to_end(name)
                self._shed("device", keep=moved)
            return moved
        except OSError:  # its file went (another denoiser sharing the folder dropped it)
            with self._lock:
                self._tiers[tier].pop(name, None)
            raise
        finally:
            with self._lock:
                self.stats.load_seconds += time.perf_counter() - start
                self._loading.pop(name, None)

    def _hosted(self, recording: TemplateActivations) -> TemplateActivations:
        """The host tier's copy of `recording` (an edit streams it): one host block
        (engine/host_block.py), page-locked on a GPU host."""
        block, outputs = host_block.pack(_written(recording).outputs, pin=self.device.type == "cuda")
        return TemplateActivations(recording.rows, outputs, complete=True, host=True, block=block)

    def _to_host(self, name: str, recording: TemplateActivations) -> TemplateActivations:
        """(The loader thread.) A recording read from disk, pinned, into the host tier (kept there
        while it fits its budget)."""
        host = self._hosted(recording)
        with self._lock:
            self.stats.loaded_bytes["disk"] += host.nbytes
            if name in self._tiers["disk"]:
                self._tiers["disk"].move_to_end(name)
            self._tiers["host"][name] = host
            self._tiers["host"].move_to_end(name)
            self._shed("host", keep=host if host.nbytes <= self.budgets["host"] else None)
        return host

    def _write(self, name: str, recording: TemplateActivations) -> None:
        from safetensors.torch import save_file

        path = self.folder / f"{hashlib.sha256(name.encode()).hexdigest()[:32]}.safetensors"
        tensors = {f"{step}.{block}": t.contiguous().cpu() for (step, block), t in recording.outputs.items()}
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial), metadata={"key": name, "rows": str(recording.rows)})
        partial.replace(path)  # whole or absent: a crash mid-write leaves no file that looks complete
        self._tiers["disk"][name] = _File(path, path.stat().st_size)
        self._tiers["disk"].move_to_end(name)

    def _index_folder(self) -> None:
        from safetensors import safe_open

        for path in sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime):
            try:
                with safe_open(str(path), framework="pt") as f:
                    name = (f.metadata() or {})["key"]
            except Exception:  # not one of ours, or torn: left alone, never read again
                log.warning("template cache: %s is not a recording; skipped", path.name)
                continue
            self._tiers["disk"][name] = _File(path, path.stat().st_size)
        partials = list(self.folder.glob("*.partial"))
        for path in partials:
            path.unlink(missing_ok=True)
        log.info("template cache: %d recordings on disk in %s", len(self._tiers["disk"]), self.folder)


@dataclass(frozen=True)
class _File:
    """A recording on disk, its size read once (the budget and the metrics sum these)."""

    path: Path
    nbytes: int


def _key_text(key: tuple) -> str:
    return json.dumps(key, separators=(",", ":"))


def _written(recording: TemplateActivations) -> TemplateActivations:
    if recording.written is not None:
        recording.written.synchronize()  # its last steps may still be queued on the engine's stream
    return recording


def _moved(recording: TemplateActivations, device: torch.device) -> TemplateActivations:
    """A copy on `device`."""
    return TemplateActivations(recording.rows, {k: t.to(device, non_blocking=device.type == "cuda")
                                                for k, t in _written(recording).outputs.items()}, complete=True)


def _from_file(tensors: dict[str, torch.Tensor], path: Path) -> TemplateActivations:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        rows = int(f.metadata()["rows"])
    outputs = {tuple(int(p) for p in name.split(".")): t for name, t in tensors.items()}
    return TemplateActivations(rows, outputs, complete=True)
