"""The Pareto frontier over (cost, quality) points (elastic_export.measure.frontier): pure functions."""

from __future__ import annotations

import itertools
import math
import random

import elastic_export.measure.frontier as fr
from elastic_export.measure.frontier import DENSE, Recommendation, pair_frontier, pareto_frontier, profile_frontier, recommend


def _dominated(p, q) -> bool:
    """q is at most as costly and at least as good as p, and better in one of the two."""
    return q[0] <= p[0] and q[1] >= p[1] and (q[0] < p[0] or q[1] > p[1])


def test_pareto_frontier_small_example():
    pts = [(10.0, 0.99), (5.0, 0.95), (6.0, 0.90), (2.0, 0.80), (5.0, 0.97), (12.0, 0.99), (1.0, 0.5)]
    # (6, .90) is beaten by (5, .97); (5, .95) by (5, .97); (12, .99) by (10, .99)
    assert pareto_frontier(pts) == [6, 3, 4, 0]


def test_pareto_frontier_edge_cases():
    assert pareto_frontier([]) == []
    assert pareto_frontier([(3.0, 0.7)]) == [0]
    assert pareto_frontier([(1.0, 0.5), (1.0, 0.5)]) == [0]  # equal points: the first only
    assert pareto_frontier([(2.0, 0.5), (1.0, 0.5)]) == [1]  # same quality, slower: dropped
    assert pareto_frontier([(1.0, 0.5), (1.0, 0.6)]) == [1]  # same cost, worse: dropped
    assert pareto_frontier([(1.0, math.nan), (math.inf, 0.9), (2.0, 0.4)]) == [2]
    assert pareto_frontier([(1.0, 0.1), (2.0, 0.2), (3.0, 0.3)]) == [0, 1, 2]  # all optimal


def test_pareto_frontier_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        pts = [(float(rng.randint(1, 6)), rng.randint(0, 5) / 5) for _ in range(n)]
        got = pareto_frontier(pts)
        undominated = {i for i, p in enumerate(pts) if not any(_dominated(p, q) for q in pts)}
        distinct = {pts[i] for i in undominated}
        assert {pts[i] for i in got} == distinct  # every undominated point, each value once
        assert len(got) == len(distinct)
        for a, b in itertools.pairwise(got):
            assert pts[a][0] < pts[b][0] and pts[a][1] < pts[b][1]


def test_pair_frontier_and_profile_frontier():
    cost = {(0.0, "fp32"): 10.0, (0.0, "int8"): 4.0, (0.3, "fp32"): 7.0, (0.3, "int8"): 3.0, (0.6, "fp32"): 4.5}
    quality = {(0.0, "fp32"): 1.0, (0.0, "int8"): 0.99, (0.3, "fp32"): 0.97, (0.3, "int8"): 0.96, (0.6, "fp32"): 0.9}
    assert pair_frontier(cost, quality) == [(0.3, "int8"), (0.0, "int8"), (0.0, "fp32")]
    assert pair_frontier(cost, {(0.6, "fp32"): 0.9}) == [(0.6, "fp32")]  # pairs without quality left out
    rows = {"fp32": {1: {s: {"p90_ms": c} for (s, p), c in cost.items() if p == "fp32"},
                     8: {0.0: {"p90_ms": 50.0}}},
            "int8": {1: {s: {"p90_ms": c} for (s, p), c in cost.items() if p == "int8"}}}
    got = profile_frontier(rows, quality, "fidelity_cosine")
    assert got == {"metric": "fidelity_cosine", "stat": "p90_ms",
                   "batches": {"1": [[0.3, "int8"], [0.0, "int8"], [0.0, "fp32"]], "8": [[0.0, "fp32"]]}}


# --- recommendations read off the frontier ----------------------------------------------------------
COST = {DENSE: 20.0, (0.1, "fp32"): 18.0, (0.3, "fp32"): 14.0, (0.6, "fp32"): 9.0,
        (0.0, "int8"): 8.0, (0.3, "int8"): 6.0, (0.6, "int8"): 4.0, (0.6, "fp16"): 25.0}
QUALITY = {DENSE: 0.80, (0.1, "fp32"): 0.797, (0.3, "fp32"): 0.785, (0.6, "fp32"): 0.74,
           (0.0, "int8"): 0.794, (0.3, "int8"): 0.77, (0.6, "int8"): 0.70, (0.6, "fp16"): 0.81}


def test_fastest_within_and_best_under():
    # the frontier: 0.6 int8 (4 ms, .70) -> 0.3 int8 (6, .77) -> dense int8 (8, .794) -> 0.1 fp32 (18, .797)
    #   -> dense (20, .80) -> 0.6 fp16 (25, .81: noise above dense, and slower)
    assert fr.fastest_within(COST, QUALITY, 0.79) == (0.0, "int8")
    assert fr.fastest_within(COST, QUALITY, 0.76) == (0.3, "int8")
    assert fr.fastest_within(COST, QUALITY, 0.5) == (0.6, "int8")
    assert fr.fastest_within(COST, QUALITY, 0.9) is None
    assert fr.best_under(COST, QUALITY, 10.0) == (0.0, "int8")  # not 0.6 fp32 (9 ms, .74): int8 dense beats it
    assert fr.best_under(COST, QUALITY, 5.0) == (0.6, "int8")
    assert fr.best_under(COST, QUALITY, 3.0) is None
    assert fr.best_under(COST, QUALITY, 1e9) == (0.6, "fp16")


def test_recommend_defaults_relative_to_dense():
    got = recommend(COST, QUALITY)
    assert [(r.kind, r.share) for r in got] == [("quality", 0.01), ("quality", 0.05), ("latency", 0.5), ("latency", 0.75)]
    floor1, floor5, half, three_q = got
    assert floor1 == Recommendation("quality", 0.01, 0.792, (0.0, "int8"))  # >= 99 % of dense's 0.80
    assert floor5.threshold == 0.76 and floor5.pair == (0.3, "int8")
    assert half.threshold == 10.0 and half.pair == (0.0, "int8")
    assert three_q.threshold == 15.0 and three_q.pair == (0.0, "int8")
    # every pick is on the frontier and meets its goal
    front = pair_frontier(COST, QUALITY)
    for r in got:
        assert r.pair in front
        assert (QUALITY[r.pair] >= r.threshold) if r.kind == "quality" else (COST[r.pair] <= r.threshold)
    # without a dense figure of a kind there is no goal of that kind
    assert recommend({k: v for k, v in COST.items() if k != DENSE}, QUALITY)[-1].kind == "quality"
    assert recommend(COST, {k: v for k, v in QUALITY.items() if k != DENSE})[0].kind == "latency"
    assert recommend(COST, QUALITY, drops=(0.2,), shares=(0.1,)) == [
        Recommendation("quality", 0.2, 0.64, (0.6, "int8")), Recommendation("latency", 0.1, 2.0, None)]
