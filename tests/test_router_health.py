"""Budget models' health (``elastic_export.serving.router_health``): failures classified, budgets down routed
around, readiness waited for at load (injected sleep and clock), the prober's one-row request."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_export.serving import router_health
from elastic_export.serving.router_budgets import Overload
from elastic_export.serving.router_health import BudgetHealth, classify_failure, probe_feeds


@pytest.mark.parametrize("message,kind", [
    ("Stub process 'elastic_s050_0_0' is not healthy.", "down"),
    ("Request for unknown model: 'elastic_s040' is not found", "down"),
    ("Request timeout expired", "overload"),
    ("Exceeds maximum queue size", "overload"),
    ("onnxruntime: invalid dims", "failed"),
])
def test_classify_failure(message, kind):
    assert classify_failure(message) == kind


def test_wait_ready_defers_while_the_server_starts_and_names_missing_models():
    clock = iter(range(1000))
    assert router_health.wait_ready(["a", "b"], 5, lambda m: True, sleep=lambda s: None, clock=lambda: next(clock))

    def starting(model):
        raise RuntimeError("Failed to check model readiness: Server not ready")

    assert router_health.wait_ready(["a"], 5, starting, sleep=lambda s: None) is False
    with pytest.raises(RuntimeError, match="budget models not ready after 5 s: b"):
        router_health.wait_ready(["a", "b"], 5, lambda m: m == "a", sleep=lambda s: None, clock=lambda: next(clock))


def test_a_budget_down_is_served_by_the_nearest_one_up_ties_to_the_sparser():
    health = BudgetHealth([0.5, 0.0, 0.25, 0.75])
    assert health.nearest(0.25) == 0.25  # up: itself
    assert health.mark_down(0.25, now=10.0) and not health.mark_down(0.25, now=11.0)
    assert health.down == {0.25: 10.0}  # when it went down, the first time
    assert health.nearest(0.25) == 0.5  # 0.0 and 0.5 are as near: the sparser, more savings
    health.mark_down(0.5, now=12.0)
    assert health.nearest(0.5) == 0.75 and health.nearest(0.25) == 0.0
    for s in (0.0, 0.75):
        health.mark_down(s, now=13.0)
    with pytest.raises(Overload, match="no budget model is available; retry later") as err:
        health.nearest(0.0)
    assert err.value.reason == "unavailable"
    assert health.mark_up(0.5) and not health.mark_up(0.5) and health.nearest(0.0) == 0.5


def test_probe_feeds_are_one_row_of_zeros_of_each_inputs_type():
    feeds = probe_feeds([{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1, -1]},
                         {"name": "pixels", "data_type": "TYPE_FP16", "dims": [-1, 3, -1]},
                         {"name": "flag", "data_type": "TYPE_BOOL"}], tokens=7)
    assert feeds["input_ids"].shape == (1, 7) and feeds["input_ids"].dtype == np.int64
    assert feeds["pixels"].shape == (1, 3, 7) and feeds["pixels"].dtype == np.float16
    assert feeds["flag"].shape == (1,) and not feeds["flag"].any()
