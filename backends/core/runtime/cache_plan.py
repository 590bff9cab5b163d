"""Which transformer blocks of a step take a template's recording, when recordings are loaded
block by block beside the compute (InstGenIE's Algorithm 1).

Blocks run in order; block i's recorded output must be loaded (a copy on a load stream that runs
beside the compute) before block i can use it. Using it costs `with_cache_s` (only the masked
tokens computed) instead of `without_cache_s` (every token), but the block cannot start before
its load ends, and loads run one after another. Greedily, block by block: take the cache where
finishing the block with it (after the later of its load's end and the previous block's end) is
no later than finishing it whole; else compute it whole and load nothing for it. The compute
never waits longer than computing whole would have taken, so loading adds no bubble.

Loads issued a step ahead (a recording streamed from host memory, engine/template_stream.py)
start `lead_s` before the step's first block: the previous step's compute hides them, and the
plan takes every block it would take from the device unless the loads outlast that step. A
streamed recording's parts outside the transformer blocks (the ResNet blocks' and upsamplers'
under conv_subsets) are loaded every step whatever the plan: `fixed_load_s`, counted before the
blocks' loads.

The times come from a measured profile (`BlockProfile`, written into a denoiser's folder as
`template_blocks.json` by `easel profile-template`): each block's time on every token, on a
mask's tokens at several mask ratios (interpolated between them), and the seconds a row of its
recorded output takes to load. A recording already on the device loads in no time; the plan then
still leaves whole the blocks whose masked run is not faster (small token grids, where gathering
the tokens costs more than it saves). Pure and torch-free.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

PROFILE_FILE = "template_blocks.json"


@dataclass(frozen=True)
class BlockCost:
    with_cache_s: float  # the block on its masked tokens, the rest from the recording
    without_cache_s: float  # the block on every token
    load_s: float  # its recorded output brought to the device


@dataclass(frozen=True)
class CachePlan:
    use: tuple[bool, ...]  # per block: take the recording (loaded) or compute whole
    latency_s: float  # when the last block ends
    loaded_s: float  # when the last load ends (before the step's start, below 0, when issued ahead)

    @property
    def used(self) -> int:
        return sum(self.use)


def plan_cache_use(costs: Sequence[BlockCost], lead_s: float = 0.0, fixed_load_s: float = 0.0) -> CachePlan:
    """Algorithm 1: per block, use the cache if that ends the block no later than computing it
    whole; the loads start `lead_s` before the first block, the blocks' after `fixed_load_s` of
    loads every step makes."""
    load, comp = fixed_load_s - lead_s, 0.0
    use = []
    for cost in costs:
        with_cache = max(load + cost.load_s, comp) + cost.with_cache_s
        if with_cache <= comp + cost.without_cache_s:
            load += cost.load_s
            comp = with_cache
            use.append(True)
        else:
            comp += cost.without_cache_s
            use.append(False)
    return CachePlan(tuple(use), comp, load)


@dataclass(frozen=True)
class StreamPlans:
    """A step's blocks that take the recording where it has been loaded (`now`), and those to load
    for streamed rows: for this step when nothing was loaded for it yet (`first`: no lead), and for
    the next step, issued now (`ahead`). None: every block, as a layout without a plan says
    (TokenLayout.cached), so that such steps share the runtimes' plan-free forms (under `compiled`,
    its compiled reusing graphs, runtime/torch_fast.py)."""

    now: frozenset[int] | None
    first: frozenset[int] | None
    ahead: frozenset[int] | None


@dataclass(frozen=True)
class ProfiledBlock:
    index: int  # the block's index among the UNet's transformer blocks (runtime/token_subsets.install)
    without_s: float  # on every token, one row
    with_s: tuple[float, ...]  # on a mask's tokens at each of the profile's ratios, one row
    load_s: float  # one row of its recorded output, host to device


@dataclass(frozen=True)
class BlockProfile:
    """Measured block times at one image size, the blocks in the order a step runs them."""

    size: int
    ratios: tuple[float, ...]
    blocks: tuple[ProfiledBlock, ...]
    # One row of a step's recording outside the transformer blocks (the ResNet blocks' and
    # upsamplers' under conv_subsets), host to device: loaded every step whatever the plan
    fixed_load_s: float = 0.0

    def costs(self, share: float, rows: int, loaded_rows: int = 0) -> list[BlockCost]:
        """The blocks' costs for `rows` reusing rows whose largest share of tokens computed is
        `share`, `loaded_rows` of them with recordings to load (the others' are on the device)."""
        return [BlockCost(rows * _interpolate(self.ratios, b.with_s, share), rows * b.without_s,
                          loaded_rows * b.load_s) for b in self.blocks]

    @functools.lru_cache(maxsize=1024)  # asked at every step of a reusing batch
    def stream_plans(self, share: float, rows: int, loaded_rows: int) -> "StreamPlans":
        """The plans of a step whose `loaded_rows` stream their recordings a step ahead."""
        resident = plan_cache_use(self.costs(share, rows))
        costs = self.costs(share, rows, loaded_rows)
        fixed = loaded_rows * self.fixed_load_s
        # The next step's loads run beside this step, which takes at least its resident plan's time.
        return StreamPlans(self._indices(resident), self._indices(plan_cache_use(costs, fixed_load_s=fixed)),
                           self._indices(plan_cache_use(costs, lead_s=resident.latency_s, fixed_load_s=fixed)))

    def _indices(self, plan: CachePlan) -> frozenset[int] | None:
        """The blocks `plan` takes the recording in; None where it takes it in every one."""
        if all(plan.use):
            return None
        return frozenset(b.index for b, used in zip(self.blocks, plan.use) if used)

    def write(self, folder: str | Path) -> Path:
        path = Path(folder) / PROFILE_FILE
        path.write_text(json.dumps({"size": self.size, "ratios": list(self.ratios), "fixed_load_s": self.fixed_load_s,
                                    "blocks": [{"index": b.index, "without_s": b.without_s, "with_s": list(b.with_s),
                                                "load_s": b.load_s} for b in self.blocks]}, indent=1))
        return path

    @classmethod
    def read(cls, folder: str | Path) -> "BlockProfile | None":
        """The folder's profile, or None where it has none."""
        path = Path(folder) / PROFILE_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        ratios = tuple(float(r) for r in data["ratios"])
        blocks = tuple(ProfiledBlock(int(b["index"]), float(b["without_s"]), tuple(float(t) for t in b["with_s"]),
                                     float(b["load_s"])) for b in data["blocks"])
        if not ratios or list(ratios) != sorted(ratios) or any(len(b.with_s) != len(ratios) for b in blocks):
            raise ValueError(f"{path}: ratios must be sorted and every block timed at each of them")
        return cls(int(data["size"]), ratios, blocks, float(data.get("fixed_load_s", 0.0)))  # (older files: none)


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), held flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]
