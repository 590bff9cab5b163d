"""The ControlNet service's resident set: the most used ControlNets kept on the device, within a
memory budget, loaded from the adapter store on a miss.

Policy: LFU with aging. Popularity is heavily skewed (the top 5-8 of ~150 take 95-98% of uses)
and changes slowly, so frequency predicts the next use better than recency (LRU would let one
burst of rare ControlNets flush the popular ones). Plain LFU never forgets, so counts are halved
every `aging_period` uses: a ControlNet that stopped being popular decays out within a few
periods. A ControlNet that a running step holds (`acquire` without `release`) is never evicted;
if every resident one is held, the budget is exceeded rather than failing a request.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from backends.core.adapters.store import AdapterStore
from backends.core.request.params import InvalidInput, no_paths, shorten
from backends.core.runtime.placement import Placement

log = logging.getLogger(__name__)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    load_seconds: float = 0.0
    loaded_bytes: int = 0


@dataclass
class _Resident:
    model: Any
    nbytes: int
    holders: int = 0


@dataclass
class ControlNetCache:
    store: AdapterStore
    placement: Placement
    budget_bytes: int
    aging_period: int = 256
    loader: Callable[[str], tuple[Any, int]] | None = None  # name -> (model, bytes); default: from the store
    # On a GPU, the rewrites the UNet's fast runtimes make (channels_last, packed attention
    # projections: runtime/packed_attention.py): exact, the same residuals from fewer, fuller kernels.
    fast: bool = False
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self):
        self._resident: dict[str, _Resident] = {}
        self._counts: dict[str, float] = {}
        self._uses = 0
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Event] = {}

    @property
    def resident(self) -> dict[str, int]:
        with self._lock:
            return {name: r.nbytes for name, r in self._resident.items()}

    def acquire(self, name: str):
        """The model for `name`, resident and held until `release(name)`."""
        with self._lock:
            self._count_use(name)
            while True:
                entry = self._resident.get(name)
                if entry is not None:
                    entry.holders += 1
                    self.stats.hits += 1
                    return entry.model
                pending = self._loading.get(name)
                if pending is None:
                    self._loading[name] = threading.Event()
                    self.stats.misses += 1
                    break
                self._lock.release()  # another thread loads it: wait, then look again
                try:
                    pending.wait()
                finally:
                    self._lock.acquire()
        try:
            start = time.perf_counter()
            model, nbytes = (self.loader or self._load)(name)
            seconds = time.perf_counter() - start
        except BaseException:
            with self._lock:
                self._loading.pop(name).set()
            raise
        with self._lock:
            self.stats.load_seconds += seconds
            self.stats.loaded_bytes += nbytes
            self._make_room(nbytes, keep=name)
            self._resident[name] = _Resident(model, nbytes, holders=1)
            self._loading.pop(name).set()
        log.info("loaded ControlNet %s (%.1f MiB) in %.2fs", name, nbytes / 2**20, seconds)
        return model

    def release(self, name: str) -> None:
        with self._lock:
            self._resident[name].holders -= 1

    def _count_use(self, name: str) -> None:
        self._uses += 1
        if self._uses % self.aging_period == 0:
            self._counts = {n: c / 2 for n, c in self._counts.items() if c / 2 >= 0.5 or n in self._resident}
        self._counts[name] = self._counts.get(name, 0.0) + 1.0

    def _make_room(self, nbytes: int, keep: str) -> None:
        used = sum(r.nbytes for r in self._resident.values())
        candidates = sorted((n for n, r in self._resident.items() if r.holders == 0 and n != keep),
                            key=lambda n: self._counts.get(n, 0.0))
        while used + nbytes > self.budget_bytes and candidates:
            victim = candidates.pop(0)
            used -= self._resident.pop(victim).nbytes
            self.stats.evictions += 1
            log.info("evicted ControlNet %s", victim)
        if used + nbytes > self.budget_bytes:
            log.warning("ControlNet budget exceeded (%d + %d > %d bytes): all resident ones are in use",
                        used, nbytes, self.budget_bytes)

    def _load(self, name: str):
        """Weights memory-mapped from safetensors, staged through pinned host memory to the device,
        into a ControlNet built on the meta device (no random init of ~1.2B parameters)."""
        import torch
        from diffusers import ControlNetModel
        from safetensors.torch import load_file

        from backends.core.adapters.controlnet import keep_embedding  # (that module imports this one)

        entry = self.store.controlnet(name)
        # Both files read from descriptors opened without following symlinks (store.StoreFile),
        # never by their paths: the store may have changed since it was scanned.
        data = entry.config_file.read_bytes()
        try:
            config = json.loads(data)
        except ValueError:
            raise InvalidInput("controlnets", f"ControlNet {name!r} has a config that is not JSON") from None
        try:
            with torch.device("meta"):
                model = ControlNetModel.from_config(config)
            with entry.weights_file.path() as path:
                state = load_file(path)  # memory-mapped (the mapping outlives the descriptor)
        except Exception as exc:  # a config or weights that are not a ControlNet's: the store's, as for LoRAs
            raise InvalidInput("controlnets", f"ControlNet {name!r} cannot be read ({exc.__class__.__name__}: "
                                              f"{shorten(no_paths(str(exc)))})") from None
        device, dtype = torch.device(self.placement.device), self.placement.torch_dtype
        if device.type == "cuda":
            state = {k: v.to(dtype).pin_memory().to(device, non_blocking=True) for k, v in state.items()}
            torch.cuda.synchronize(device)
        else:
            state = {k: v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        keep_embedding(model)
        if self.fast and device.type == "cuda":
            from backends.core.runtime.packed_attention import pack_attention

            model.to(memory_format=torch.channels_last)
            pack_attention(model)  # (after any .to(): the packed weights are views that a move would copy apart)
        return model.eval(), sum(v.numel() * v.element_size() for v in state.values())
