"""Sampler names a request may choose, mapped onto diffusers' own scheduler classes.

Every request gets a fresh scheduler instance: diffusers schedulers are stateful (step index,
multistep history), so one per request is what lets requests at different steps share a batch.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
)
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from backends.core.request.params import SCHEDULER_NAMES

DEFAULT = "default"  # the model folder's own scheduler, as saved in scheduler/scheduler_config.json

_FACTORIES: dict[str, Callable[[dict[str, Any]], SchedulerMixin]] = {
    "euler": lambda cfg: EulerDiscreteScheduler.from_config(cfg),
    "euler_a": lambda cfg: EulerAncestralDiscreteScheduler.from_config(cfg),
    "dpmpp_2m_karras": lambda cfg: DPMSolverMultistepScheduler.from_config(
        cfg, algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=True),
    "ddim": lambda cfg: DDIMScheduler.from_config(cfg),
}
assert SCHEDULER_NAMES == (DEFAULT, *_FACTORIES), "params.SCHEDULER_NAMES and the factories disagree"


def make_scheduler(name: str, base: SchedulerMixin) -> SchedulerMixin:
    """A new scheduler called `name`, configured from the model's own scheduler `base`."""
    if name == DEFAULT:
        return type(base).from_config(base.config)
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"scheduler: unknown name {name!r}; allowed: {', '.join(SCHEDULER_NAMES)}") from None
    return factory(base.config)


class SchedulerPrototypes:
    """A prototype scheduler per (name, steps) whose timesteps are already set: the same state as
    a scheduler built from the config and set up. `shared` lends the prototype itself, for a
    request that only reads it (a vectorized sampler's tables, timesteps, initial sigma);
    `fresh` a deep copy, for one that diffusers steps (which changes its state).

    Why: building one (diffusers' config machinery inspects signatures) and setting its timesteps
    took 0.8 ms on the dev CPU and several ms on the H200 host (py-spy), on the denoise loop's
    thread, where every running request waits for it; a copy still took 0.7 ms on the H200 host
    (`bench/micro/admission_micro.py`).
    """

    def __init__(self, base: SchedulerMixin, device, size: int = 32):
        self.base, self.device, self.size = base, device, size
        self._prototypes: OrderedDict[tuple[str, int], SchedulerMixin] = OrderedDict()

    def fresh(self, name: str, steps: int) -> SchedulerMixin:
        return copy.deepcopy(self.shared(name, steps))

    def shared(self, name: str, steps: int) -> SchedulerMixin:
        """The prototype itself: never to be stepped or changed."""
        key = (name, steps)
        prototype = self._prototypes.get(key)
        if prototype is None:
            prototype = make_scheduler(name, self.base)
            prototype.set_timesteps(steps, device=self.device)
            if hasattr(prototype, "set_begin_index"):
                prototype.set_begin_index(0)
            self._prototypes[key] = prototype
            if len(self._prototypes) > self.size:
                self._prototypes.popitem(last=False)
        else:
            self._prototypes.move_to_end(key)
        return prototype
