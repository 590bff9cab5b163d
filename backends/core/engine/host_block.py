"""A recording's copy in the template cache's host tier: one block of host memory, page-locked on a
GPU host, holding every output as a view.

torch's caching pinned allocator rounds each allocation up to a power of two and keeps what is
freed for later pinned allocations. An SDXL recording's outputs (5.2-21 MB each at 1024 px) then
took up to twice their bytes, and the host tier's budget did not bound the memory it pinned. A
block of exactly the recording's bytes, registered with CUDA (cudaHostRegister) and unregistered
when it is freed, has neither problem. Outputs are laid out in (step, key) order, so a step's
outputs are one contiguous range: a streamed edit copies a whole step to the device in one transfer
(engine/template_stream.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping

import torch

ALIGN = 256  # bytes between the start of one output and the next: every dtype's alignment


def pack(outputs: Mapping[tuple[int, int], torch.Tensor], pin: bool) -> tuple[torch.Tensor,
                                                                           dict[tuple[int, int], torch.Tensor]]:
    """(block, views): a uint8 host block holding copies of `outputs` (on any device) and each one's
    view into it, in key order; registered with CUDA where `pin`."""
    offsets, total = {}, 0
    for key in sorted(outputs):
        offsets[key] = total
        total += _aligned(outputs[key].numel() * outputs[key].element_size())
    block = torch.empty(total, dtype=torch.uint8)
    if pin:
        _register(block)
    views, streams = {}, set()
    for key, offset in offsets.items():
        t = outputs[key]
        view = block[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=pin and t.is_cuda)
        views[key] = view
        if t.is_cuda:
            streams.add(torch.cuda.current_stream(t.device))
    for stream in streams:  # the device-to-host copies ended before anyone reads the views
        stream.synchronize()
    return block, views


def span(block: torch.Tensor, views: list[torch.Tensor]) -> tuple[int, int]:
    """(start, end) byte offsets in `block` of the range that `views` (into it) cover."""
    base = block.data_ptr()
    return (min(v.data_ptr() for v in views) - base,
            max(v.data_ptr() + v.numel() * v.element_size() for v in views) - base)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _register(block: torch.Tensor) -> None:
    ptr, nbytes = block.data_ptr(), block.numel()
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # cudaHostRegisterPortable: every device's
    if error != 0:
        raise RuntimeError(f"template cache: page-locking a recording of {nbytes} bytes failed (CUDA error {error})")
    # (not at exit: the process's memory goes with it, and a device sync there could hang)
    weakref.finalize(block, _unregister, ptr).atexit = False


def _unregister(ptr: int) -> None:
    # A copy from the block may still be in flight (an edit cancelled after issuing the next step's).
    for device in range(torch.cuda.device_count()):
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)
