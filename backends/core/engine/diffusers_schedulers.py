"""Sampler names a request may choose, mapped onto diffusers' own scheduler classes.

Every request gets a fresh scheduler instance: diffusers schedulers are stateful (step index,
multistep history), so one per request is what lets requests at different steps share a batch.
"""

from __future__ import annotations

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
