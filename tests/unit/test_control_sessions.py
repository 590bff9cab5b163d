"""ControlSessions: a request's ControlNet constants kept between steps, least recently used
evicted first within the byte budget."""

from __future__ import annotations

import torch

from backends.core.adapters.control_sessions import ControlSessions


def tensors(n_bytes_each: int, fill: float):
    return (torch.full((n_bytes_each // 4,), fill),)


def test_sessions_are_kept_as_copies_and_evicted_least_recent_first():
    kept = ControlSessions(budget_bytes=3000)
    given = tensors(1000, 1.0)
    kept.put("a", given)
    given[0].fill_(9.0)  # the caller's buffer is reused: the kept copy does not change
    assert float(kept.get("a")[0][0]) == 1.0
    kept.put("b", tensors(1000, 2.0))
    kept.put("c", tensors(1000, 3.0))
    assert kept.get("a") is not None  # a is now the most recent
    kept.put("d", tensors(1000, 4.0))  # over budget: b, the least recent, goes
    assert kept.get("b") is None and kept.get("c") is not None and kept.get("d") is not None
    assert kept.nbytes == 3000
    assert (kept.stats.hits, kept.stats.misses, kept.stats.evictions) == (4, 1, 1)
    kept.put("d", tensors(2000, 5.0))  # replacing an entry counts its new size once
    assert kept.nbytes <= 3000 and float(kept.get("d")[0][0]) == 5.0


def test_entries_are_bounded_in_number_too():
    kept = ControlSessions(budget_bytes=2**30, max_entries=3)
    for key in "abcd":
        kept.put(key, tensors(4, 1.0))
    assert kept.get("a") is None and all(kept.get(k) is not None for k in "bcd")
