"""Everything a denoiser is configured with, as one typed config that refuses unknown keys.

Export writes it as JSON into the denoiser's config.pbtxt (parameter `denoiser`); the Triton
adapter reads it back with `DenoiserConfig.from_json` and hands it to the builder. Where the
model runs (device, dtype) and where its files are (artifacts, adapter store) are the
deployment's, read by the adapter like every model's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from backends.core.request.params import Limits
from backends.core.typed_config import strict_from_dict
from backends.core.runtime.config import RuntimeConfig

# sync: step t's residuals come from step t's latents (exact). pipelined: step t uses the
# residuals computed from step t-1's latents, so a ControlNet has a whole UNet step to arrive
# (approximate; the first step waits).
CONTROLNET_MODES = ("sync", "pipelined")


@dataclass(frozen=True)
class DenoiserConfig:
    limits: Limits = field(default_factory=Limits)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    max_running: int = 16  # requests in the running set
    # Requests that may wait beyond the running set; past max_running + max_queue a request is
    # refused at once (UNAVAILABLE) instead of queueing without end: each holds its embeddings,
    # control images and a waiting caller, and its wait would only grow.
    max_queue: int = 48
    max_batch_rows: int = 16  # UNet rows per step
    lora_loaders: int = 2  # LoRA loader processes
    lora_bound_steps: int = 0  # steps a request may run before its LoRAs must be merged (0: exact)
    controlnet_model: str | None = None  # the ControlNet service's Triton model, called by BLS
    controlnet_mode: str = "sync"  # or "pipelined" (step t uses step t-1's residuals; approximate)
    # A guided request's ControlNets called once per row (each call half the work), so that two
    # of the service's instances, on GPUs of their own, share each call's time (exact).
    controlnet_row_split: bool = False
    # The service's instances in all: a request's ControlNet image and embeddings go with its first
    # calls until each instance can have seen them (backends/core/adapters/control_sessions.py).
    controlnet_instances: int = 1
    # Latent parallelism (backends/core/runtime/cfg_parallel.py): the device of the unconditional
    # rows, e.g. "cuda:1"; the denoiser's own runs the rest. "cpu" beside a CPU denoiser runs the
    # same split on a second copy there (tests the wiring; no speed-up). None: one device.
    cfg_parallel_device: str | None = None
    # MiB of templates' recorded activations on the device, in host memory and on disk, in the
    # folder template_cache/ beside the denoiser's weights (engine/template_cache.py).
    template_cache_mib: tuple[int, int, int] = (8192, 0, 0)
    # Reusing template edits share a step only within this ratio of token shares (None: any;
    # engine/step_batcher.BatcherConfig.max_share_ratio)
    edit_share_ratio: float | None = 2.0

    def __post_init__(self):
        if isinstance(self.limits, dict):
            object.__setattr__(self, "limits", strict_from_dict(Limits, self.limits, "denoiser.limits"))
        if isinstance(self.runtime, dict):
            object.__setattr__(self, "runtime", RuntimeConfig.from_dict(self.runtime))
        for name in ("max_running", "max_batch_rows", "lora_loaders", "controlnet_instances"):
            if getattr(self, name) < 1:
                raise ValueError(f"denoiser.{name}: {getattr(self, name)} is not a positive number")
        object.__setattr__(self, "template_cache_mib", tuple(self.template_cache_mib))
        if len(self.template_cache_mib) != 3 or min(self.template_cache_mib) < 0:
            raise ValueError(f"denoiser.template_cache_mib: {self.template_cache_mib} is not three sizes of 0 or more")
        if self.max_queue < 0:
            raise ValueError(f"denoiser.max_queue: {self.max_queue} is negative")
        if self.edit_share_ratio is not None and self.edit_share_ratio < 1:
            raise ValueError(f"denoiser.edit_share_ratio: {self.edit_share_ratio} is below 1")
        if self.lora_bound_steps < 0:
            raise ValueError(f"denoiser.lora_bound_steps: {self.lora_bound_steps} is negative")
        if self.cfg_parallel_device is not None and not (
                self.cfg_parallel_device == "cpu" or self.cfg_parallel_device.startswith("cuda:")):
            raise ValueError(f"denoiser.cfg_parallel_device: {self.cfg_parallel_device!r} is not cpu or cuda:N")
        if self.controlnet_mode not in CONTROLNET_MODES:
            raise ValueError(f"denoiser.controlnet_mode: {self.controlnet_mode!r} is not one of {CONTROLNET_MODES}")

    @classmethod
    def from_json(cls, text: str) -> "DenoiserConfig":
        return strict_from_dict(cls, json.loads(text), "denoiser")

    def to_json(self) -> str:
        data: dict[str, Any] = asdict(self)
        return json.dumps(data, sort_keys=True)
