"""The torch reference ("oracle") every ONNX pass is tested against.

* :func:`permute_units` reorders each layer's units into rank order in place (the function the
  model computes does not change), so that every budget keeps a per-layer *prefix*;
* :func:`hard_mask` multiplies each unit's output by 0/1 (forward pre-hooks on the consumer layer):
  the dense model with hard masks, the ground truth of DESIGN.md invariant 2 (grouped-query
  attention: query heads are masked; a key / value head whose readers are all masked contributes
  nothing, as in the sliced model, which drops it);
* :func:`slice_units` physically removes units (one slicing rule per layer role, and the adapter's
  ``resize`` for attributes such as ``num_heads``); shared key / value heads follow the query heads
  that read them (:func:`shared_order`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator

import numpy as np
import torch
from torch import nn

from elastic_export.models.adapters import HEADS, NEURONS, BlockUnits, LinearRole, UnitGroup
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.masks import unit_masks
from elastic_export.ranking.plans import BudgetPlan

Keep = dict[tuple[int, str], np.ndarray]


def feature_index(units: np.ndarray, count: int, width: int, groups: int = 1) -> torch.Tensor:
    """Feature positions of ``units`` along a unit axis laid out as (groups, count, width)."""
    units = torch.as_tensor(np.asarray(units, dtype=np.int64))
    per_group = (units[:, None] * width + torch.arange(width)[None, :]).reshape(-1)
    return torch.cat([g * count * width + per_group for g in range(groups)])


def _select_parts(role: LinearRole, units: np.ndarray, count: int, width: int) -> None:
    """Keep ``units`` of each separately stored bias part of ``role`` (one part per packed group)."""
    idx = feature_index(units, count, width)
    with torch.no_grad():
        for module, attr in role.bias_parts:
            old = getattr(module, attr)
            new = old.data[idx].clone()
            setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad)
                    if isinstance(old, nn.Parameter) else new)


def _select(role: LinearRole, idx: torch.Tensor) -> None:
    """Keep features ``idx`` of ``role.linear`` on the unit side, in that order (in place)."""
    lin = role.linear
    with torch.no_grad():
        if role.side == "out":
            lin.weight = nn.Parameter(lin.weight.data[idx].clone())
            if lin.bias is not None:
                lin.bias = nn.Parameter(lin.bias.data[idx].clone())
            lin.out_features = len(idx)
        else:
            lin.weight = nn.Parameter(lin.weight.data[:, idx].clone())
            lin.in_features = len(idx)


def _apply(group: UnitGroup, units: np.ndarray) -> None:
    for role in group.unit_roles:
        groups = role.groups if role.side == "out" else 1
        _select(role, feature_index(units, group.count, group.width, groups))
        _select_parts(role, units, group.count, group.width)
    for index in group.shared_rows:  # e.g. the shared position-bias rows the heads read, in the new order
        value = index.value
        setattr(index.module, index.attr, value[torch.as_tensor(np.asarray(units, dtype=np.int64), device=value.device)])
    if group.kv is not None:
        _apply_shared(group, units)


def shared_order(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Key / value heads that the query heads read (``index``: kv head per query head), in order of
    first use, and the index re-expressed in positions of that order.

    Ordered this way, the first k query heads read exactly the first ``max(new_index[:k]) + 1``
    kv heads, so a prefix of query heads needs a prefix of kv heads (plans nest, DESIGN.md §2).
    """
    index = np.asarray(index, dtype=np.int64)
    _, first = np.unique(index, return_index=True)
    order = index[np.sort(first)]
    position = np.empty(int(index.max()) + 1 if index.size else 0, dtype=np.int64)
    position[order] = np.arange(len(order))
    return order, position[index]


def _apply_shared(group: UnitGroup, units: np.ndarray) -> None:
    """After the query heads became ``units`` (in that order): keep the key / value heads they read,
    in order of first use, and store the new query -> kv index."""
    kv = group.kv
    order, index = shared_order(kv.index[np.asarray(units, dtype=np.int64)])
    for role in kv.producers:
        _select(role, feature_index(order, kv.count, group.width, role.groups))
    kv.count, kv.index = len(order), index
    kv.store(index)


def permute_units(blocks: list[BlockUnits], ranking: Ranking) -> None:
    """Reorder every layer's units into rank order (best first). Function-preserving, in place."""
    for b in blocks:
        for kind in (HEADS, NEURONS):
            g = b.group(kind)
            _apply(g, ranking.order(kind, b.index))


def slice_units(blocks: list[BlockUnits], keep: Keep) -> None:
    """Physically keep only ``keep[(layer, kind)]`` units (in place); 0 units bypass the sub-block."""
    for b in blocks:
        for kind in (HEADS, NEURONS):
            g = b.group(kind)
            units = keep[(b.index, kind)]
            _apply(g, units)
            if g.resize is not None:
                g.resize(len(units))


def prefix_keep(plan: BudgetPlan) -> Keep:
    """Keep sets of a plan on a rank-permuted model: the first k units of each layer."""
    keep: Keep = {}
    for i, (h, n) in enumerate(zip(plan.heads_per_layer, plan.neurons_per_layer)):
        keep[(i, HEADS)] = np.arange(h)
        keep[(i, NEURONS)] = np.arange(n)
    return keep


def ranked_keep(plan: BudgetPlan, ranking: Ranking) -> Keep:
    """Keep sets of a plan on the original (unpermuted) model."""
    keep: Keep = {}
    for i, (h, n) in enumerate(zip(plan.heads_per_layer, plan.neurons_per_layer)):
        keep[(i, HEADS)] = ranking.order(HEADS, i)[:h]
        keep[(i, NEURONS)] = ranking.order(NEURONS, i)[:n]
    return keep


@contextlib.contextmanager
def hard_mask(blocks: list[BlockUnits], keep: Keep) -> Iterator[None]:
    """Within the context, every unit not in ``keep`` outputs exactly zero."""
    masks = {}
    for b in blocks:
        for kind in (HEADS, NEURONS):
            m = torch.zeros(b.group(kind).count)
            m[torch.as_tensor(np.asarray(keep[(b.index, kind)], dtype=np.int64))] = 1.0
            masks[(b.index, kind)] = m
    with unit_masks(blocks, lambda layer, kind: masks[(layer, kind)]):
        yield


def sliced_copy(module: nn.Module, find_blocks, keep: Keep) -> nn.Module:
    """A deep copy of ``module`` with only the kept units."""
    clone = copy.deepcopy(module)
    slice_units(find_blocks(clone), keep)
    return clone
