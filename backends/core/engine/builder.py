"""Builds a denoiser from its typed config: runtime, engine, LoRA loaders, step loop.

The Triton adapter (backends/easel_denoiser/model.py) only turns Triton tensors into jobs and
results into responses; everything it runs is built here, so the same wiring is tested on CPU.
Shutdown runs in a fixed order: loaders (no new LoRAs), the loop (fails what is left), the
ControlNet provider.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from backends.core.adapters.lora import BOUNDS_FILE
from backends.core.adapters.lora_loader import LoraLoaderPool
from backends.core.adapters.store import AdapterStore
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.loop import DenoiseLoop, DenoiseResult
from backends.core.engine.step_batcher import BatcherConfig
from backends.core.engine.template_cache import TemplateCache
from backends.core.request.params import GenerateParams, InvalidInput
from backends.core.runtime.artifacts import UNET_DIR, load_unet_halves
from backends.core.runtime.base import StepBatch, UNetRuntime
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.serving.load_board import Load
from backends.core.runtime.specs import unet_pooled_dim
from backends.core.runtime.torch_eager import EagerUNetRuntime

TEMPLATE_FOLDER = "template_cache"  # beside the denoiser's weights: templates' recordings on disk
log = logging.getLogger(__name__)
LOADER_START_TIMEOUT_S = 300


@dataclass
class Denoiser:
    """A built denoiser: what the Triton adapter drives."""

    config: DenoiserConfig
    engine: TorchDenoiser
    loop: DenoiseLoop
    store: AdapterStore | None
    lora_loader: LoraLoaderPool | None
    lora_bounds: dict[str, int] = field(default_factory=dict)  # per LoRA, from `easel profile-lora`
    warmup_s: float = 0.0  # graphs captured (and compiled) at load

    def lora_bound(self, params: GenerateParams) -> int:
        """Steps the request may run before its LoRAs must be merged: the smallest of its LoRAs'."""
        return min(self.lora_bounds.get(p.name, self.config.lora_bound_steps) for p in params.loras)

    def load_loras(self, params: GenerateParams, on_loaded: Callable | None = None) -> Future:
        """A future of ((LoraWeights, scale), ...); errors travel in it, so they fail this request
        at a step boundary like a load error does. Never blocks: the store's index is in memory."""
        try:
            if self.store is None:
                raise InvalidInput("loras", "this deployment has no adapter store")
            files = [(p.name, self.store.lora(p.name).file, p.scale) for p in params.loras]
        except InvalidInput as exc:
            failed = Future()
            failed.set_exception(exc)
            return failed
        return self.lora_loader.submit(files, on_loaded=on_loaded)

    def adapter_versions(self, params: GenerateParams) -> tuple:
        """The request's LoRA and ControlNet files as they are now (StoreFile.stamp: inode, mtime,
        size), for a template's key; unknown names are refused (UnknownAdapter naming the field)."""
        if self.store is None or not (params.loras or params.controls):
            return ()
        files = [self.store.lora(p.name).file for p in params.loras]
        files += [self.store.controlnet(c.name).weights_file for c in params.controls]
        return tuple(f.stamp() if f is not None else None for f in files)

    def shutdown(self) -> None:
        if self.lora_loader is not None:
            self.lora_loader.shutdown()
        self.loop.shutdown()
        self.engine.templates.close()  # after the loop: nothing waits for a load any more
        if self.engine.controls.provider is not None:
            self.engine.controls.provider.shutdown()


def build_runtime(folder: Path, placement: Placement, config: RuntimeConfig,
                  cfg_parallel_device: str | None = None) -> UNetRuntime:
    """The configured runtime over the folder's halves; with `cfg_parallel_device`, one on each
    device of the pair, the second over its own copy of the weights (runtime/cfg_parallel.py)."""
    if cfg_parallel_device is None:
        return _runtime(folder, placement, config)
    from backends.core.runtime.cfg_parallel import CfgParallelRuntime

    if cfg_parallel_device == placement.device and placement.device != "cpu":
        raise ValueError(f"cfg_parallel_device: {cfg_parallel_device} is the denoiser's own device; "
                         "latent parallelism needs another GPU")
    if (cfg_parallel_device == "cpu") != (placement.device == "cpu"):
        raise ValueError(f"cfg_parallel_device: {cfg_parallel_device} beside a denoiser on {placement.device}: "
                         "both halves run on GPUs, or both on the CPU")
    other = Placement(cfg_parallel_device, placement.dtype)
    primary = _runtime(folder, placement, config)
    if other.device.startswith("cuda"):
        import torch

        with torch.cuda.device(torch.device(other.device)):  # graph pools and compiles follow it
            secondary = _runtime(folder, other, config)
    else:
        secondary = _runtime(folder, other, config)
    return CfgParallelRuntime(primary, secondary, other.device)


def _runtime(folder: Path, placement: Placement, config: RuntimeConfig) -> UNetRuntime:
    eager = EagerUNetRuntime(*load_unet_halves(folder, placement), conv_subsets=config.conv_subsets)
    if config.kind == "eager":
        return eager
    from backends.core.runtime.fp8 import CALIBRATION_FILE
    from backends.core.runtime.torch_fast import FastUNetRuntime

    return FastUNetRuntime(eager, config, cache_root=folder, fp8_calibration=folder / UNET_DIR / CALIBRATION_FILE)


def build_denoiser(config: DenoiserConfig, folder: str | Path, placement: Placement,
                   on_done: Callable[[DenoiseResult], None], store_folder: Path | None = None,
                   controlnets: Callable[[TorchDenoiser, AdapterStore | None], object] | None = None,
                   publish_load: Callable[[Load], None] | None = None) -> Denoiser:
    """`controlnets(engine, store)` makes the ControlNet provider (the adapter's BLS client), if any;
    `publish_load(load)` is told the loop's outstanding work whenever it changes (routing)."""
    folder = Path(folder)
    runtime = build_runtime(folder, placement, config.runtime, config.cfg_parallel_device)
    device_mib, host_mib, disk_mib = config.template_cache_mib
    templates = TemplateCache(placement.device, device_mib << 20, host_mib << 20, disk_mib << 20,
                              folder / TEMPLATE_FOLDER)
    engine = TorchDenoiser(folder, placement, controlnet_mode=config.controlnet_mode, runtime=runtime,
                           controlnet_row_split=config.controlnet_row_split, templates=templates)
    store = AdapterStore(store_folder) if store_folder else None
    if controlnets is not None and config.controlnet_model:
        engine.controls.provider = controlnets(engine, store)
    warmup_s = warm_up(engine, config.runtime)
    # LoRA files load in separate processes (diffusers' conversion never holds this process's
    # GIL; a loader that crashes fails its request only): backends/core/adapters/lora_loader.py.
    loader = LoraLoaderPool(config.lora_loaders, device=placement.device) if store else None
    if loader is not None and not loader.wait_started(timeout=LOADER_START_TIMEOUT_S):
        log.warning("LoRA loader processes did not start; LoRA requests will fail until they do")
    bounds_file = folder / BOUNDS_FILE
    bounds = json.loads(bounds_file.read_text()) if bounds_file.exists() else {}
    loop = DenoiseLoop(engine, on_done, BatcherConfig(max_running=config.max_running,
                                                        max_batch_rows=config.max_batch_rows,
                                                        max_share_ratio=config.edit_share_ratio), publish_load)
    return Denoiser(config, engine, loop, store, loader, bounds, warmup_s)


def warm_up(engine: TorchDenoiser, config: RuntimeConfig) -> float:
    """Capture (and compile) the configured buckets before the denoiser says ready."""
    warmup = getattr(engine.runtime, "warmup", None)
    if warmup is None or not config.warmup_sizes:
        return 0.0
    with engine.on_stream():
        seconds = warmup(template_batch(engine.unet, engine.device, engine.dtype), config.warmup_sizes,
                         with_residuals=config.warmup_residuals and engine.controls.provider is not None)
    log.info("runtime %s: warmed up %s x rows %s in %.1f s", config.kind, list(config.warmup_sizes),
             list(config.row_buckets), seconds)
    return seconds


def template_batch(unet, device, dtype, tokens: int = 77) -> StepBatch:
    """One row of UNet inputs of the right dims (values do not matter: warm-up only)."""
    import torch

    cfg = unet.config
    pooled = unet_pooled_dim(cfg)
    kw = dict(device=device, dtype=dtype)
    return StepBatch(sample=torch.zeros(1, cfg.in_channels, 8, 8, **kw),
                     timestep=torch.full((1,), 500.0, device=device),
                     text=torch.zeros(1, tokens, cfg.cross_attention_dim, **kw), pooled=torch.zeros(1, pooled, **kw),
                     time_ids=torch.tensor([[1024.0, 1024.0, 0, 0, 1024.0, 1024.0]], **kw))
