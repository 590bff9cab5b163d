"""Capturing a function into a CUDA graph: what the UNet runtime, the text encoders, the VAE and
the ControlNets' graphs share."""

from __future__ import annotations

import torch


def capture(fn, args: tuple, pool=None, compiled: bool = False, warmup_runs: int = 1) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn(*args)` `warmup_runs` times on a side stream (cuDNN and cuBLAS pick their algorithms,
    a compile finishes, allocations settle), capture it into a CUDA graph, and return the graph and
    its static outputs. `args` are the graph's static inputs: copy new values into them, then
    replay. A compiled `fn` sees dimension 0 (rows) as dynamic, so one compile serves every row
    count (compiling the SDXL halves took 83 s per shape on an H200); each still gets its graph."""
    if compiled:
        from torch._dynamo import maybe_mark_dynamic

        for t in _tensors(args):
            maybe_mark_dynamic(t, 0)
    current = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup_runs):
            fn(*args)
    current.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # On the side stream, which is on the current device: torch.cuda.graph's default capture
    # stream is one for the process, made on whichever device captured first. thread_local:
    # loader and BLS threads may allocate while this thread captures.
    with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
        out = fn(*args)
    return graph, out


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensors(a)
