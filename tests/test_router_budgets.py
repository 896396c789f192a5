"""The one rule for matching a requested sparsity to a served budget, and the router's request parameters
(``elastic_export.serving.router_budgets``)."""

from __future__ import annotations

import json
import re

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


def test_budgets_listed_in_messages():
    assert router_budgets.listing([0.0, 0.25, 0.5]) == "0, 0.25, 0.5"
    assert router_budgets.number("0.5", "x") == 0.5
