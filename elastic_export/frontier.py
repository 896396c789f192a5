"""The quality / speed Pareto frontier over (budget, precision) pairs.

A point is (cost, quality): cost lower is better (latency in ms, or 1 / throughput), quality higher
is better (embedding fidelity, recall@10). The frontier is the set of points no other point beats:
every point off it has another point at most as costly and at least as good. It is what a deployer
chooses from, and what the latency profile's ``frontier`` entry lists per batch size
(``elastic-export bench`` and the main job's quick evaluation write it)::

    "frontier": {"metric": "fidelity_cosine", "stat": "p90_ms",
                 "batches": {"1": [[0.6, "int8"], [0.3, "int8"], [0.0, "fp32"]], "8": [...]}}

each list from the fastest pair to the best one. Pure functions; no onnxruntime, no torch.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

Pair = tuple[float, str]  # (sparsity, precision)


def pareto_frontier(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the Pareto-optimal ``(cost, quality)`` points, by increasing cost (and quality).

    A point is kept when its quality is strictly higher than that of every point at most as costly
    listed before it: of equal points only the first (lowest index) is kept, and a point as costly
    as a better one is dropped. Points with a non-finite cost or quality are ignored.

    Args:
        points: (cost, quality) per candidate; lower cost and higher quality are better.

    Returns:
        Indices into ``points``: cost strictly increasing, quality strictly increasing.
    """
    ok = [i for i, (c, q) in enumerate(points) if math.isfinite(c) and math.isfinite(q)]
    order = sorted(ok, key=lambda i: (points[i][0], -points[i][1], i))
    out: list[int] = []
    for i in order:
        if not out or points[i][1] > points[out[-1]][1]:
            out.append(i)
    return out


def pair_frontier(cost: Mapping[Pair, float], quality: Mapping[Pair, float]) -> list[Pair]:
    """The frontier of (sparsity, precision) pairs, fastest first.

    Args:
        cost: per pair, e.g. p90 ms at one batch size (lower is better).
        quality: per pair (higher is better); pairs missing from either mapping are left out.

    Returns:
        The Pareto-optimal pairs, from the cheapest to the best.
    """
    pairs = [p for p in cost if p in quality]
    idx = pareto_frontier([(float(cost[p]), float(quality[p])) for p in pairs])
    return [pairs[i] for i in idx]


def profile_frontier(rows: Mapping[str, Mapping[int, Mapping[float, Mapping[str, float]]]],
                     quality: Mapping[Pair, float], metric: str | None, stat: str = "p90_ms") -> dict:
    """The latency profile's ``frontier`` entry (module docstring) from measured rows.

    Args:
        rows: precision -> batch size -> sparsity -> stats (``p50_ms``, ``p90_ms`` ...).
        quality: a figure per pair (higher is better).
        metric: the figure's name (stored with the frontier).
        stat: the latency statistic the frontier is over (the latency-target policy's, p90).

    Returns:
        ``{"metric", "stat", "batches": {str(batch): [[sparsity, precision], ...]}}``.
    """
    batches: dict[str, list[list]] = {}
    for b in sorted({b for by_batch in rows.values() for b in by_batch}):
        cost = {(float(s), p): float(st[stat]) for p, by_batch in rows.items()
                for s, st in by_batch.get(b, {}).items() if stat in st}
        batches[str(b)] = [[s, p] for s, p in pair_frontier(cost, quality)]
    return {"metric": metric, "stat": stat, "batches": batches}
