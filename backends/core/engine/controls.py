"""A step's ControlNet calls: submitted before the encoder half (so that they run beside it) and
collected into residuals before the decoder half.

A request's ControlNets are called on its rows together, or, where the runtime spreads the
request's rows over its sides (latent parallelism: the unconditional row on the second GPU), once
per row, each call's residuals delivered to its row's device: the ControlNets split the same way
as the UNet, each call does half the work, and no residual crosses between the GPUs afterwards.
With a row split (DenoiserConfig.controlnet_row_split) the calls are per row in one place too,
so that two instances of the service share a guided request's ControlNet time.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from backends.core.adapters.controlnet import ControlCall, ResidualProvider, sum_residuals
from backends.core.engine.config import CONTROLNET_MODES
from backends.core.request.params import InvalidInput
from backends.core.runtime.base import PlacedResiduals, Residuals


class ControlNetSteps:
    """The ControlNet calls of the engine's steps, in its mode: `sync` (step t's residuals from step
    t's latents: exact) or `pipelined` (step t uses the calls submitted at step t-1, which then ran
    beside a whole step: approximate). Counts the calls and the time the decoder half waited for
    them (the part not hidden beside the encoder half)."""

    def __init__(self, provider: ResidualProvider | None, mode: str = "sync", split_rows: bool = False,
                 stream=None, side_devices: tuple = ()):
        if mode not in CONTROLNET_MODES:
            raise ValueError(f"controlnet_mode: {mode!r} is not one of {CONTROLNET_MODES}")
        self.provider, self.mode, self.split_rows = provider, mode, split_rows
        self.stream, self.side_devices = stream, side_devices
        self.wait_s = 0.0
        self.calls = 0

    def check(self, name: str) -> None:
        """An unknown ControlNet fails its request at admission, before any step."""
        if self.provider is None:
            raise ValueError("controlnets: this denoiser has no adapter store")
        self.provider.check(name)

    def submit(self, states, sample: torch.Tensor, timestep: torch.Tensor, sides) -> list[list["ControlPart"]]:
        """This step's calls (to run beside the encoder half); pipelined: the previous step's."""
        ready = None
        if self.stream is not None and any(s.controls for s in states):
            ready = torch.cuda.Event()  # the calls read the step's latents once the engine's stream wrote them
            ready.record(self.stream)
        pending = submit_controls(self.provider, states, sample, timestep, sides, self.side_devices, ready,
                                  split_rows=self.split_rows)
        if self.mode == "pipelined":
            used = []
            for s, fresh in zip(states, pending):
                used.append(fresh if s.stale_controls is None else s.stale_controls)
                s.stale_controls = fresh
            pending = used
        return pending

    def collect(self, states, pending, sides, adopt, failed: dict) -> Residuals | PlacedResiduals | None:
        collected = collect_controls(states, pending, sides, self.side_devices, adopt, failed)
        self.wait_s += collected.wait_s
        self.calls += collected.calls
        return collected.residuals


@dataclass
class ControlPart:
    """The calls of one request's ControlNets on some of its rows."""

    offset: int  # the request's first row they cover
    rows: int
    futures: list[Future]


def submit_controls(provider: ResidualProvider, states, sample: torch.Tensor, timestep: torch.Tensor,
                    sides: tuple[int, ...] | None, side_devices: tuple, ready,
                    split_rows: bool = False) -> list[list[ControlPart]]:
    """Every ControlNet call of this step whose guidance window is open, per request in order.
    `sides`: the runtime's side of each batch row (UNetRuntime.row_sides), or None for one place.
    `split_rows`: a call per row even where the request's rows run in one place."""
    pending, row = [], 0
    for s in states:
        active = [c for c in s.controls if c.keep(s.index, len(s.timesteps))]
        mine = sides[row:row + s.rows] if sides is not None else None
        split = (split_rows and s.rows > 1) or (mine is not None and len(set(mine)) > 1)
        spans = ([(k, 1) for k in range(s.rows)] if split else [(0, s.rows)]) if active else []
        parts = []
        for offset, n in spans:
            rows, local = slice(row + offset, row + offset + n), slice(offset, offset + n)
            parts.append(ControlPart(offset, n, [provider.submit(ControlCall(
                c.name, c.scale, c.image[local], sample[rows], timestep[rows], s.embeds[local], s.pooled[local],
                s.time_ids[local], ready, session=f"{c.session}/{offset}" if split and c.session else c.session,
                device=side_devices[mine[offset]] if mine is not None else None)) for c in active]))
        pending.append(parts)
        row += s.rows
    return pending


@dataclass
class Collected:
    residuals: Residuals | PlacedResiduals | None
    wait_s: float
    calls: int


def collect_controls(states, pending: list[list[ControlPart]], sides: tuple[int, ...] | None, side_devices: tuple,
                     adopt, failed: dict) -> Collected:
    """Each request's summed ControlNets on its rows, zeros on rows without any: for the whole
    batch (one place), or per side over the rows that run there, on its device (`sides`). None
    when no request has any. A request whose ControlNet failed goes into `failed` and leaves."""
    calls = sum(len(p.futures) for parts in pending for p in parts)
    if not calls:
        return Collected(None, 0.0, 0)
    start = time.perf_counter()
    summed: list[list[tuple[ControlPart, Residuals]] | None] = []
    for s, parts in zip(states, pending):
        got = []
        try:
            for part in parts:
                delivered = [f.result() for f in part.futures]
                # made on a BLS thread's stream (and maybe not yet written): before anything reads them
                adopt((t for d in delivered for t in (*d.residuals[0], d.residuals[1])),
                      [(d.written, d.residuals[1].device) for d in delivered if d.written is not None])
                got.append((part, sum_residuals([d.residuals for d in delivered])))
        except Exception as exc:  # this request's ControlNet failed: it alone leaves
            # (a client's mistake or an adapter not found stays that, for its status code)
            failed[s.job.request_id] = exc if isinstance(exc, InvalidInput) else f"controlnet: {exc}"
            got = None
        summed.append(got)
    wait_s = time.perf_counter() - start
    shapes = next((r for got in summed if got for _, r in got), None)
    if shapes is None:
        return Collected(None, wait_s, calls)
    per_side: dict = {}  # side -> [residuals of each span on it], in batch order
    row = 0
    for s, got in zip(states, summed):
        for offset, n, side in _spans(sides[row:row + s.rows] if sides is not None else (0,) * s.rows):
            per_side.setdefault(side, []).append(_span(got, offset, n, shapes, side_devices[side]))
        row += s.rows
    placed = {side: _cat(spans) for side, spans in per_side.items()}
    return Collected(placed[0] if sides is None else placed, wait_s, calls)


def _spans(sides: tuple[int, ...]):
    """A request's rows as runs on one side: (first row, rows, side)."""
    start = 0
    for k in range(1, len(sides) + 1):
        if k == len(sides) or sides[k] != sides[start]:
            yield start, k - start, sides[start]
            start = k


def _span(got, offset: int, n: int, shapes: Residuals, device) -> Residuals:
    """Rows offset..offset+n of a request's residuals on `device`: from the part that covers them
    (a view, unless a pipelined call was made for another side), row by row from parts that cover
    them apart, or zeros where the request has none."""
    for part, (down, mid) in got or ():
        if part.offset <= offset and offset + n <= part.offset + part.rows:
            i = slice(offset - part.offset, offset - part.offset + n)
            return [d[i].to(device) for d in down], mid[i].to(device)
    if got and n > 1:
        return _cat([_span(got, offset + k, 1, shapes, device) for k in range(n)])
    return ([d.new_zeros((n, *d.shape[1:]), device=device) for d in shapes[0]],
            shapes[1].new_zeros((n, *shapes[1].shape[1:]), device=device))


def _cat(parts: list[Residuals]) -> Residuals:
    if len(parts) == 1:
        return parts[0]
    return [torch.cat(d) for d in zip(*(down for down, _ in parts))], torch.cat([mid for _, mid in parts])
