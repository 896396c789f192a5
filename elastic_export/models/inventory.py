"""Unit inventory and FLOP accounting (DESIGN.md §1).

Per unit, at nominal token count N, model width D and head width d_h:

* MLP neuron: ``4·D·N`` FLOPs (SwiGLU: ``6·D·N``);
* attention head: ``8·D·d_h·N + 4·d_h·N² + 3·N²``; with sliding-window attention each query reads
  ``K = min(N, window)`` keys: ``8·D·d_h·N + 4·d_h·N·K + 3·N·K``;
* grouped-query attention: a query head owns ``4·D·d_h·N + 4·d_h·N·K + 3·N·K`` (q rows, o columns,
  its attention) and a key / value head costs ``4·D·d_h·N`` (k and v rows) while any query head
  reading it is kept. The exact count (:meth:`LayerInventory.kept_head_flops`) depends on which
  query heads are kept; the per-unit cost the ranking uses (``head_cost``) spreads the kv heads'
  cost evenly over the query heads.

The model total adds the FLOPs of every layer that is not prunable (embeddings' patch projection,
pooler, classifier ...) counted as 2·MACs of each ``nn.Linear`` / ``nn.Conv2d`` in one forward pass
at N tokens. Sparsity is the fraction of *prunable* FLOPs removed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from elastic_export.core.unit_map import HEADS

if TYPE_CHECKING:  # the inventory itself is plain data; building one needs torch
    from torch import nn

    from elastic_export.models.adapters import UnitGroup
    from elastic_export.models.encoder import Encoder


def neuron_flops(width: int, tokens: int, swiglu: bool = False) -> int:
    """FLOPs of one MLP neuron: ``4·D·N`` (``6·D·N`` for SwiGLU)."""
    return (6 if swiglu else 4) * width * tokens


def head_flops(width: int, head_dim: int, tokens: int, window: int | None = None) -> int:
    """FLOPs of one attention head: ``8·D·d_h·N + 4·d_h·N·K + 3·N·K`` with ``K = N`` keys per query
    (global attention) or ``K = min(N, window)`` (sliding window)."""
    keys = tokens if window is None else min(tokens, window)
    return 8 * width * head_dim * tokens + 4 * head_dim * tokens * keys + 3 * tokens * keys


def _bias_groups(role) -> int:
    """Packed groups of a producer whose bias entries are parameters (a separately stored part may
    be a constant buffer, e.g. timm EVA's all-zero ``k_bias``)."""
    from torch import nn

    if role.bias_parts:
        return sum(isinstance(getattr(m, attr), nn.Parameter) for m, attr in role.bias_parts)
    return role.groups if role.linear.bias is not None else 0


def _role_params(roles, width: int) -> int:
    total = 0
    for role in roles:
        lin = role.linear
        if role.side == "out":
            total += width * (role.groups * lin.in_features + _bias_groups(role))
        else:
            total += width * lin.out_features
    return total


def unit_params(group: UnitGroup) -> int:
    """Parameters that one unit of ``group`` owns (its rows, columns and bias entries); shared
    key / value heads are not owned by a query head (see :func:`kv_params`)."""
    return _role_params(group.unit_roles, group.width)


def kv_params(group: UnitGroup) -> int:
    """Parameters of one shared key / value head of ``group`` (0 without shared heads)."""
    return _role_params(group.kv.producers, group.width) if group.kv is not None else 0


@dataclass
class LayerInventory:
    """Units of one block and what each costs."""

    index: int
    heads: int
    head_dim: int
    neurons: int
    swiglu: bool
    head_cost: int
    neuron_cost: int
    head_params: int
    neuron_params: int
    kv_heads: int = 0
    kv_cost: int = 0
    kv_params: int = 0
    kv_index: tuple[int, ...] = ()

    @property
    def flops(self) -> int:
        return self.kept_head_flops(self.heads) + self.neurons * self.neuron_cost

    @property
    def head_own_cost(self) -> int:
        """FLOPs of one head without its share of key / value heads (= ``head_cost`` without them)."""
        return self.head_cost - (self.kv_cost * self.kv_heads) // self.heads if self.kv_heads else self.head_cost

    def kv_kept(self, k: int, order: np.ndarray | None = None) -> int:
        """Key / value heads still read when the first ``k`` heads of ``order`` (default: the
        model's head order) are kept; 0 without shared key / value heads."""
        if not self.kv_heads or k == 0:
            return 0
        kept = np.arange(k) if order is None else np.asarray(order)[:k]
        return len(np.unique(np.asarray(self.kv_index)[kept]))

    def kept_head_flops(self, k: int, order: np.ndarray | None = None) -> int:
        """Exact FLOPs of the attention when the first ``k`` heads of ``order`` are kept."""
        if not self.kv_heads:
            return k * self.head_cost
        return k * self.head_own_cost + self.kv_kept(k, order) * self.kv_cost

    def head_marginals(self, order: np.ndarray) -> list[int]:
        """Exact FLOPs each head adds when the heads are kept one by one in ``order``: its own
        cost, plus a key / value head's cost where it is the first reader of one."""
        if not self.kv_heads:
            return [self.head_cost] * len(order)
        seen: set[int] = set()
        out = []
        for h in order:
            kv = self.kv_index[int(h)]
            out.append(self.head_own_cost + (self.kv_cost if kv not in seen else 0))
            seen.add(kv)
        return out

    def cost(self, kind: str) -> int:
        return self.head_cost if kind == HEADS else self.neuron_cost

    def count(self, kind: str) -> int:
        return self.heads if kind == HEADS else self.neurons


@dataclass
class Inventory:
    """Every prunable unit of a model, with FLOPs and parameter counts."""

    layers: list[LayerInventory]
    tokens: int
    width: int
    fixed_flops: int
    total_params: int

    @property
    def prunable_flops(self) -> int:
        return sum(layer.flops for layer in self.layers)

    @property
    def total_flops(self) -> int:
        return self.prunable_flops + self.fixed_flops

    def kept_flops(self, heads: list[int], neurons: list[int], head_orders: list | None = None) -> int:
        """Prunable FLOPs kept when each layer keeps the first ``heads[i]`` heads of
        ``head_orders[i]`` (default: the model's order; only grouped-query layers depend on it)
        and ``neurons[i]`` neurons."""
        orders = head_orders or [None] * len(self.layers)
        return sum(L.kept_head_flops(h, o) + n * L.neuron_cost
                   for L, h, n, o in zip(self.layers, heads, neurons, orders))

    def kept_params(self, heads: list[int], neurons: list[int], head_orders: list | None = None) -> int:
        """Parameters kept (every non-prunable one plus the kept units' and key / value heads')."""
        orders = head_orders or [None] * len(self.layers)
        removed = sum(
            (L.heads - h) * L.head_params + (L.kv_heads - L.kv_kept(h, o)) * L.kv_params
            + (L.neurons - n) * L.neuron_params
            for L, h, n, o in zip(self.layers, heads, neurons, orders)
        )
        return self.total_params - removed

    def to_json(self) -> dict:
        return {
            "tokens": self.tokens,
            "width": self.width,
            "prunable_flops": self.prunable_flops,
            "total_flops": self.total_flops,
            "total_params": self.total_params,
            "layers": [
                {k: getattr(L, k) for k in ("heads", "head_dim", "neurons", "swiglu", "head_cost", "neuron_cost")
                 + (("kv_heads", "kv_cost") if L.kv_heads else ())}
                for L in self.layers
            ],
        }


def _mha_flops(mod, query, key, value) -> int:
    """FLOPs of one ``nn.MultiheadAttention`` call (batch 1): q/k/v and output projections plus
    the attention scores and weighted sum over all heads."""
    E = mod.embed_dim
    q, k = query.numel() // E, key.numel() // mod.kdim
    return 2 * q * E * E + 2 * k * (mod.kdim + mod.vdim) * E + 4 * q * k * E + 2 * q * E * E


def _fixed_flops(encoder: Encoder, prunable: set[nn.Module]) -> int:
    """2·MACs of every non-prunable Linear / Conv2d in one forward pass at N tokens (batch 1)."""
    import torch
    from torch import nn

    total = 0

    def linear_hook(mod, inp, out):
        nonlocal total
        total += 2 * mod.in_features * out.numel()

    def conv_hook(mod, inp, out):
        nonlocal total
        k = mod.in_channels // mod.groups
        for s in mod.kernel_size:
            k *= s
        total += 2 * k * out.numel()

    def mha_hook(mod, args, kwargs, out):  # nn.MultiheadAttention (e.g. SigLIP's pooling head)
        nonlocal total
        total += _mha_flops(mod, *(list(args) + [kwargs.get(k) for k in ("query", "key", "value")])[:3])

    handles = []
    for m in encoder.module.modules():
        if m in prunable:
            continue
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(linear_hook))
        elif isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(conv_hook))
        elif isinstance(m, nn.MultiheadAttention):  # uses its projections' weights, not their forward
            handles.append(m.register_forward_hook(mha_hook, with_kwargs=True))
    try:
        feeds = encoder.sample_inputs(batch=1, seq_len=encoder.tokens)
        if "attention_mask" in feeds:
            feeds["attention_mask"] = torch.ones_like(feeds["attention_mask"])
        with torch.inference_mode():
            encoder.export_module()(*feeds.values())
    finally:
        for h in handles:
            h.remove()
    return total


def _shared_kv(group: UnitGroup, width: int, tokens: int) -> dict:
    """Inventory fields of a head group with shared key / value heads (none without): the kv
    projections' cost and parameters per kv head, and ``head_cost`` as own cost + an even share."""
    kv = group.kv
    if kv is None:
        return {}
    kv_cost = 2 * width * group.width * tokens * len(kv.producers)
    own = head_flops(width, group.width, tokens, group.window) - kv_cost
    return {"head_cost": own + (kv_cost * kv.count) // group.count, "kv_heads": kv.count, "kv_cost": kv_cost,
            "kv_params": kv_params(group), "kv_index": tuple(int(i) for i in kv.index)}


def build_inventory(encoder: Encoder) -> Inventory:
    """Count units, unit costs, parameters and the non-prunable FLOPs of ``encoder``."""
    N, D = encoder.tokens, encoder.width
    layers, prunable = [], set()
    for b in encoder.blocks():
        h, n = b.heads, b.neurons
        fields = dict(index=b.index, heads=h.count, head_dim=h.width, neurons=n.count, swiglu=n.swiglu,
                      head_cost=head_flops(D, h.width, N, h.window), neuron_cost=neuron_flops(D, N, n.swiglu),
                      head_params=unit_params(h), neuron_params=unit_params(n))
        layers.append(LayerInventory(**{**fields, **_shared_kv(h, D, N)}))
        prunable.update(r.linear for r in (*h.roles, *n.roles))
    if not layers:
        raise RuntimeError(f"{encoder.architecture}: the adapter found no transformer blocks")
    params = sum(p.numel() for p in encoder.module.parameters())
    return Inventory(layers, N, D, _fixed_flops(encoder, prunable), params)
