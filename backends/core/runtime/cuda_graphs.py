"""Capturing a function into a CUDA graph: what the UNet runtime, the text encoders, the VAE and
the ControlNets' graphs share."""

from __future__ import annotations

import threading

import torch

# (device, thread) -> the side stream its captures run on (see _side_stream)
_side_streams: dict[tuple[torch.device, int], torch.cuda.Stream] = {}


def capture(fn, args: tuple, pool=None, compiled: bool = False, warmup_runs: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn(*args)` `warmup_runs` times on a side stream (cuDNN and cuBLAS pick their algorithms,
    a compile finishes, allocations settle), capture it into a CUDA graph, and return the graph and
    its static outputs. `args` are the graph's static inputs: copy new values into them, then
    replay. A compiled `fn` sees dimension 0 (rows) as dynamic, so one compile serves every row
    count (compiling the SDXL halves took 83 s per shape on an H200); each still gets its graph.

    The graph is captured on the inputs' device, whatever the calling thread's current device is.
    A capture records only the work queued on its own stream, and kernels go to their tensors'
    device: with the side stream made on the thread's current device (GPU 0) and the inputs on
    GPU 1, `fn` ran eagerly beside an empty capture. Small models' replays then did nothing and
    returned the capture run's outputs, whatever the new inputs (ControlNets, text encoders and
    VAE placed on GPU 1); an SDXL ControlNet's capture failed outright
    (cudaErrorStreamCaptureInvalidated). bench/results/2026-11-27-h200x4/notes.md has both."""
    device = _device_of(args)
    if compiled:
        from torch._dynamo import maybe_mark_dynamic

        for t in _tensors(args):
            maybe_mark_dynamic(t, 0)
    with torch.cuda.device(device):
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(warmup_runs):
                fn(*args)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # On the side stream: torch.cuda.graph's default capture stream is one for the process,
        # made on whichever device captured first. thread_local: loader and BLS threads may
        # allocate while this thread captures.
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            out = fn(*args)
    return graph, out


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of this thread's captures on `device`. The caching allocator hands a
    freed block only to allocations on the stream that freed it, so with a new stream per capture
    no capture reused what an earlier one had freed in the shared pool: every capture added its
    peak to the pool (an H200 at SDXL size: 0.4-0.9 GiB per 2-row reusing decoder, whose static
    output is 256 KiB), and the warm-up runs' memory piled up beside it."""
    key = (device, threading.get_ident())
    stream = _side_streams.get(key)
    if stream is None:
        stream = _side_streams[key] = torch.cuda.Stream(device)
    return stream


def _device_of(args: tuple) -> torch.device:
    devices = {t.device for t in _tensors(args) if t.is_cuda}
    if len(devices) != 1:
        raise ValueError(f"capture: a graph's inputs must be on one CUDA device, got {sorted(map(str, devices))}")
    return devices.pop()


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensors(a)


class GraphSet:
    """One function's CUDA graphs, one per key (its inputs' shapes), each captured on first use
    from static copies of the inputs; a call copies the new values into them and replays. The
    result is the graph's static outputs: the next replay of that graph overwrites them. The UNet
    runtime keeps its own buckets (their buffers are shared between the two halves)."""

    def __init__(self, pool=None, compiled: bool = False, warmup_runs: int = 1,
                 memory_format: torch.memory_format = torch.preserve_format):
        self.pool = pool
        self.compiled = compiled
        self.warmup_runs = warmup_runs
        self.memory_format = memory_format
        self.graphs: dict[object, tuple] = {}  # key -> (graph, static inputs, static outputs)

    def __len__(self) -> int:
        return len(self.graphs)

    def __call__(self, key, fn, *inputs):
        """`fn` is used only to capture a key's graph: it is not kept, so a graph set owned by a
        model's entry does not keep the model alive."""
        entry = self.graphs.get(key)
        if entry is None:
            static = tuple(t.clone(memory_format=self.memory_format) for t in inputs)
            graph, out = capture(fn, static, self.pool, self.compiled, self.warmup_runs)
            entry = self.graphs[key] = (graph, static, out)
        graph, static, out = entry
        for buffer, value in zip(static, inputs):
            buffer.copy_(value)
        graph.replay()
        return out
