"""Which transformer blocks of a step take a template's recording, when recordings are loaded
block by block beside the compute (InstGenIE's Algorithm 1).

Blocks run in order; block i's recorded output must be loaded (a copy on a load stream that runs
beside the compute) before block i can use it. Using it costs `with_cache_s` (only the masked
tokens computed) instead of `without_cache_s` (every token), but the block cannot start before
its load ends, and loads run one after another. Greedily, block by block: take the cache where
finishing the block with it (after the later of its load's end and the previous block's end) is
no later than finishing it whole; else compute it whole and load nothing for it. The compute
never waits longer than computing whole would have taken, so loading adds no bubble.

Pure and torch-free: the times come from measurements (bench/micro/template_blocks.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class BlockCost:
    with_cache_s: float  # the block on its masked tokens, the rest from the recording
    without_cache_s: float  # the block on every token
    load_s: float  # its recorded output brought to the device


@dataclass(frozen=True)
class CachePlan:
    use: tuple[bool, ...]  # per block: take the recording (loaded) or compute whole
    latency_s: float  # when the last block ends
    loaded_s: float  # when the last load ends

    @property
    def used(self) -> int:
        return sum(self.use)


def plan_cache_use(costs: Sequence[BlockCost]) -> CachePlan:
    """Algorithm 1: per block, use the cache if that ends the block no later than computing it whole."""
    load = comp = 0.0
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
