"""bench/micro/template_flops.py's counting, on SDXL's shapes (meta tensors: no weights, no device):
the blocks' FLOPs are a part of the whole, K and V a part of the blocks', and a reusing edit's
ideal speed-up is 1 with every token masked and grows as the mask shrinks, below the bound that
shrinks the convolutions too."""

from __future__ import annotations

import pytest

from bench.micro.template_flops import batch_speedups, count, speedups


def test_a_reusing_edits_ideal_speedup_follows_its_mask():
    flops = count(256)
    blocks = sum(b["flops"] for b in flops["blocks"])
    assert len(flops["blocks"]) == 70 and {b["tokens"] for b in flops["blocks"]} == {64, 256}
    assert 0 < sum(b["kv"] for b in flops["blocks"]) < blocks < flops["total"]
    assert flops["outside"] == pytest.approx(flops["total"] - blocks)
    whole = speedups(flops, 256, 1.0)
    assert whole["speedup"] == pytest.approx(1.0) and whole["speedup_outside_shrunk"] == pytest.approx(1.0)
    small, large = speedups(flops, 256, 0.1), speedups(flops, 256, 0.5)
    assert small["speedup"] > large["speedup"] > 1.0
    assert small["speedup_outside_shrunk"] > small["speedup_convs_shrunk"] > small["speedup_resnets_shrunk"] \
        > small["speedup"]
    assert 0 < flops["upsamplers"] < flops["resnets"] < flops["outside"]


def test_grouping_edits_by_token_share_lowers_a_mixed_batchs_ideal_cost():
    """Eight edits through the step batcher: one step padded to the widest mask costs most, steps
    grouped within 2x of their shares less, every edit at its own mask least."""
    batch = batch_speedups(count(256), draws=5)
    speedup = batch["speedup"]
    assert speedup["packed"] > speedup["2.0"] > speedup["None"] > 1.0
    assert batch["steps_per_round"]["None"] == 1.0 < batch["steps_per_round"]["2.0"]
