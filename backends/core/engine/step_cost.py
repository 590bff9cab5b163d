"""What a denoiser's steps cost in seconds, learned from its own steps: what the routers compare.

Work is counted in row-steps of 1024x1024 pixels (GenerateParams.work). A template edit that
reuses a recording computes only part of its tokens in the transformer blocks
(runtime/token_subsets.py), so its row-steps cost less: a share `dense` of a row-step does not
shrink with the mask (convolutions, norms, the sampler, the step's fixed costs), the rest shrinks
with the share of tokens computed. A step of a batch then takes

    seconds = row_step_s * (dense * units + (1 - dense) * token_units)

where `units` are the batch's row-steps and `token_units` the same weighted by the step's largest
share of tokens computed (a reusing step pads every row to it; 1 for a step of no reusing edit). `row_step_s` is learned from steps
without reusing edits, `dense` from steps with them; both as medians of the last steps, so that
they follow the batch sizes the denoiser actually runs, and a step that waited on something else
(a graph captured, a compile, a merge, a slow ControlNet) is outvoted instead of pricing the
denoiser out of every request for the next hundred steps (a router sends nothing to a denoiser it
prices high, so nothing would correct it). Until a reusing edit has been measured `dense` is 1:
such an edit is priced as a whole one, never as cheaper than measured. `measured_at` is the
monotonic clock of the last step (routers stop trusting a denoiser's costs once they are old:
backends/core/serving/routing.py).

Torch-free: the loop feeds it the step records it has (engine/step_stats.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

# The steps whose median decides: a few odd ones among them move nothing.
WINDOW = 21


@dataclass
class StepCostModel:
    row_step_s: float | None = None  # seconds of one 1024x1024 row-step; None until a step was measured
    dense: float = 1.0  # the share of a row-step that a reusing edit's mask does not shrink
    measured_at: float | None = None  # time.monotonic() of the last step observed
    _rates: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False, compare=False)
    _denses: deque = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False, compare=False)

    def observe(self, units: float, token_units: float, wall_s: float) -> None:
        """A finished step: its row-steps, the same weighted by token share, its wall time."""
        if units <= 0.0 or wall_s <= 0.0:
            return
        self.measured_at = time.monotonic()
        if token_units >= units:  # no reusing edit: the rate
            self._rates.append(wall_s / units)
            self.row_step_s = statistics.median(self._rates)
            return
        if self.row_step_s is None:
            return  # a share needs a rate to be measured against
        # wall / rate = dense * units + (1 - dense) * token_units, solved for dense
        dense = (wall_s / self.row_step_s - token_units) / (units - token_units)
        self._denses.append(min(1.0, max(0.0, dense)))
        self.dense = statistics.median(self._denses)

    @property
    def measured_steps(self) -> int:
        """Steps behind the rate (up to WINDOW): a router trusts a full window, not a first step's
        one-time costs."""
        return len(self._rates)

    def seconds(self, units: float, token_units: float) -> float | None:
        """Predicted seconds of `units` row-steps (`token_units` of them weighted by token share);
        None before any step was measured."""
        if self.row_step_s is None:
            return None
        return self.row_step_s * (self.dense * units + (1.0 - self.dense) * token_units)
