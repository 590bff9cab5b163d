"""Decides how a LoRA file is read beside the other threads of its process.

What slows a planned LoRA read beside the other threads of its process (in the server, the
denoiser's): the same read (`shm_tensors.read_tensors` onto the GPU through two pinned chunks, as
the loader's feeder thread does it), cold, on a thread of this process, beside:

- `alone`: nothing else;
- `nice`: the reading thread at the loader's niceness;
- `gpu`: a thread that replays a CUDA graph back to back, at most two replays ahead of the GPU
  (waiting on an event, as the step loop does), keeping the GPU busy;
- `gil`: a thread running pure Python (holding the GIL except at the interpreter's switches);
- `gpu+nice`: the server's case;
- `gil+switch`: `gil` with the interpreter's switch interval at 0.5 ms instead of 5.

Conditions alternate from run to run; each read drops the file's pages first. Prints GB/s per
condition (median and range) and writes JSON.

    python3 -m bench.micro.lora_read_contention --work /tmp/easel-lora --out $OUT/lora_read_contention.json
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import sys
import threading
import time
from pathlib import Path

from clients.bench.common import start_logging, write_json
from bench.micro.lora_load_micro import sdxl_unet_config
from bench.micro.lora_sdxl import drop_cache, write_loras

log = logging.getLogger("bench.micro.lora_read_contention")
CONDITIONS = ("alone", "nice", "gpu", "gpu+nice", "gil", "gil+switch")
SHORT_SWITCH_S = 0.0005


class GraphLoop:
    """One CUDA graph (a chain of fp16 products, about 50 ms on an H200) and, while entered, a
    thread that replays it back to back with at most two replays queued."""

    def __init__(self):
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        self.stream = torch.cuda.Stream()
        with torch.cuda.stream(self.stream):
            a @ a  # warm cuBLAS on the capture stream
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                x = a
                for _ in range(30):
                    x = (x @ a) * 1e-4
        self.replays = 0

    def _run(self, stop: threading.Event) -> None:
        import torch

        queued = []
        with torch.cuda.stream(self.stream):
            while not stop.is_set():
                if len(queued) == 2:
                    queued.pop(0).synchronize()
                self.graph.replay()
                event = torch.cuda.Event()
                event.record(self.stream)
                queued.append(event)
                self.replays += 1
        self.stream.synchronize()

    def __enter__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name="graph-loop")
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class PythonSpin:
    """A thread running Python until stopped: it holds the GIL but at the interpreter's switches."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="python-spin")

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            for i in range(1000):
                n += i * i

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def timed_read(path: str, staging, niceness: int) -> float:
    """Seconds for one cold read onto the GPU, on a fresh thread at `niceness`."""
    import torch

    from backends.core.adapters.shm_tensors import read_tensors

    drop_cache([path])
    seconds = []

    def read() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        with torch.cuda.stream(torch.cuda.Stream()):
            start = time.perf_counter()
            read_tensors(path, "cuda", staging)
            seconds.append(time.perf_counter() - start)

    thread = threading.Thread(target=read, name="reader")
    thread.start()
    thread.join()
    return seconds[0]


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the LoRA file")
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--mib", type=float, default=340.0, help="the LoRA's size")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.adapters.lora_loader import LOADER_NICENESS
    from backends.core.adapters.shm_tensors import Staging

    unet = sdxl_unet_config(args.work / "unet-config")
    (lora,) = write_loras(args.work / "adapters", unet, [args.mib], 1e-3, "cuda")
    staging = Staging()
    loop = GraphLoop()
    nothing = contextlib.nullcontext()
    seconds: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    replays_per_s: list[float] = []
    for run in range(args.runs):
        order = CONDITIONS[run % len(CONDITIONS):] + CONDITIONS[:run % len(CONDITIONS)]
        for condition in order:
            parts = condition.split("+")
            niceness = LOADER_NICENESS if "nice" in parts else 0
            default_switch = sys.getswitchinterval()
            if "switch" in parts:
                sys.setswitchinterval(SHORT_SWITCH_S)
            try:
                with (loop if "gpu" in parts else nothing) as gpu, (PythonSpin() if "gil" in parts else nothing):
                    time.sleep(0.1)  # let the neighbours start
                    started, replays = time.perf_counter(), gpu.replays if gpu else 0
                    seconds[condition].append(timed_read(lora["path"], staging, niceness))
                    if gpu:
                        replays_per_s.append((gpu.replays - replays) / (time.perf_counter() - started))
            finally:
                sys.setswitchinterval(default_switch)
        log.info("run %d: %s", run, ", ".join(f"{c} {seconds[c][-1]:.3f} s" for c in CONDITIONS))
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "lora": lora,
              "loader_niceness": LOADER_NICENESS, "runs": args.runs, "seconds": seconds,
              "graph_replays_per_s": replays_per_s, "conditions": {}}
    for condition, values in seconds.items():
        speeds = [lora["bytes"] / s / 1e9 for s in values]
        report["conditions"][condition] = {"median_s": statistics.median(values),
                                           "median_gb_s": statistics.median(speeds),
                                           "min_gb_s": min(speeds), "max_gb_s": max(speeds)}
        log.info("%-14s median %.3f s, %.2f GB/s (%.2f-%.2f)", condition, statistics.median(values),
                 statistics.median(speeds), min(speeds), max(speeds))
    write_json(args.out, report)


if __name__ == "__main__":
    main()
