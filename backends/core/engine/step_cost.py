"""What a denoiser's steps cost in seconds, learned from its own steps: what the routers compare.

Work is counted in row-steps of 1024x1024 pixels (GenerateParams.work). A step costs a fixed part
(launches, the sampler, the loop's own work, a ControlNet call's hand-off: what a 64 px step is
made of on a CPU) and a part that grows with its row-steps. A template edit that reuses a
recording computes only part of its tokens in the transformer blocks (runtime/token_subsets.py),
so its row-steps cost less: a share `dense` of a row-step does not shrink with the mask
(convolutions, norms), the rest shrinks with the share of tokens computed. A step of a batch then
takes

    seconds = step_s + row_step_s * (dense * units + (1 - dense) * token_units)

where `units` are the batch's row-steps and `token_units` the same weighted by each row's share of
tokens computed (1 for every row that is not a reusing edit). `step_s` and `row_step_s` are a
robust line (Theil-Sen: the median of the slopes between pairs of points, then the median
intercept) through the steps without reusing edits, one point per size (row-steps within a factor
of 2), each the median of that size's last steps: so a run of steps of one size does not erase what
the others taught. A rate alone (no fixed part) priced a denoiser that last ran small steps as if
each row-step of a large one cost what its small ones did per pixel: 100x too high for a 64 px
request on a CPU, which then went to a busy denoiser instead of an idle one. Medians, so that a
step that waited on something else (a graph captured, a compile, a merge, a slow ControlNet) is
outvoted instead of pricing the denoiser out of every request for the next hundred steps (a router
sends nothing to a denoiser it prices high, so nothing would correct it); a size counts once it has
MIN_STEPS steps. Until two sizes count, all of a step's time is priced as growing with its
row-steps (the median rate of the last steps); until a reusing edit has been measured `dense` is
1: such an edit is priced as a whole one, never as cheaper than measured.

Torch-free: the loop feeds it the step records it has (engine/step_stats.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

# The steps whose median decides: a few odd ones among them move nothing.
WINDOW = 21
# Per size: its last steps, and how many it needs to count in the line (one odd step among them
# moves its median nowhere).
SIZE_WINDOW, MIN_STEPS = 9, 3


@dataclass
class StepCostModel:
    row_step_s: float | None = None  # seconds of one 1024x1024 row-step; None until a step was measured
    dense: float = 1.0  # the share of a row-step that a reusing edit's mask does not shrink
    step_s: float = 0.0  # seconds of a step whatever its size
    _rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False, compare=False)
    _sizes: dict = field(default_factory=dict, repr=False, compare=False)  # log2 of row-steps -> (units, wall)
    _denses: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False, compare=False)

    def observe(self, units: float, token_units: float, wall_s: float) -> None:
        """A finished step: its row-steps, the same weighted by token share, its wall time."""
        if units <= 0.0 or wall_s <= 0.0:
            return
        if token_units >= units:  # no reusing edit: the line
            self._rates.append(wall_s / units)
            self._sizes.setdefault(round(math.log2(units)), deque(maxlen=SIZE_WINDOW)).append((units, wall_s))
            points = [(statistics.median(u for u, _ in steps), statistics.median(w for _, w in steps))
                      for steps in self._sizes.values() if len(steps) >= MIN_STEPS]
            line = fit_line(points) if len(points) >= 2 else None
            self.step_s, self.row_step_s = line or (0.0, statistics.median(self._rates))
            return
        if self.row_step_s is None:
            return  # a share needs a rate to be measured against
        # (wall - step_s) / rate = dense * units + (1 - dense) * token_units, solved for dense
        dense = ((wall_s - self.step_s) / self.row_step_s - token_units) / (units - token_units)
        self._denses.append(min(1.0, max(0.0, dense)))
        self.dense = statistics.median(self._denses)

    def seconds(self, units: float, token_units: float, steps: float = 0.0) -> float | None:
        """Predicted seconds of `steps` steps that do `units` row-steps together (`token_units` of
        them weighted by token share); None before any step was measured."""
        if self.row_step_s is None:
            return None
        return self.step_s * steps + self.row_step_s * (self.dense * units + (1.0 - self.dense) * token_units)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """(intercept, slope) of seconds against row-steps through points of different sizes
    (Theil-Sen, over pairs of sizes at least 1.25x apart); None where no pair is, or the line
    falls below the origin (noise: no fixed part to tell)."""
    slopes = [(w2 - w1) / (u2 - u1) for i, (u1, w1) in enumerate(points) for u2, w2 in points[i + 1:]
              if max(u1, u2) >= 1.25 * min(u1, u2)]
    if not slopes:
        return None
    # Steps that took no longer for more work: all fixed, but a rate must stay positive.
    slope = max(1e-9, statistics.median(slopes))
    intercept = statistics.median(w - slope * u for u, w in points)
    return (intercept, slope) if intercept >= 0.0 else None
