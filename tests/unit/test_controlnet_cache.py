"""The ControlNet cache: LFU with aging within a byte budget, held entries never evicted."""

from __future__ import annotations

import threading
import time

import pytest

from backends.core.adapters.store import AdapterStore
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.runtime.placement import Placement


class FakeLoads:
    """Stands in for the weights only: the cache's policy is what is under test."""

    def __init__(self, delay=0.0):
        self.calls: list[str] = []
        self.delay = delay

    def __call__(self, name):
        self.calls.append(name)
        time.sleep(self.delay)
        if name == "broken":
            raise OSError("truncated safetensors")
        return object(), 100


def cache(tmp_path, budget=300, aging=1000, loads=None):
    return ControlNetCache(AdapterStore(tmp_path), Placement(), budget, aging, loads or FakeLoads())


def use(c, name):
    c.acquire(name)
    c.release(name)


def test_hits_misses_and_lfu_eviction(tmp_path):
    c = cache(tmp_path)
    for name in ["a", "a", "a", "b", "b", "c"]:
        use(c, name)
    assert (c.stats.hits, c.stats.misses) == (3, 3) and set(c.resident) == {"a", "b", "c"}
    use(c, "d")  # full: the least frequently used (c) goes
    assert set(c.resident) == {"a", "b", "d"} and c.stats.evictions == 1


def test_aging_lets_a_formerly_popular_one_go(tmp_path):
    c = cache(tmp_path, budget=200, aging=4)
    for _ in range(8):
        use(c, "old")
    for _ in range(12):  # three aging periods: old's count halves three times (8 -> 1)
        use(c, "new")
    use(c, "third")  # full: old has decayed below new
    assert set(c.resident) == {"new", "third"}


def test_held_entries_are_never_evicted(tmp_path):
    c = cache(tmp_path, budget=200)
    c.acquire("a")
    c.acquire("b")
    c.acquire("c")  # over budget, but a and b are in use
    assert set(c.resident) == {"a", "b", "c"}
    for name in "abc":
        c.release(name)
    use(c, "d")
    assert len(c.resident) == 2 and "d" in c.resident


def test_concurrent_misses_load_once(tmp_path):
    loads = FakeLoads(delay=0.2)
    c = cache(tmp_path, loads=loads)
    threads = [threading.Thread(target=use, args=(c, "a")) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads.calls == ["a"] and c.stats.misses == 1 and c.stats.hits == 3


def test_a_failed_load_fails_that_call_only(tmp_path):
    c = cache(tmp_path)
    with pytest.raises(OSError):
        c.acquire("broken")
    use(c, "a")
    with pytest.raises(OSError):  # not remembered as loaded
        c.acquire("broken")
    assert set(c.resident) == {"a"}


def test_loads_real_controlnets_from_the_store_exactly(tiny_model):
    import torch
    from diffusers import ControlNetModel

    store = AdapterStore(tiny_model / "adapters")
    c = ControlNetCache(store, Placement(), budget_bytes=2**30)
    ours = c.acquire("canny")
    c.release("canny")
    ref = ControlNetModel.from_pretrained(store.controlnet("canny").folder, use_safetensors=True)
    ref_state = ref.state_dict()
    assert ours.state_dict().keys() == ref_state.keys()
    assert all(torch.equal(v, ref_state[k]) for k, v in ours.state_dict().items())
    assert c.resident["canny"] == sum(v.numel() * v.element_size() for v in ref_state.values())
