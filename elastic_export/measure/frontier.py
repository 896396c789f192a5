"""The quality / speed Pareto frontier over (budget, precision) pairs.

A point is (cost, quality): cost lower is better (latency in ms, or 1 / throughput), quality higher
is better (embedding fidelity, recall@10). The frontier is the set of points no other point beats:
every point off it has another point at most as costly and at least as good. It is what a deployer
chooses from, and what the latency profile's ``frontier`` entry lists per batch size
(``elastic-export bench`` and the main job's quick evaluation write it)::

    "frontier": {"metric": "fidelity_cosine", "stat": "p90_ms",
                 "batches": {"1": [[0.6, "int8"], [0.3, "int8"], [0.0, "fp32"]], "8": [...]}}

each list from the fastest pair to the best one. :func:`recommend` reads a deployment choice off
the frontier: for a quality floor the fastest pair meeting it, for a latency target the best pair
within it (the report's recommendation block). Pure functions; no onnxruntime, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

Pair = tuple[float, str]  # (sparsity, precision)
DENSE: Pair = (0.0, "fp32")
QUALITY_DROPS = (0.01, 0.05)  # default floors: within 1 % / 5 % of the dense model's quality
LATENCY_SHARES = (0.5, 0.75)  # default targets: half / three quarters of the dense model's latency


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


def fastest_within(cost: Mapping[Pair, float], quality: Mapping[Pair, float], floor: float) -> Pair | None:
    """The cheapest pair whose quality is at least ``floor`` (the first such pair on the frontier);
    None when no pair reaches it."""
    return next((p for p in pair_frontier(cost, quality) if quality[p] >= floor), None)


def best_under(cost: Mapping[Pair, float], quality: Mapping[Pair, float], limit: float) -> Pair | None:
    """The best pair whose cost is at most ``limit`` (the last such pair on the frontier); None when
    every pair costs more."""
    within = [p for p in pair_frontier(cost, quality) if cost[p] <= limit]
    return within[-1] if within else None


@dataclass(frozen=True)
class Recommendation:
    """One goal and the pair that meets it best.

    Args:
        kind: ``"quality"`` (a floor: the fastest pair at or above it) or ``"latency"`` (a target:
            the best pair at or under it).
        share: the goal relative to the reference: the allowed quality drop (0.01 = within 1 %),
            or the share of the reference's cost (0.5 = half its latency).
        threshold: the floor (quality units) or the target (cost units) that share gives.
        pair: the pick; None when no pair meets the goal.
    """

    kind: str
    share: float
    threshold: float
    pair: Pair | None


def recommend(cost: Mapping[Pair, float], quality: Mapping[Pair, float], reference: Pair = DENSE,
              drops: Sequence[float] = QUALITY_DROPS, shares: Sequence[float] = LATENCY_SHARES) -> list[Recommendation]:
    """Picks for quality floors relative to the ``reference`` pair's quality and for latency targets
    relative to its cost, read from the frontier of ``cost`` and ``quality``.

    Args:
        cost: per pair, e.g. p50 ms at one batch size (lower is better).
        quality: per pair (higher is better).
        reference: the pair the goals are relative to (the dense fp32 model).
        drops: quality floors as allowed relative drops (0.01: at least 99 % of the reference's quality).
        shares: latency targets as shares of the reference's cost (0.5: at most half of it).

    Returns:
        One :class:`Recommendation` per floor, then one per target; none of a kind when the
        reference has no figure of it.
    """
    out = []
    if reference in quality:
        ref = float(quality[reference])
        for d in drops:
            floor = ref - abs(ref) * d
            out.append(Recommendation("quality", d, floor, fastest_within(cost, quality, floor)))
    if reference in cost:
        for sh in shares:
            limit = float(cost[reference]) * sh
            out.append(Recommendation("latency", sh, limit, best_under(cost, quality, limit)))
    return out
