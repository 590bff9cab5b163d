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
the blocks copied for it (`prepare`'s return) and runs the others whole. A step that copies every
block, from a recording in one host block (engine/host_block.py), goes in one transfer.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable

import torch

from backends.core.engine import host_block
from backends.core.runtime.conv_subsets import is_block_key
from backends.core.runtime.token_subsets import TemplateActivations


class StreamedActivations:
    """What a reusing edit's blocks read (`get`, as TemplateActivations's) for the step that
    `prepare` made ready, from a recording in host memory."""

    def __init__(self, host: TemplateActivations, device: torch.device, stream: torch.cuda.Stream | None,
                 loaded: Callable[[int], None] = lambda nbytes: None,
                 waited: Callable[[torch.cuda.Event, torch.cuda.Event], None] = lambda reached, done: None):
        """`stream`: the load stream (None on a CPU: copies are made in place); `loaded(nbytes)`
        counts the bytes copied, `waited(reached, done)` each wait of the compute stream for a
        copy (the cache's metrics: its stall is `done` minus `reached`, where positive)."""
        self.host, self.device, self.stream, self.loaded, self.waited = host, device, stream, loaded, waited
        self.rows = host.rows
        self._steps: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> block -> [rows, L, C]
        for (step, block), t in host.outputs.items():
            self._steps[step][block] = t
        self._buffers: list[dict[int, torch.Tensor] | None] = [None, None]  # by step parity
        self._ready: dict[int, torch.cuda.Event | None] = {}  # steps issued -> their copy's event
        self._copied: dict[int, frozenset[int] | None] = {}  # steps issued -> their blocks (None: every one)

    @property
    def complete(self) -> bool:
        return self.host.complete

    def get(self, step: int, block: int, row: int) -> torch.Tensor:
        return self._buffers[step % 2][block][row]

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
        buffers = self._device_buffers(step)
        # The whole step from the host block in one transfer (its outputs are one range there).
        pairs = [(buffers[_FLAT], self._flat_source(step))] if blocks is None and _FLAT in buffers else \
            [(buffers[b], t) for b, t in outputs.items()]
        if self.stream is None:
            for target, source in pairs:
                target.copy_(source)
            self._ready[step] = None
        else:
            # After every kernel queued on the compute stream so far: the last step that read this
            # buffer (two before `step`) is among them.
            read = torch.cuda.Event()
            read.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(read)
            with torch.cuda.stream(self.stream):
                for target, source in pairs:
                    target.copy_(source, non_blocking=True)
                done = torch.cuda.Event(enable_timing=True)
                done.record(self.stream)
            self._ready[step] = done
        self.loaded(sum(t.numel() * t.element_size() for t in outputs.values()))

    def _range(self, step: int) -> tuple[int, int] | None:
        """(start, end) of the step's outputs in the host block; None where the recording has none."""
        if self.host.block is None:
            return None
        return host_block.span(self.host.block, list(self._steps[step].values()))

    def _flat_source(self, step: int) -> torch.Tensor:
        start, end = self._range(step)
        return self.host.block[start:end]

    def _device_buffers(self, step: int) -> dict:
        """The device buffers `step` is copied into (its parity's): every block's, whichever blocks a
        step copies. With a host block they are views of one device range laid out as the step's
        host range (that range under _FLAT), made again where a step's layout differs from the
        last one's."""
        where = self._range(step)
        layout = () if where is None else tuple(sorted(
            (t.data_ptr() - self.host.block.data_ptr() - where[0], b, tuple(t.shape), t.dtype)
            for b, t in self._steps[step].items()))
        buffers = self._buffers[step % 2]
        if buffers is not None and buffers.get(_LAYOUT, ()) == layout:
            return buffers
        if layout:
            flat = torch.empty(where[1] - where[0], dtype=torch.uint8, device=self.device)
            buffers = {b: flat[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                       for at, b, shape, dtype in layout}
            buffers[_FLAT], buffers[_LAYOUT] = flat, layout
            made = [flat]
        else:
            buffers = {b: torch.empty_like(t, device=self.device) for b, t in self._steps[step].items()}
            made = list(buffers.values())
        if self.stream is not None:  # written on the load stream, freed with the request on ours
            for t in made:
                t.record_stream(self.stream)
        self._buffers[step % 2] = buffers
        return buffers


# Keys of a parity's device buffers beside the blocks' (never a block key: those are ints).
_FLAT, _LAYOUT = "flat", "layout"
