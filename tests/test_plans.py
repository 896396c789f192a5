"""Budget plans: prefix fill of one global ranking, nested plans, alignment."""

import numpy as np
import pytest

from elastic_export.core.errors import UserError
from elastic_export.models.inventory import Inventory, LayerInventory
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import make_plans


def _inventory(layers=3, heads=4, neurons=64):
    Ls = [LayerInventory(i, heads, 8, neurons, False, 1000, 40, 100, 10) for i in range(layers)]
    return Inventory(Ls, tokens=8, width=32, fixed_flops=500, total_params=10_000)


def _ranking(inv, seed=0):
    rng = np.random.default_rng(seed)
    return Ranking([rng.random(L.heads).astype(np.float32) for L in inv.layers],
                   [rng.random(L.neurons).astype(np.float32) for L in inv.layers], {})


SPARSITIES = [round(x, 2) for x in np.arange(0.0, 0.96, 0.05)]


@pytest.mark.parametrize("align", [1, 8])
def test_nested_and_prefix(align):
    inv, rk = _inventory(), _ranking(_inventory())
    plans = make_plans(rk, inv, SPARSITIES, align=align)
    for a, b in zip(plans, plans[1:]):
        assert all(x >= y for x, y in zip(a.heads_per_layer, b.heads_per_layer))
        assert all(x >= y for x, y in zip(a.neurons_per_layer, b.neurons_per_layer))
    for p in plans:
        # the kept FLOPs never exceed the budget and miss it by less than one unit (chunk)
        budget = (1 - p.sparsity) * inv.prunable_flops
        assert p.kept_flops <= budget + 1e-6
        assert budget - p.kept_flops < max(1000, 40 * align)
        if align > 1:
            assert all(n % align == 0 or n == 64 for n in p.neurons_per_layer)


def test_zero_sparsity_keeps_everything():
    inv = _inventory()
    (p,) = make_plans(_ranking(inv), inv, [0.0])
    assert p.heads_per_layer == [4, 4, 4] and p.neurons_per_layer == [64, 64, 64]
    assert p.achieved_sparsity == 0.0 and p.params == inv.total_params


def test_prefix_stops_at_first_unit_that_does_not_fit():
    """A budget that a cheap unit further down would still fit must not skip the head before it."""
    inv = _inventory(layers=1, heads=1, neurons=10)  # head 1000 FLOPs, neurons 40 each: total 1400
    rk = Ranking([np.array([0.5], np.float32)], [np.linspace(1, 0.6, 10).astype(np.float32)], {})
    # order: 10 neurons (scores 1..0.6 > 0.5) then the head; budget 0.5 keeps 700 FLOPs
    (p,) = make_plans(rk, inv, [0.5])
    assert p.neurons_per_layer == [10] and p.heads_per_layer == [0]


def test_layers_can_reach_zero():
    inv = _inventory()
    rk = _ranking(inv)
    rk.heads[0][:] = -1.0  # layer 0's heads are the least important units of all
    plans = make_plans(rk, inv, [0.3])
    assert plans[0].heads_per_layer[0] == 0


def test_align_larger_than_layer_is_refused():
    inv = _inventory()
    with pytest.raises(UserError, match="--align"):
        make_plans(_ranking(inv), inv, [0.1], align=65)
    with pytest.raises(UserError):
        make_plans(_ranking(inv), inv, [0.1], align=0)
