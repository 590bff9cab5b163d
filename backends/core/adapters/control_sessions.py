"""A request's ControlNet constants, kept on the ControlNet service's device between its steps.

A request's control image, text embeddings and time ids do not change from step to step: the
denoiser sends them with the first call of a session (one ControlNet of one request) and after
that only the sample and timestep (at 1024 px with guidance: 0.3 MB a call instead of 13 MB).
The service keeps the image's embedding by the ControlNet (adapters/controlnet.py, KeptEmbedding)
rather than the image, so that its convolutions run once per session, not at every step.
Each service instance keeps the sessions it has seen, least recently used evicted first within
a byte budget; a call naming a session the instance does not hold (another instance took the
first call, or it was evicted) fails with NOT_FOUND on the `session` field and the denoiser
sends it again with the constants (backends/triton/bls_controlnets.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

CONSTANTS = ("image", "prompt_embeds", "pooled_embeds", "time_ids")
# Entries an instance keeps at most, whatever their size (the service is reachable by clients:
# Triton cannot hide internal models), and the longest key it takes.
MAX_ENTRIES = 4096
MAX_KEY_CHARS = 256


@dataclass
class SessionStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class ControlSessions:
    def __init__(self, budget_bytes: int, max_entries: int = MAX_ENTRIES):
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.stats = SessionStats()
        self._entries: OrderedDict[str, tuple[tuple[torch.Tensor, ...], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, tensors: tuple[torch.Tensor, ...]) -> None:
        """Keep copies of `tensors` (the caller's buffers go back to Triton after the call)."""
        kept = tuple(t.clone() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in kept)
        with self._lock:
            self._drop(key)
            while self._entries and (self._bytes + nbytes > self.budget_bytes or len(self._entries) >= self.max_entries):
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1
            self._entries[key] = (kept, nbytes)
            self._bytes += nbytes

    def get(self, key: str) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return entry[0]

    @property
    def nbytes(self) -> int:
        with self._lock:
            return self._bytes

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry[1]
