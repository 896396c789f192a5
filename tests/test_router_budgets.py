"""The one rule for matching a requested sparsity to a served budget, and the router's request parameters
(``elastic_export.serving.router_budgets``); every place that maps a requested sparsity calls it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic_export.serving import router_budgets
from elastic_export.serving.router_budgets import BudgetError, choose_budget, row_sparsities

SERVED = [0.0, 0.1, 0.3, 0.5]


@pytest.mark.parametrize("requested,served", [
    (None, 0.1),  # nothing asked: the default
    (0.0, 0.0), (0.1, 0.1), (0.5, 0.5),  # exact
    (0.1 + 5e-7, 0.1), (0.3 - 5e-7, 0.3),  # within 1e-6
    (0.1 + 2e-6, 0.3), (0.05, 0.1), (0.2, 0.3), (0.45, 0.5),  # else the next sparser: more savings, never less
    ("0.3", 0.3),  # a numeric string (request parameters may carry one)
])
def test_choose_budget(requested, served):
    assert choose_budget(requested, SERVED, default=0.1) == served


@pytest.mark.parametrize("requested,message", [
    (0.6, "above the sparsest served budget 0.5"), (1.0, "outside [0, 1)"), (-0.1, "outside [0, 1)"),
    (float("nan"), "not a finite number"), ("abc", "not a number"), (True, "not a number"),
])
def test_choose_budget_refuses(requested, message):
    with pytest.raises(BudgetError, match=re.escape(message)):
        choose_budget(requested, SERVED, default=0.0)
    with pytest.raises(BudgetError, match="no budgets"):
        choose_budget(0.1, [], default=0.0)


def test_row_sparsities_input_then_parameter():
    assert row_sparsities(None, None, 2) is None and row_sparsities(None, "", 2) is None
    assert row_sparsities(None, json.dumps({"other": 1}), 2) is None
    assert row_sparsities(None, json.dumps({"sparsity": 0.3}), 2) == [0.3, 0.3]
    assert row_sparsities(None, json.dumps({"sparsity": "0.5"}), 1) == [0.5]
    assert row_sparsities([0.1], json.dumps({"sparsity": 0.5}), 3) == [0.1] * 3  # the input wins; one for all rows
    assert row_sparsities([0.1, 0.5], None, 2) == [0.1, 0.5]  # one per row
    with pytest.raises(BudgetError, match=re.escape("sparsity input has 3 values for a batch of 2; send shape [1, 1]")):
        row_sparsities([0.1, 0.5, 0.3], None, 2)
    with pytest.raises(BudgetError, match="has 0 values"):
        row_sparsities([], None, 2)
    with pytest.raises(BudgetError, match="not a JSON object"):
        row_sparsities(None, "{oops", 2)
    with pytest.raises(BudgetError, match="not a number"):
        row_sparsities(None, json.dumps({"sparsity": [0.1]}), 2)


def test_every_place_that_maps_a_requested_sparsity_uses_the_one_rule(tmp_path):
    """The router file, its configuration's default and the builder's ``--triton-default-sparsity`` map a
    sparsity as :func:`choose_budget` does (the search model imports it by name)."""
    from elastic_export.core.errors import UserError
    from elastic_export.serving.router_config import RouterConfig
    from elastic_export.targets import triton as TR
    from elastic_export.targets import triton_router

    assert triton_router.choose_budget is choose_budget and triton_router.BudgetError is BudgetError
    models = [TR.ServedModel(f"m{i}", s, "onnxruntime_onnx", "x.onnx") for i, s in enumerate(SERVED)]
    table = {"budget_models": {"string_value": json.dumps([[s, f"m{i}"] for i, s in enumerate(SERVED)])}}
    for requested in (0.0, 0.05, 0.1 + 5e-7, 0.2, 0.45):
        want = choose_budget(requested, SERVED, SERVED[0])
        assert TR._default_budget(models, requested) == want
        config = RouterConfig({"parameters": {**table, "default_sparsity": {"string_value": repr(requested)}}})
        assert config.default == want and config.route([requested, requested]) == [want, want]
    with pytest.raises(UserError, match=re.escape("--triton-default-sparsity: sparsity 0.6 is above the sparsest")):
        TR._default_budget(models, 0.6)
    search = (Path(TR.__file__).parent / "triton_search.py").read_text()
    assert "from elastic_export.serving.router_budgets import BudgetError, choose_budget, row_sparsities" in search


def test_budgets_listed_in_messages():
    assert router_budgets.listing([0.0, 0.25, 0.5]) == "0, 0.25, 0.5"
    assert router_budgets.number("0.5", "x") == 0.5
