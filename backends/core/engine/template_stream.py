"""A template's recording read from host memory step by step (InstGenIE's loading beside compute).

An SDXL recording at 1024 px with guidance is 21 GB (0.42 GB a step): more than a device budget
should hold for one template. A reusing edit whose recording is in (pinned) host memory and over
the device budget (engine/template_cache.py) reads it through `StreamedActivations`: at the
assembly of step k, step k's outputs (copied earlier) are made ready for the compute stream, which
waits for their copy's event on the GPU (the host never waits), and step k+1's copy is issued on
the template cache's load stream into the other of two device buffers, so it runs beside step k's
compute. The buffer it writes was last read by step k-1: the copy waits for an event recorded on
the compute stream after that step's kernels.

Only the transformer blocks a plan names are copied (runtime/cache_plan.StreamPlans: Algorithm 1
with the copies' times, so that a copy never outlasts the step it hides behind), with whatever
else the recording holds (runtime/conv_subsets.py's ResNet blocks); a step takes the recording in
the blocks copied for it (`prepare`'s return) and runs the others whole. The recording is one host
block (engine/host_block.py), a step's outputs one range of it: a step that copies every block goes
in one transfer, into views of one device range laid out alike.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from backends.core.engine import host_block
from backends.core.runtime.conv_subsets import is_block_key
from backends.core.runtime.token_subsets import TemplateActivations


@dataclass
class _DeviceStep:
    """One parity's device range, laid out as a step's range in the host block, and its views."""

    layout: tuple  # (offset in the range, key, shape, dtype) of each output
    flat: torch.Tensor
    views: dict[int, torch.Tensor]


class StreamedActivations:
    """What a reusing edit's blocks read (`get`, as TemplateActivations's) for the step that
    `prepare` made ready, from a recording in host memory (one host block: engine/host_block.py)."""

    def __init__(self, host: TemplateActivations, device: torch.device, stream: torch.cuda.Stream | None,
                 loaded: Callable[[int], None] = lambda nbytes: None,
                 waited: Callable[[torch.cuda.Event, torch.cuda.Event], None] = lambda reached, done: None):
        """`stream`: the load stream (None on a CPU: copies are made in place); `loaded(nbytes)`
        counts the bytes copied, `waited(reached, done)` each wait of the compute stream for a
        copy (the cache's metrics: its stall is `done` minus `reached`, where positive)."""
        if host.block is None:
            raise ValueError("a streamed recording is kept in one host block (engine/host_block.pack)")
        self.host, self.device, self.stream, self.loaded, self.waited = host, device, stream, loaded, waited
        self.rows = host.rows
        self._steps: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> block -> [rows, L, C]
        for (step, block), t in host.outputs.items():
            self._steps[step][block] = t
        # step -> its outputs' range [start, end) in the host block, and their layout in it
        self._ranges = {step: _range(host.block, outputs) for step, outputs in self._steps.items()}
        self._buffers: list[_DeviceStep | None] = [None, None]  # by step parity
        self._ready: dict[int, torch.cuda.Event | None] = {}  # steps issued -> their copy's event
        self._copied: dict[int, frozenset[int] | None] = {}  # steps issued -> their blocks (None: every one)

    @property
    def complete(self) -> bool:
        return self.host.complete

    def get(self, step: int, block: int, row: int) -> torch.Tensor:
        return self._buffers[step % 2].views[block][row]

    def holds(self, step: int, key: int) -> bool:
        return key in self._steps[step]

    def prepare(self, step: int, last: int, first: frozenset[int] | None = None,
                ahead: frozenset[int] | None = None) -> frozenset[int] | None:
        """(The loop thread, assembling `step`, before its kernels are queued.) The step's outputs
        ready for the compute stream, copied now (the blocks `first`) unless they were a step ago;
        the next one's copy (the blocks `ahead`) started, unless `step` is the `last`. Returns the
        blocks ready for `step` (None: every one). None for a set of blocks: every block."""
        if step not in self._ready:
            self._issue(step, first)
        event = self._ready.pop(step)
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            reached = torch.cuda.Event(enable_timing=True)
            reached.record(compute)
            compute.wait_event(event)
            self.waited(reached, event)
        if step < last and step + 1 not in self._ready:
            self._issue(step + 1, ahead)
        return self._copied.pop(step)

    def _issue(self, step: int, blocks: frozenset[int] | None) -> None:
        outputs = self._steps[step]
        if blocks is not None and not blocks >= {b for b in outputs if is_block_key(b)}:
            outputs = {b: t for b, t in outputs.items() if b in blocks or not is_block_key(b)}
        else:
            blocks = None
        self._copied[step] = None if blocks is None else frozenset(b for b in outputs if is_block_key(b))
        start, end, layout = self._ranges[step]
        target = self._device_step(step, end - start, layout)
        # The whole step in one transfer (its outputs are one range of the host block), else block by block.
        pairs = [(target.flat, self.host.block[start:end])] if blocks is None else \
            [(target.views[b], t) for b, t in outputs.items()]
        if self.stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            self._ready[step] = None
        else:
            # After every kernel queued on the compute stream so far: the last step that read this
            # buffer (two before `step`) is among them.
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(read)
            with torch.cuda.stream(self.stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.stream)
            self._ready[step] = done
        self.loaded(sum(t.numel() * t.element_size() for t in outputs.values()))

    def _device_step(self, step: int, nbytes: int, layout: tuple) -> _DeviceStep:
        """The device range `step` is copied into (its parity's), `nbytes` laid out as `layout` (the
        step's host range's): made again where a step's layout differs from the last one's."""
        kept = self._buffers[step % 2]
        if kept is not None and kept.layout == layout:
            return kept
        flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.stream is not None:  # written on the load stream, freed with the request on ours
            flat.record_stream(self.stream)
        views = {b: flat[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                 for at, b, shape, dtype in layout}
        kept = self._buffers[step % 2] = _DeviceStep(layout, flat, views)
        return kept


def _range(block: torch.Tensor, outputs: dict[int, torch.Tensor]) -> tuple[int, int, tuple]:
    """(start, end, layout) of a step's `outputs` (views into the host `block`): the byte range they
    cover and each one's (offset in it, key, shape, dtype)."""
    start, end = host_block.span(block, list(outputs.values()))
    base = block.data_ptr() + start
    return start, end, tuple(sorted((t.data_ptr() - base, b, tuple(t.shape), t.dtype) for b, t in outputs.items()))
