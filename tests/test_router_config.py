"""The router's configuration (``elastic_export.serving.router_config``): its config.pbtxt as Triton passes it."""

from __future__ import annotations

import json
import re

import pytest

from elastic_export.serving.router_config import RouterConfig


@pytest.mark.parametrize("parameters,message", [
    ({}, "no parameter 'budget_models'"),
    ({"budget_models": "{oops"}, "is not JSON"),
    ({"budget_models": "[0.1]"}, "expected [[sparsity, model name], ...]"),
    ({"budget_models": "[]"}, "lists no budget models"),
    ({"budget_models": '[[0.5, "m"]]', "default_sparsity": "0.7"}, "above the sparsest served budget"),
])
def test_router_config_errors(parameters, message):
    config = {"parameters": {k: {"string_value": v} for k, v in parameters.items()}, "input": [], "output": []}
    with pytest.raises(ValueError, match=re.escape(message)):
        RouterConfig(config)


def _config(**params: str) -> dict:
    table = {"budget_models": json.dumps([[0.5, "m5"], [0.0, "m0"], [0.25, "m2"]])}
    return {"parameters": {k: {"string_value": v} for k, v in {**table, **params}.items()},
            "input": [{"name": "input_ids", "data_type": "TYPE_INT64", "dims": [-1, -1]},
                      {"name": "sparsity", "data_type": "TYPE_FP32", "dims": [-1, 1]}, {"name": "text"}],
            "output": [{"name": "last_hidden_state"}, {"name": "served_sparsity"}]}


def test_router_config_reads_the_table_defaults_and_the_routers_own_tensors():
    c = RouterConfig(_config(default_sparsity="0.1", slo_ms="200", max_rows="32"))
    assert c.models == {0.0: "m0", 0.25: "m2", 0.5: "m5"} and c.sparsities == [0.0, 0.25, 0.5]
    assert c.default == 0.25  # mapped as a request is
    assert c.policy == "fixed" and c.slo_ms == 200.0 and c.slo_quantile == 0.99 and c.max_sparsity is None
    assert c.max_rows == 32 and c.max_concurrency == 64 and c.tokens == 16 and not c.inline
    assert c.text and c.inputs == ["input_ids"] and c.outputs == ["last_hidden_state"]
    assert [t["name"] for t in c.input_specs] == ["input_ids"]


def test_route_maps_each_row_and_otherwise_serves_the_pick():
    c = RouterConfig(_config())
    assert c.route(None) == [0.0] and c.route(None, chosen=0.5) == [0.5]
    assert c.route([0.1, 0.1, 0.1]) == [0.25] * 3 and c.route([0.3, 0.0]) == [0.5, 0.0]
    assert c.route(["0.25"]) == [0.25]  # a numeric string, as a parameter may carry
    with pytest.raises(ValueError, match="not one of"):
        RouterConfig(_config(policy="fastest"))
    with pytest.raises(ValueError, match=re.escape("'slo_quantile': 1 is not in (0, 1)")):
        RouterConfig(_config(slo_quantile="1"))
