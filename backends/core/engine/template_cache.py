"""Templates' recorded activations, kept for the edits that reuse them (runtime/token_subsets.py).

A recording belongs to a key: the template's name and everything that changes what its blocks
output besides the edit's own masked tokens (engine/workflows/inpaint.py, `template_key`). The
first edit of a key records; once it has run all its steps, later edits of the key reuse it.
An edit that finds a recording still being made records one of its own (the first may have been
cancelled), which replaces it. Least recently used recordings go first past `budget_bytes`; one in
use by a running edit stays with that edit until it ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from backends.core.runtime.token_subsets import TemplateActivations

DEFAULT_BUDGET_BYTES = 8 << 30


class TemplateCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES):
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple, TemplateActivations] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def take(self, key: tuple, rows: int) -> tuple[bool, TemplateActivations]:
        """(True, the recording) for an edit that reuses one, or (False, a new one to fill)."""
        with self._lock:
            kept = self._entries.get(key)
            if kept is not None and kept.complete:
                self._entries.move_to_end(key)
                self.hits += 1
                return True, kept
            self.misses += 1
            fresh = self._entries[key] = TemplateActivations(rows)
            self._entries.move_to_end(key)
            return False, fresh

    def completed(self, recording: TemplateActivations) -> None:
        """Its edit ran every step: later edits may reuse it. Over the budget, the least recently
        used others go."""
        with self._lock:
            recording.complete = True
            total = sum(r.nbytes for r in self._entries.values())
            for key in list(self._entries):
                if total <= self.budget_bytes:
                    break
                if self._entries[key] is not recording:
                    total -= self._entries.pop(key).nbytes
                    self.evictions += 1

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(r.nbytes for r in self._entries.values())
