"""backends/core/runtime/cache_plan.py: InstGenIE's Algorithm 1, with step times worked by hand."""

from __future__ import annotations

import itertools

import pytest

from backends.core.runtime.cache_plan import PROFILE_FILE, BlockCost, BlockProfile, ProfiledBlock, plan_cache_use


def test_free_loads_take_every_block_from_the_cache():
    plan = plan_cache_use([BlockCost(1.0, 4.0, 0.0)] * 3)
    assert plan.use == (True, True, True) and plan.latency_s == 3.0 and plan.loaded_s == 0.0


def test_loads_slower_than_the_saving_are_not_taken():
    plan = plan_cache_use([BlockCost(1.0, 2.0, 10.0)] * 3)  # (a load of 5 would hide behind blocks 0-1)
    assert plan.use == (False, False, False) and plan.latency_s == 6.0 and plan.loaded_s == 0.0


def test_a_slow_load_is_hidden_behind_blocks_computed_whole():
    """Block 0: loading it (3) then computing with it (1) ends at 4, whole at 2: whole. Block 1:
    its load starts at 0 beside block 0 and ends at 3, the block at 4; whole it would end at 4: cache.
    Block 2: its load ends at 6, the block at 7; whole it ends at 6: whole."""
    plan = plan_cache_use([BlockCost(1.0, 2.0, 3.0), BlockCost(1.0, 2.0, 3.0), BlockCost(1.0, 2.0, 3.0)])
    assert plan.use == (False, True, False)
    assert plan.latency_s == pytest.approx(6.0) and plan.loaded_s == pytest.approx(3.0)


def test_the_plan_is_never_slower_than_computing_every_block_whole():
    costs = [BlockCost(w, wo, ld) for w, wo, ld in itertools.product((0.2, 1.0), (1.0, 3.0), (0.0, 0.5, 2.0, 6.0))]
    for window in range(len(costs) - 4):
        blocks = costs[window:window + 5]
        assert plan_cache_use(blocks).latency_s <= sum(c.without_cache_s for c in blocks) + 1e-12


def test_a_profile_prices_rows_interpolates_ratios_and_round_trips(tmp_path):
    profile = BlockProfile(1024, (0.1, 0.5), (ProfiledBlock(7, 2.0, (0.5, 1.5), 1.0),
                                              ProfiledBlock(3, 1.0, (2.0, 2.0), 0.0)), fixed_load_s=0.25)
    (first, second) = profile.costs(0.3, rows=2, loaded_rows=2)
    assert first == BlockCost(2 * 1.0, 2 * 2.0, 2 * 1.0)  # halfway between 0.5 and 1.5, per row
    assert profile.costs(0.05, 1)[0] == BlockCost(0.5, 2.0, 0.0)  # below the first ratio: held flat
    assert second.with_cache_s > second.without_cache_s
    assert profile.stream_plans(0.3, rows=2, loaded_rows=0).now == frozenset({7})  # block 3's masked run is slower
    profile.write(tmp_path)
    assert BlockProfile.read(tmp_path) == profile and BlockProfile.read(tmp_path / "none") is None
    (tmp_path / PROFILE_FILE).write_text('{"size": 64, "ratios": [0.5, 0.1], "blocks": []}')
    with pytest.raises(ValueError, match="ratios must be sorted"):
        BlockProfile.read(tmp_path)


def test_loads_issued_a_step_ahead_hide_behind_that_step():
    """The blocks of test_a_slow_load_is_hidden_behind_blocks_computed_whole with their loads
    started 4 s early (behind the previous step): block 0's load ends at -1 and block 1's at 2,
    both take the cache (ending at 1 and 3); block 2's would end at 5 and the block at 6, whole at 5."""
    costs = [BlockCost(1.0, 2.0, 3.0)] * 3
    plan = plan_cache_use(costs, lead_s=4.0)
    assert plan.use == (True, True, False) and plan.latency_s == pytest.approx(5.0)
    assert plan.loaded_s == pytest.approx(2.0)
    assert plan_cache_use(costs, lead_s=100.0).use == (True, True, True)  # loads long done: as on the device


def test_stream_plans_load_what_the_previous_step_hides():
    """Three blocks of 2 s whole and 1 s on a mask's tokens: from the device every block takes the
    recording (3 s a step). With 1.5 s to load a row, loaded within the step (`first`) block 0
    would wait for its load longer than it computes whole, so blocks 1 and 2 only; loaded behind
    the previous step's 3 s (`ahead`), every block. With 5 s loads, `first` takes block 2 only
    (its load ends at 5, as block 1 whole does) and `ahead` block 1 only (its load ends at 2, as
    block 0 whole does; block 2's would end at 7)."""
    def plans(load_s, loaded_rows=1):
        profile = BlockProfile(64, (0.2,), tuple(ProfiledBlock(i, 2.0, (1.0,), load_s) for i in range(3)))
        got = profile.stream_plans(0.2, rows=1, loaded_rows=loaded_rows)
        return tuple(None if blocks is None else sorted(blocks) for blocks in (got.now, got.first, got.ahead))

    # (None: every block, the form a step without a plan has: TokenLayout.cached)
    assert plans(1.5) == (None, [1, 2], None)
    assert plans(5.0) == (None, [2], [1])
    assert plans(5.0, loaded_rows=0) == (None,) * 3  # on the device: nothing to load


def test_loads_outside_the_blocks_come_first():
    """The profile of test_stream_plans_load_what_the_previous_step_hides with 1.5 s loads, and 1 s
    a row of loads outside the transformer blocks (the ResNet blocks' recordings) every step:
    loaded within the step, block 1's load now ends at 2.5 and the block at 3.5, whole at 4: cache;
    block 2's ends at 4, the block at 5, whole at 5.5: cache (block 0: whole, as before). Ahead of
    the step (3 s of lead), block 2's load ends at 2.5 and every block still takes the recording.
    With 3 s of such loads a row: within the step block 2 only (its load ends at 4.5, the block at
    5.5, whole at 6); ahead, not block 0 (its load ends at 1.5, the block at 2.5, whole at 2)."""
    def plans(fixed_s):
        profile = BlockProfile(64, (0.2,), tuple(ProfiledBlock(i, 2.0, (1.0,), 1.5) for i in range(3)), fixed_s)
        got = profile.stream_plans(0.2, rows=1, loaded_rows=1)
        return tuple(None if blocks is None else sorted(blocks) for blocks in (got.now, got.first, got.ahead))

    assert plans(1.0) == (None, [1, 2], None)
    assert plans(3.0) == (None, [2], [1, 2])
    assert plan_cache_use([BlockCost(1.0, 2.0, 0.0)] * 2, fixed_load_s=5.0).use == (False, False)
