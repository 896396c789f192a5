"""What a request costs by its padded shape (``elastic_export.serving.cost``), in rows of the nominal length."""

from __future__ import annotations

import pytest

from elastic_export.serving.cost import LengthCost, fit_length_cost, linear_cost, padded_length


def test_fitted_weights_interpolate_and_extrapolate():
    cost = fit_length_cost(128, {8: 2.0, 32: 5.0, 128: 20.0})
    assert cost.points == ((8, 0.1), (32, 0.25), (128, 1.0))
    assert cost.weight(128) == 1.0 and cost.weight(4) == pytest.approx(0.1)  # below: the fixed costs
    assert cost.weight(20) == pytest.approx(0.175)  # halfway between 8 and 32
    assert cost.weight(80) == pytest.approx(0.625)
    assert cost.weight(224) == pytest.approx(1.75)  # past the nominal: the last segment's slope
    assert cost.work(16, 32) == pytest.approx(4.0)
    assert cost.request_work(16, [(16, 32), (16, 32)]) == cost.work(16, 32)  # the padded length from the shapes


def test_a_noisy_short_measurement_never_costs_more_than_a_longer_row():
    cost = fit_length_cost(128, {8: 7.0, 32: 5.0, 128: 20.0})
    assert [w for _, w in cost.points] == [0.25, 0.25, 1.0]
    with pytest.raises(ValueError):
        fit_length_cost(128, {8: 1.0, 32: 2.0})


def test_linear_cost_without_measurements():
    cost = linear_cost(128)
    assert cost.weight(4) == cost.weight(8) == pytest.approx(8 / 128) and cost.weight(64) == pytest.approx(0.5)
    assert cost.weight(256) == pytest.approx(2.0)
    assert LengthCost(16, ((16, 1.0),)).weight(32) == 2.0 and linear_cost(4).weight(4) == 1.0


def test_padded_length_from_input_shapes():
    assert padded_length([(4, 37), (4, 37)]) == 37 and padded_length([(3,)]) == 1 and padded_length([(2, 0)]) == 1
