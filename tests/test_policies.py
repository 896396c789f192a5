"""The runtime's policies by name, and its ``adaptive`` policy (``policies.SloAdaptivePolicy``) against the served
router's (``router_load.SloRouting``): the same SLO policy, so the same budget for the same arrivals. Manual clocks,
no model files."""

from __future__ import annotations

import json
import random

import pytest

from elastic_export.core.errors import UserError
from elastic_export.core.latency_profile import LatencyProfile
from elastic_export.serving.policies import (
    POLICIES,
    ROUTER_POLICIES,
    FixedPolicy,
    SloAdaptivePolicy,
    make_policy,
)
from elastic_export.serving.router_config import RouterConfig
from elastic_export.serving.router_load import SloRouting

BUDGETS = (0.0, 0.3, 0.6)
PAIRS = [(s, p) for s in BUDGETS for p in ("fp32", "int8")]
POINTS = {s: {1: 10.0 * (1 - s), 8: 80.0 * (1 - s)} for s in BUDGETS}  # 10 ms x (1 - s) per row: dense 100 rows/s


def _adaptive(**kwargs) -> tuple[SloAdaptivePolicy, list[float]]:
    clock = [0.0]
    policy = SloAdaptivePolicy(slo_ms=250, points=POINTS, clock=lambda: clock[0], **kwargs)
    policy.bind_pairs(PAIRS, "fp32")
    return policy, clock


def _routing(budgets=BUDGETS) -> tuple[SloRouting, list[float]]:
    config = RouterConfig({"parameters": {"budget_models": {"string_value": json.dumps(
        [[s, f"m{i}"] for i, s in enumerate(budgets)])}, "policy": {"string_value": "adaptive"},
        "slo_ms": {"string_value": "250"}}, "input": [], "output": []})
    clock = [0.0]
    return SloRouting(config, {s: POINTS[s] for s in budgets}, clock=lambda: clock[0]), clock


def test_adaptive_serves_dense_at_a_light_rate_and_sparser_as_the_rate_rises():
    served, light = [], None
    for rate in (20, 90, 150):  # rows/s; capacities: dense 100, 0.3 143, 0.6 250
        policy, clock = _adaptive()
        assert policy.select(1) == (0.0, "fp32")  # before any arrival: the best quality
        for i in range(rate * 8):
            clock[0] = (i + 1) / rate
            policy.arrive(1)
        assert policy.last.meets and policy.last.rate == pytest.approx(rate, rel=0.05)
        served.append(policy.select(1)[0])
        light = light if rate > 20 else (policy, clock)
    assert served == [0.0, 0.3, 0.6]
    policy, clock = light
    for i in range(400):  # and from the light rate, a step up to 150 rows/s moves it to 0.6 on the same clock
        clock[0] = 8 + (i + 1) / 150
        policy.arrive(1)
    assert policy.select(1) == (0.6, "fp32")


def test_adaptive_policy_agrees_with_the_routers_slo_routing():
    """The point of one policy layer: fed the same arrivals (Poisson times, 1-4 rows, a light load, a step up
    past dense's capacity, a middle load, light again) on the same clock with the same service times, the
    in-process policy and the router's SloRouting pick the same budget at every arrival."""
    policy, clock = _adaptive()
    routing, router_clock = _routing()
    rng, now, picks = random.Random(7), 0.0, []
    for rate, seconds in ((20, 10), (150, 4), (70, 6), (20, 15)):
        end = now + seconds
        while now < end:
            now += rng.expovariate(rate / 2.5)  # rows/s over a mean of 2.5 rows a request
            rows = rng.randint(1, 4)
            clock[0] = router_clock[0] = now
            policy.arrive(rows)
            decision = routing.arrive(rows)
            assert policy.select(rows) == decision.pair and policy.last == decision, now
            picks.append(decision.pair[0])
    assert picks[0] == 0.0 and len(set(picks)) >= 2 and picks[-1] == 0.0, sorted(set(picks))


def test_adaptive_takes_its_service_times_from_a_profile_or_points_and_checks_them():
    rows = {b: {s: {"p50_ms": ms} for s, ms in ((s, POINTS[s][b]) for s in BUDGETS)} for b in (1, 8)}
    clock = [0.0]
    policy = SloAdaptivePolicy(slo_ms=250, profile=LatencyProfile("onnxruntime", "cpu", rows), clock=lambda: clock[0])
    policy.bind_pairs(PAIRS, "fp32")
    assert policy.policy.service.ms((0.3, "fp32"), 8) == pytest.approx(56.0)
    pairs_policy = SloAdaptivePolicy(points={(s, "int8"): v for s, v in POINTS.items()}, precision="int8")
    pairs_policy.bind_pairs(PAIRS, "fp32")
    assert pairs_policy.select(1) == (0.0, "int8") and pairs_policy.policy.slo_ms == 250.0  # the router's default SLO
    floor, _ = _adaptive(max_sparsity=0.3)
    assert [s for s, _ in floor.policy.pairs] == [0.0, 0.3]
    for kwargs, match in (({}, "points or a profile"), ({"points": {0.0: {1: 1.0}}}, "lack sparsity 0.3"),
                          ({"points": POINTS, "precision": "fp16"}, "precision 'fp16' is not loaded"),
                          ({"points": POINTS, "quantile": 1.5}, "quantile"),
                          ({"points": POINTS, "max_sparsity": -0.1}, "max_sparsity")):
        with pytest.raises(UserError, match=match):
            SloAdaptivePolicy(**kwargs).bind_pairs(PAIRS, "fp32")
    with pytest.raises(UserError, match="not bound"):
        SloAdaptivePolicy(points=POINTS).arrive(1)


def test_policies_by_name_cover_the_routers():
    assert set(ROUTER_POLICIES) <= set(POLICIES) and POLICIES["adaptive"] is SloAdaptivePolicy
    fixed = make_policy("fixed")  # the router's --policy fixed without a default: the densest
    fixed.bind_pairs([(0.2, "fp32"), (0.5, "fp32")], "fp32")
    assert isinstance(fixed, FixedPolicy) and fixed.select(1) == (0.2, "fp32")
    assert isinstance(make_policy("adaptive", slo_ms=100, points=POINTS), SloAdaptivePolicy)
    with pytest.raises(UserError, match="policy 'nope': unknown; choose from fixed, latency, load, adaptive"):
        make_policy("nope")
