"""The torch reference: permutation is exact, sliced == hard-masked, for every architecture."""

import copy

import numpy as np
import torch

from elastic_export.models.adapters import find_blocks
from elastic_export.models.inventory import build_inventory
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import make_plans
from elastic_export.ranking.reference import hard_mask, permute_units, prefix_keep, ranked_keep, sliced_copy
from elastic_export.ranking.scoring import METHODS


def _ranking_with_empty_layers(enc, inv):
    heads, neurons = METHODS["random"](enc, inv, seed=3)
    heads[0][:] = -1.0  # layer 0 loses all heads first
    neurons[-1][:] = -1.0  # the last layer loses all neurons first
    return Ranking(heads, neurons, {})


def test_sliced_equals_masked(tiny):
    enc = tiny
    inv = build_inventory(enc)
    rk = _ranking_with_empty_layers(enc, inv)
    feeds = enc.sample_inputs(batch=3, seq_len=12)
    with torch.no_grad():
        dense = enc.export_module()(*feeds.values())
        perm = copy.deepcopy(enc.module)
        permute_units(find_blocks(perm), rk)
        permuted = enc.export_module(perm)(*feeds.values())
        for a, b in zip(dense, permuted):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        plans = make_plans(rk, inv, [0.0, 0.25, 0.5, 0.9])
        assert any(0 in p.heads_per_layer for p in plans)
        assert any(0 in p.neurons_per_layer for p in plans)
        for plan in plans:
            with hard_mask(enc.blocks(), ranked_keep(plan, rk)):
                masked = enc.export_module()(*feeds.values())
            sliced = enc.export_module(sliced_copy(perm, find_blocks, prefix_keep(plan)))(*feeds.values())
            for a, b in zip(masked, sliced):
                assert float((a - b).abs().max()) <= 1e-4


def test_mask_changes_output(tiny):
    """A hard mask that removes units must change the output (the hooks are really applied)."""
    enc = tiny
    inv = build_inventory(enc)
    rk = Ranking(*METHODS["random"](enc, inv), {})
    (plan,) = make_plans(rk, inv, [0.5])
    feeds = enc.sample_inputs(batch=2, seq_len=8)
    with torch.no_grad():
        dense = enc.export_module()(*feeds.values())[0]
        with hard_mask(enc.blocks(), ranked_keep(plan, rk)):
            masked = enc.export_module()(*feeds.values())[0]
    assert not np.allclose(dense.numpy(), masked.numpy(), atol=1e-4)
