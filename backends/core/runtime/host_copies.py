"""Host tensors to a device without waiting for it."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`, queued on the current stream. A copy from pageable memory would first
    wait for everything queued on that stream (CUDA synchronizes it), so a request admitted while
    steps are queued would idle the GPU; from pinned memory the copy is asynchronous, and torch's
    caching host allocator keeps the pinned buffer until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)
