"""Budget plans: a ranking and sparsities -> nested per-layer unit counts.

Units are taken in one global order (descending score) and kept while they fit the budget
``(1 - s) · prunable FLOPs``; the first unit that does not fit ends the prefix (skipping it would
break nesting). A unit costs its exact marginal FLOPs: a grouped-query head that is the first kept
reader of a key / value head also pays for that head's k / v projections. Because every layer's
units appear in that order in their own rank order, each layer keeps a *prefix* of its ranked
units, and a higher sparsity keeps a prefix of a lower one's (DESIGN.md invariant 1). With
``align=K`` a layer's neurons move in chunks of K (in rank order, chunk score = mean score), so
every neuron count is a multiple of K (or the layer's full width).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.unit_map import HEADS, NEURONS
from elastic_export.models.inventory import Inventory
from elastic_export.ranking.file import Ranking


@dataclass
class BudgetPlan:
    """What one budget keeps."""

    sparsity: float
    heads_per_layer: list[int]
    neurons_per_layer: list[int]
    kept_flops: int
    prunable_flops: int
    total_flops: int
    params: int

    @property
    def achieved_sparsity(self) -> float:
        return 1.0 - self.kept_flops / self.prunable_flops

    @property
    def gflops(self) -> float:
        return self.total_flops / 1e9

    def count(self, kind: str, layer: int) -> int:
        return (self.heads_per_layer if kind == HEADS else self.neurons_per_layer)[layer]


def _items(ranking: Ranking, inventory: Inventory, align: int) -> list[tuple[float, int, int, int, int, int]]:
    """(score, layer, kind_id, position, units, cost) for every head and every neuron chunk."""
    items = []
    for i, L in enumerate(inventory.layers):
        order = ranking.order(HEADS, i)
        for pos, (s, cost) in enumerate(zip(ranking.scores(HEADS, i)[order], L.head_marginals(order))):
            items.append((float(s), i, 0, pos, 1, cost))
        n_scores = ranking.scores(NEURONS, i)[ranking.order(NEURONS, i)].astype(np.float64)
        for pos, start in enumerate(range(0, len(n_scores), align)):
            chunk = n_scores[start : start + align]
            items.append((float(chunk.mean()), i, 1, pos, len(chunk), len(chunk) * L.neuron_cost))
    # descending score; ties: layer, heads before neurons, rank position (keeps per-layer order)
    items.sort(key=lambda t: (-t[0], t[1], t[2], t[3]))
    return items


def check_align(inventory: Inventory, align: int) -> None:
    """Refuse an ``--align`` that is not positive or wider than some layer's MLP."""
    if align < 1:
        raise UserError(f"--align must be a positive integer, got {align}")
    narrow = min(L.neurons for L in inventory.layers)
    if align > narrow:
        raise UserError(f"--align {align} is larger than a layer's MLP width ({narrow} neurons)")


def make_plans(ranking: Ranking, inventory: Inventory, sparsities: list[float], align: int = 1) -> list[BudgetPlan]:
    """One nested plan per sparsity.

    Args:
        ranking: unit scores (must match ``inventory``).
        inventory: unit counts and costs.
        sparsities: fractions of prunable FLOPs to remove, each in [0, 1).
        align: neuron counts per layer become multiples of this (1 = no alignment).

    Raises:
        UserError: ``align`` is not positive or is wider than a layer's MLP.
    """
    check_align(inventory, align)
    items = _items(ranking, inventory, align)
    costs = np.array([t[5] for t in items], dtype=np.int64)
    cum = np.cumsum(costs)
    P = inventory.prunable_flops
    orders = [ranking.order(HEADS, i) for i in range(len(inventory.layers))]
    plans = []
    for s in sparsities:
        budget = (1.0 - s) * P
        n_items = int(np.searchsorted(cum, budget * (1 + 1e-12), side="right"))
        heads = [0] * len(inventory.layers)
        neurons = [0] * len(inventory.layers)
        for _, layer, kind_id, _, units, _ in items[:n_items]:
            if kind_id == 0:
                heads[layer] += units
            else:
                neurons[layer] += units
        kept = inventory.kept_flops(heads, neurons, orders)
        plans.append(
            BudgetPlan(
                sparsity=s,
                heads_per_layer=heads,
                neurons_per_layer=neurons,
                kept_flops=kept,
                prunable_flops=P,
                total_flops=kept + inventory.fixed_flops,
                params=inventory.kept_params(heads, neurons, orders),
            )
        )
    return plans
