"""Captures that share a memory pool (runtime/cuda_graphs.py) reuse what earlier captures freed
there: a later capture of the same function adds only its static output to the pool, not its
intermediates again, and its warm-up runs reuse the memory of the earlier warm-ups."""

from __future__ import annotations

import pytest
import torch

from backends.core.runtime.cuda_graphs import capture

pytestmark = pytest.mark.gpu
MIB = 1 << 20


def test_captures_sharing_a_pool_reuse_each_others_freed_memory():
    pool = torch.cuda.graph_pool_handle()
    x = torch.randn(1024, 1024, device="cuda")  # 4 MiB

    def fn(t):
        return (t.repeat(64, 1) * 2).sum(0)  # two 256 MiB intermediates, a 4 KiB output

    with torch.inference_mode():
        # (every graph kept alive, as a runtime keeps its buckets': a pool whose graphs are all gone
        # may not be captured into again)
        graphs = [capture(fn, (x,), pool)]
        torch.cuda.synchronize()
        first = torch.cuda.memory_reserved()
        graphs += [capture(fn, (x,), pool) for _ in range(4)]
        torch.cuda.synchronize()
        grown = torch.cuda.memory_reserved() - first
        outputs = []
        for graph, out in graphs:  # (a capture only records: its outputs hold values once replayed)
            graph.replay()
            outputs.append(out.clone())
        torch.cuda.synchronize()
    assert grown < 64 * MIB, f"four more captures reserved {grown / MIB:.0f} MiB"
    assert all(torch.allclose(out, outputs[0]) for out in outputs)
