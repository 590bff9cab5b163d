"""backends/core/engine/step_cost.py: a denoiser learns what its row-steps cost, and what share of
them a reusing edit's mask does not shrink, from its own steps (fake step times here)."""

from __future__ import annotations

import time

import pytest

from backends.core.engine.step_cost import StepCostModel


def test_nothing_is_predicted_before_a_step_was_measured():
    model = StepCostModel()
    assert model.seconds(10.0, 10.0) is None
    model.observe(4.0, 1.0, 1.0)  # an edit's step before any rate: nothing to measure it against
    assert model.row_step_s is None and model.dense == 1.0


def test_the_rate_and_the_dense_share_converge_to_the_steps_that_taught_them():
    rate, dense = 0.016, 0.35
    model = StepCostModel()
    for units in (2.0, 4.0, 8.0) * 40:  # whole rows only
        model.observe(units, units, rate * units)
    assert model.row_step_s == pytest.approx(rate)
    assert model.seconds(3.0, 1.0) == pytest.approx(rate * 3.0)  # no edit measured yet: priced whole
    for share in (0.1, 0.2, 0.5) * 60:  # batches of 2 whole rows and 2 reusing rows of that share
        units, token_units = 4.0, 2.0 + 2.0 * share
        model.observe(units, token_units, rate * (dense * units + (1 - dense) * token_units))
    assert model.dense == pytest.approx(dense, abs=1e-3)
    assert model.seconds(2.0, 0.4) == pytest.approx(rate * (dense * 2.0 + (1 - dense) * 0.4), rel=1e-3)


def test_a_share_outside_zero_and_one_is_clamped():
    model = StepCostModel(row_step_s=0.01)
    for _ in range(200):
        model.observe(2.0, 1.0, 0.05)  # slower than whole rows: the mask saved nothing
    assert model.dense == pytest.approx(1.0, abs=1e-3)


def test_a_step_that_waited_on_something_else_moves_nothing():
    """A first step that captured graphs, or one that waited a minute on a load, among ordinary
    steps: the rate stays the ordinary steps' (a moving average would price this denoiser 100x
    too high for the next many steps, and a router would send it nothing to learn from)."""
    rate = 0.02
    model = StepCostModel()
    model.observe(1.0, 1.0, 60.0)  # the first step, with a minute of capture
    for _ in range(2):
        model.observe(1.0, 1.0, rate)
    assert model.row_step_s == pytest.approx(rate)
    for step in range(100):
        model.observe(2.0, 2.0, 2 * rate if step % 10 else 120.0)  # one step in ten waits
    assert model.row_step_s == pytest.approx(rate)


def test_a_step_stamps_when_the_costs_were_measured():
    model = StepCostModel()
    assert model.measured_at is None
    before = time.monotonic()
    model.observe(1.0, 1.0, 0.02)
    assert before <= model.measured_at <= time.monotonic() and model.measured_steps == 1
