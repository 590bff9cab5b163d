"""Where an engine runs (device) and in which precision; torch-free so light adapters can import it."""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_NAMES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Placement:
    device: str = "cpu"
    dtype: str = "fp32"

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {list(DTYPE_NAMES)}")

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[self.dtype]

    def make_current(self) -> None:
        """Make this placement's GPU the calling thread's current CUDA device.

        CUDA's current device is per thread and starts at GPU 0, and what names no device lands
        there: a new stream, torch.cuda.synchronize(), the CUDA context that pinned host memory
        is made under. A Triton stub's threads start on GPU 0 whatever the instance's GPU, so each
        GPU model calls this first in `initialize` (the stub runs `execute` on the same thread);
        threads of their own make their device current themselves (a stream context does)."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.device))
