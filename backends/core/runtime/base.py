"""The one contract every UNet runtime sits behind, and the typed batch of one denoising step.

The denoiser never calls a module: it fills a `StepBatch` and drives a `UNetRuntime`

    enc   = runtime.encode(batch)                    # time/text embeddings, down blocks, mid block
    noise = runtime.decode(batch, enc, residuals)    # ControlNet residuals join here; up blocks, head

so torch eager (the exact reference, CPU tests), torch fast (CUDA graphs per bucket, optionally
compiled) and later TensorRT are interchangeable. The UNet is cut in two because ControlNets run
beside the encoder half and meet the UNet at the decoder half.

`StepBatch` already has the fields of the execution modes that come later, so they arrive as new
runtimes or new field values, not a redesign:
- `tokens`: masked editing (InstGenIE, runtime/token_subsets.py); rows whose unmasked tokens come
  from a template's recorded activations, so only the masked tokens are computed;
- `patches`: mixed resolutions (PatchedServe); the batch's rows are equal-size latent patches cut
  from images of different sizes, with per-image attention and GroupNorm statistics.
A runtime whose `caps` lack a mode refuses a batch that uses it (`check_batch`), loudly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from backends.core.adapters.lora import LoraSet
    from backends.core.runtime.token_subsets import TokenLayout


@dataclass(frozen=True)
class RuntimeCaps:
    """What a runtime can do; the denoiser and the scheduler plan around it."""

    name: str
    graphs: bool = False  # replays captured CUDA graphs (static buffers per bucket)
    compiled: bool = False  # torch.compile'd halves
    inplace_refit: bool = True  # weights written in place (a LoRA merge) are seen by the next step
    unmerged_lora: bool = True  # per-row low-rank LoRA terms for batches that mix LoRA sets
    token_subsets: bool = False  # StepBatch.tokens (masked editing)
    patches: bool = False  # StepBatch.patches (mixed resolutions)


@dataclass
class RuntimeStats:
    """Counters the metrics thread reads (plain ints and floats; written by the loop thread)."""

    graph_steps: int = 0
    eager_steps: int = 0
    captures: int = 0
    capture_s: float = 0.0
    released: int = 0  # reusing steps' buckets whose graphs were let go for want of room (subset_graph_limit)
    warmup_s: float = 0.0  # capturing (and compiling) the configured buckets at load
    misses: dict = field(default_factory=dict)  # shape -> steps run eager for want of a bucket


@dataclass(frozen=True)
class LoraSegment:
    """Rows of the batch that carry their own LoRA set, applied as unmerged low-rank terms."""

    rows: slice
    loras: LoraSet


@dataclass(frozen=True)
class PatchLayout:
    """Mixed resolutions: which image each patch row belongs to and where it sits in it, so that a
    runtime can keep attention and GroupNorm statistics per image. Not served by any runtime yet."""

    image_of_row: tuple[int, ...]
    origin_of_row: tuple[tuple[int, int], ...]  # (latent y, x) of each patch's top-left corner
    image_shapes: tuple[tuple[int, int], ...]  # latent (h, w) of each image


@dataclass
class StepBatch:
    """The UNet input of one step: one row per UNet row (a request with guidance has two).
    Tensors live on the runtime's device, in its dtype (timestep in fp32)."""

    sample: torch.Tensor  # [rows, C, h, w], already scaled by each row's sampler
    timestep: torch.Tensor  # [rows]
    text: torch.Tensor  # [rows, tokens, dim]
    pooled: torch.Tensor  # [rows, pooled dim]
    time_ids: torch.Tensor  # [rows, 6]
    lora_segments: tuple[LoraSegment, ...] = ()  # empty: base weights, or one merged set for all
    # Names the text rows and the weights: a later batch with an equal key has the same text in
    # the same rows under the same weights, so a runtime may reuse what it derived from them (the
    # fast runtime's text K/V projections). None: nothing is reused.
    text_key: tuple | None = None
    # Each request's rows, in order (a request with guidance has two, unconditional first), for a
    # runtime that places rows by request (latent parallelism). None: not known; rows stay together.
    rows_per_request: tuple[int, ...] | None = None
    tokens: TokenLayout | None = None  # per row: record, reuse (masked tokens only) or run whole
    patches: PatchLayout | None = None

    @property
    def rows(self) -> int:
        return self.sample.shape[0]

    def map_rows(self, fn, **changes) -> "StepBatch":
        """This batch with `changes` replacing fields and `fn` applied to each other per-row tensor
        that is set (ROW_TENSORS); every other field, one added later included, carried over as it
        is. The one way runtimes derive a batch from another."""
        tensors = {name: fn(getattr(self, name)) for name in ROW_TENSORS
                   if name not in changes and getattr(self, name) is not None}
        return replace(self, **tensors, **changes)

    @property
    def latent_shape(self) -> tuple[int, int]:
        return tuple(self.sample.shape[-2:])


ROW_TENSORS = ("sample", "timestep", "text", "pooled", "time_ids")  # StepBatch's, one row per row


@dataclass
class EncoderOut:
    """What the encoder half hands to the decoder half: read only by the runtime that made it. A
    graphed runtime returns views of its static buffers: valid until its next `encode`."""

    emb: torch.Tensor
    mid: torch.Tensor
    skips: tuple[torch.Tensor, ...]
    meta: dict = field(default_factory=dict)  # the runtime's own bookkeeping (e.g. its bucket)


Residuals = tuple[list["torch.Tensor"], "torch.Tensor"]  # ControlNets' summed (down, mid) residuals
# The residuals of a batch whose rows a runtime spreads over its sides (row_sides): per side,
# those of the rows that run there, in batch order, already on its device.
PlacedResiduals = dict[int, Residuals]


class UNetRuntime(Protocol):
    caps: RuntimeCaps
    stats: RuntimeStats
    # The module whose parameters are this runtime's weights: a LoRA merge writes into them in
    # place (caps.inplace_refit), which captured graphs see.
    weights_module: nn.Module
    # Every copy of the weights a step computes with (weights_module first): a LoRA merge writes
    # into each. One, unless the runtime spreads a step over devices (runtime/cfg_parallel.py).
    weight_copies: tuple[nn.Module, ...]
    # Streams on other devices that the runtime computes on: the thread that drives it keeps them
    # current there, so that what it launches on those devices (a merge) is ordered with the runtime.
    streams: tuple[torch.cuda.Stream, ...]
    # The device of each part of the runtime that runs rows of a step (one, unless it spreads them).
    side_devices: tuple[torch.device, ...]

    def encode(self, batch: StepBatch) -> EncoderOut: ...

    def decode(self, batch: StepBatch, enc: EncoderOut, residuals: Residuals | PlacedResiduals | None
               ) -> torch.Tensor: ...

    def row_sides(self, rows_per_request: tuple[int, ...]) -> tuple[int, ...] | None:
        """Which side (an index into side_devices) runs each row of a batch of such requests; None:
        the runtime runs every row in one place (then decode takes Residuals, else PlacedResiduals)."""

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Overwrite the named weights in place; graphs and engines stay valid."""

    def weights_written(self) -> None:
        """The weights were written in place by someone else (a LoRA merge or restore): refresh
        what the runtime derived from them (FP8 copies)."""


def check_batch(caps: RuntimeCaps, batch: StepBatch) -> None:
    if batch.tokens is not None and not caps.token_subsets:
        raise NotImplementedError(f"the {caps.name} runtime cannot serve token subsets (masked editing)")
    if batch.patches is not None and not caps.patches:
        raise NotImplementedError(f"the {caps.name} runtime cannot serve patch batches (mixed resolutions)")
    if batch.lora_segments and not caps.unmerged_lora:
        raise NotImplementedError(f"the {caps.name} runtime cannot apply unmerged LoRA terms")


def refit_in_place(module: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """Copy each named weight into the parameter's own memory (all names checked first)."""
    import torch

    params = dict(module.named_parameters())
    for name, tensor in weights.items():
        if name not in params:
            raise KeyError(f"refit: the UNet has no weight {name!r}")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"refit: {name} is {tuple(tensor.shape)}, the UNet's is {tuple(params[name].shape)}")
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor)
