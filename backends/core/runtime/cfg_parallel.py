"""Latent parallelism: the two halves of classifier-free guidance on two devices, behind the one
runtime contract (the denoiser does not know).

A request with guidance has two UNet rows, unconditional first. The primary runtime (on the
denoiser's own GPU) runs every conditional row, the secondary (another GPU, its own copy of the
weights) every unconditional one; the row of a request without guidance runs on one device, the
one with fewer rows so far. Each side is a whole runtime (graphs or compiled, eager on CPU), so a
step's two halves are two graph replays on two GPUs that the loop thread launches back to back
without waiting, and they overlap.

What crosses between the GPUs each step: the secondary's rows of the sample going over and its
noise prediction coming back ([rows, 4, h, w] each way, 128 KiB a row at 1024 px; the sampler
runs on the primary only). The text, pooled embeddings and time ids go over only when the batch's
`text_key` changes. ControlNet residuals come per side, made on the device of their rows
(`row_sides`, engine/controls.py); residuals given for the whole batch have the secondary's rows
copied over. Copies between two GPUs are peer to peer (NVLink where there is one), never through
host memory, and PyTorch orders them on both devices' current streams.

LoRA merges write into both copies of the weights (`weight_copies`); the secondary's work runs on
a stream of its own (`streams`), which the loop thread keeps current on that device.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from backends.core.runtime.base import (EncoderOut, LoraSegment, PlacedResiduals, Residuals, StepBatch,
                                        UNetRuntime, check_batch)

MAX_SPLITS = 256  # row splits kept with their index tensors


@dataclass(frozen=True)
class RowSplit:
    """Which of a batch's rows each side runs, in batch order."""

    primary: tuple[int, ...]
    secondary: tuple[int, ...]


def split_rows(rows_per_request: tuple[int, ...]) -> RowSplit:
    primary: list[int] = []
    secondary: list[int] = []
    row = 0
    for n in rows_per_request:
        if n == 2:  # guidance: unconditional row first (the denoiser's order)
            secondary.append(row)
            primary.append(row + 1)
        elif n == 1:
            (primary if len(primary) <= len(secondary) else secondary).append(row)
        else:
            raise ValueError(f"rows_per_request: a request has 1 or 2 UNet rows, not {n}")
        row += n
    return RowSplit(tuple(primary), tuple(secondary))


class CfgParallelRuntime:
    def __init__(self, primary: UNetRuntime, secondary: UNetRuntime, secondary_device: str | torch.device):
        self.primary = primary
        self.secondary = secondary
        self.device = next(primary.weights_module.parameters()).device
        self.other = torch.device(secondary_device)
        self.caps = replace(primary.caps, name=f"cfg-parallel {primary.caps.name}", token_subsets=False, patches=False)
        self.stats = primary.stats
        self.weights_module = primary.weights_module
        self.weight_copies = (*primary.weight_copies, *secondary.weight_copies)
        self.side_devices = (self.device, self.other)
        # The secondary computes on a stream of its own device; the loop thread makes it current
        # there (TorchDenoiser.on_stream), so that LoRA merges into its weights are ordered with it.
        self.stream = torch.cuda.Stream(self.other) if self.other.type == "cuda" else None
        self.streams = (self.stream,) if self.stream is not None else ()
        self._splits: dict[tuple[int, ...], tuple[RowSplit, torch.Tensor, torch.Tensor]] = {}
        self._sent: list = [None, None]  # each side's ((text_key, split), (text, pooled, time_ids))

    def _on_secondary(self):
        """The secondary's device and stream current (capture and compile look at the current device)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    # --- the contract ---

    @torch.inference_mode()
    def encode(self, batch: StepBatch) -> EncoderOut:
        check_batch(self.caps, batch)
        split = self._split(batch)
        if split is None:
            return self.primary.encode(batch)
        rows, ia, ib = split
        batch_a = self._side(batch, rows, 0, ia, self.device)
        # The secondary's inputs first: a copy between two GPUs runs on the source device's current
        # stream (ordered with the other's), so made after the primary's encoder it would wait for it.
        with self._on_secondary():
            batch_b = self._side(batch, rows, 1, ib, self.other)
        enc_a = self.primary.encode(batch_a)
        with self._on_secondary():
            enc_b = self.secondary.encode(batch_b)
        return EncoderOut(enc_a.emb, enc_a.mid, enc_a.skips, meta={"parallel": (split, batch_a, enc_a, batch_b, enc_b)})

    @torch.inference_mode()
    def decode(self, batch: StepBatch, enc: EncoderOut, residuals: Residuals | PlacedResiduals | None
               ) -> torch.Tensor:
        if "parallel" not in enc.meta:
            return self.primary.decode(batch, enc, residuals)
        (rows, ia, ib), batch_a, enc_a, batch_b, enc_b = enc.meta["parallel"]
        if isinstance(residuals, dict):  # each side's rows, already on its device (row_sides)
            res_a, res_b = residuals[0], residuals[1]
        else:
            res_a = _rows_of(residuals, ia, self.device)
            with self._on_secondary():  # (before the primary's decoder, as in encode)
                res_b = _rows_of(residuals, ib, self.other)
        noise_a = self.primary.decode(batch_a, enc_a, res_a)
        with self._on_secondary():
            noise_b = self.secondary.decode(batch_b, enc_b, res_b).to(self.device, non_blocking=True)
        noise = torch.empty((batch.rows, *noise_a.shape[1:]), dtype=noise_a.dtype, device=self.device)
        noise.index_copy_(0, ia, noise_a)
        noise.index_copy_(0, ib, noise_b)
        return noise

    def row_sides(self, rows_per_request: tuple[int, ...]) -> tuple[int, ...] | None:
        split = self._split_of(rows_per_request)
        if split is None:
            return None
        sides = [0] * sum(rows_per_request)
        for r in split[0].secondary:
            sides[r] = 1
        return tuple(sides)

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        self.primary.refit(weights)
        with self._on_secondary():
            self.secondary.refit(weights)

    def weights_written(self) -> None:
        self.primary.weights_written()
        with self._on_secondary():
            self.secondary.weights_written()

    def warmup(self, template: StepBatch, sizes, with_residuals: bool = False) -> float:
        """Capture (compile) both sides' buckets: they run at the same time, so the slower one counts."""
        seconds = [0.0, 0.0]
        for i, (runtime, device) in enumerate(((self.primary, self.device), (self.secondary, self.other))):
            warm = getattr(runtime, "warmup", None)
            if warm is None:
                continue
            with self._on_secondary() if i else nullcontext():
                seconds[i] = warm(_moved(template, device), sizes, with_residuals)
        return max(seconds)

    # --- the split ---

    def _split(self, batch: StepBatch):
        """(RowSplit, the primary's rows, the secondary's rows as index tensors on the primary's
        device), or None when every row runs on the primary."""
        if batch.rows_per_request is None:
            return None
        if sum(batch.rows_per_request) != batch.rows:
            raise ValueError(f"rows_per_request: {batch.rows_per_request} does not add up to the batch's "
                             f"{batch.rows} rows")
        return self._split_of(batch.rows_per_request)

    def _split_of(self, key: tuple[int, ...]):
        if key not in self._splits:
            if len(self._splits) >= MAX_SPLITS:  # batch compositions come and go
                self._splits.clear()
            rows = split_rows(key)
            if not rows.secondary:
                self._splits[key] = None
            else:
                self._splits[key] = (rows, *(torch.tensor(r, dtype=torch.long, device=self.device)
                                             for r in (rows.primary, rows.secondary)))
        return self._splits[key]

    def _side(self, batch: StepBatch, rows: RowSplit, side: int, index: torch.Tensor, device) -> StepBatch:
        """One side's rows of the batch, on its device. Its text, pooled embeddings and time ids are
        sent again only when the batch's text_key (which names them) or its split changes."""
        mine = (rows.primary, rows.secondary)[side]
        key = (batch.text_key, rows)
        if batch.text_key is None or self._sent[side] is None or self._sent[side][0] != key:
            self._sent[side] = (key, tuple(t.index_select(0, index).to(device, non_blocking=True)
                                           for t in (batch.text, batch.pooled, batch.time_ids)))
        text, pooled, time_ids = self._sent[side][1]
        # (one side places no rows by request: rows_per_request goes)
        return batch.map_rows(lambda t: t.index_select(0, index).to(device, non_blocking=True),
                              text=text, pooled=pooled, time_ids=time_ids,
                              lora_segments=_segments_of(batch.lora_segments, mine), rows_per_request=None)


def _segments_of(segments: tuple[LoraSegment, ...], rows: tuple[int, ...]) -> tuple[LoraSegment, ...]:
    """A batch's LoRA segments in a side's own row numbers (its rows are in batch order, so each
    segment's rows stay contiguous there)."""
    out = []
    for s in segments:
        start, stop = bisect.bisect_left(rows, s.rows.start), bisect.bisect_left(rows, s.rows.stop)
        if stop > start:
            out.append(LoraSegment(slice(start, stop), s.loras))
    return tuple(out)


def _rows_of(residuals: Residuals | None, index: torch.Tensor, device: torch.device) -> Residuals | None:
    if residuals is None:
        return None
    down, mid = residuals
    return ([d.index_select(0, index).to(device, non_blocking=True) for d in down],
            mid.index_select(0, index).to(device, non_blocking=True))


def _moved(batch: StepBatch, device: torch.device) -> StepBatch:
    return batch.map_rows(lambda t: t.to(device))
