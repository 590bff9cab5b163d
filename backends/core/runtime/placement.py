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
