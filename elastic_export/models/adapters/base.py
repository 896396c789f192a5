"""What every adapter returns: the prunable units of each block and how they sit in the weights.

An adapter never changes a model. It only *describes* it: which ``nn.Linear`` layers produce a
block's units (their output features) and which one consumes them (its input features), how many
units there are and how wide each is. The scoring, masking, slicing and export stages all work
from this description, so a new architecture only needs a new description.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from elastic_export.core.unit_map import HEADS, NEURONS  # noqa: E402,F401 (the unit kinds)


@dataclass
class LinearRole:
    """How one ``nn.Linear`` relates to a group of units.

    Args:
        linear: the layer.
        side: ``"out"`` when units index its output features (fc1, q/k/v), ``"in"`` when they index
            its input features (fc2, the attention output projection).
        groups: packed copies of the unit axis along that side (fused qkv: 3, packed GLU fc1: 2).
        name: dotted parameter prefix of the layer inside the exported module (``...weight``).
        bias_parts: side ``"out"`` only: the layer's bias is not ``linear.bias`` (which is None) but
            the concatenation of these 1-D tensors, ``(module, attribute)``, one per packed group
            (timm ``EvaAttention``: ``q_bias``, ``k_bias``, ``v_bias`` added to a bias-free fused
            qkv). Slicing cuts each part; the ONNX graph holds their concatenation as one bias.
    """

    linear: nn.Linear
    side: str
    groups: int = 1
    name: str = ""
    bias_parts: tuple[tuple[nn.Module, str], ...] = ()

    @property
    def bias(self) -> torch.Tensor | None:
        """The bias the layer's output features receive (``linear.bias`` or the joined parts)."""
        if not self.bias_parts:
            return self.linear.bias
        return torch.cat([getattr(m, attr) for m, attr in self.bias_parts])


@dataclass
class IndexRole:
    """A per-unit index buffer: one entry per unit, naming which slice of a tensor shared by several
    layers each unit reads (e.g. MPNet's relative position bias, one row per head, computed once for
    all layers). Permuted and sliced like the units; the dense export stores it as a ``Gather``
    index initializer that the passes cut to the kept prefix.

    Args:
        module: the module that owns the buffer.
        attr: the buffer's attribute name (a 1-D int64 tensor of length ``count``).
        name: dotted name of the buffer inside the exported module (filled in by ``find_blocks``).
    """

    module: nn.Module
    attr: str
    name: str = ""

    @property
    def value(self):
        return getattr(self.module, self.attr)


@dataclass
class SharedHeads:
    """Key / value heads that groups of query heads share (grouped-query attention, DESIGN.md §1).

    The query head is the unit; a key / value head is not one. It stays while any query head that
    reads it stays. The torch slicer keeps, after the query heads, the key / value heads they read
    (in order of first use) and calls ``store`` with the new index.

    Args:
        producers: the key and value projections (kv head j owns output features j·width .. (j+1)·width).
        count: number of key / value heads.
        index: the kv head each query head reads (one entry per query head, in query-head order).
        store: called with a new index (and so a new kv head count) after the torch slicer cut the
            weights; makes the attention module read its key / value heads through it.
    """

    producers: list[LinearRole]
    count: int
    index: np.ndarray
    store: Callable[[np.ndarray], None]


@dataclass
class UnitGroup:
    """All units of one kind in one block: the MLP neurons or the attention heads.

    Args:
        kind: ``"neurons"`` or ``"heads"``.
        count: number of units.
        width: features per unit (1 for a neuron, head_dim for a head).
        producers: layers whose output features are the units (side ``"out"``).
        consumer: the layer whose input features are the units (side ``"in"``); masks multiply its input.
        module: the sub-module that owns the units (attention or MLP), used by the torch slicer.
        swiglu: MLP with a gate and an up projection (cost 6·D·N per neuron instead of 4·D·N).
        resize: called with the new unit count after the torch slicer cut the weights, to update
            attributes such as ``num_heads`` (and to bypass the sub-block when the count is 0).
        window: heads only: sliding-window attention, each query reads at most this many keys
            (the head's attention FLOPs use ``min(N, window)`` keys); None for global attention.
        shared_rows: per-unit index buffers (:class:`IndexRole`) that select the units' rows of a
            tensor shared across layers; permuted and sliced with the units.
        kv: heads only: key / value heads shared by the query heads (grouped-query attention);
            ``producers`` then holds the query projection alone. None: every head has its own
            q, k, v rows.
    """

    kind: str
    count: int
    width: int
    producers: list[LinearRole]
    consumer: LinearRole
    module: nn.Module
    swiglu: bool = False
    resize: Callable[[int], None] | None = None
    window: int | None = None
    shared_rows: list[IndexRole] = field(default_factory=list)
    kv: SharedHeads | None = None

    @property
    def unit_roles(self) -> list[LinearRole]:
        """The layers whose features are indexed by this group's units (producers and consumer)."""
        return [*self.producers, self.consumer]

    @property
    def roles(self) -> list[LinearRole]:
        """Every prunable layer of the group: :attr:`unit_roles` plus shared key / value producers."""
        return [*self.unit_roles, *(self.kv.producers if self.kv is not None else [])]


@dataclass
class BlockUnits:
    """The prunable units of one transformer block."""

    index: int
    heads: UnitGroup
    neurons: UnitGroup
    block: nn.Module

    def group(self, kind: str) -> UnitGroup:
        return self.heads if kind == HEADS else self.neurons


# --- block table: block module type -> function describing its units --------------------------
BlockDescriber = Callable[[nn.Module], tuple[UnitGroup, UnitGroup]]
BLOCK_DESCRIBERS: dict[type, BlockDescriber] = {}


def register_block(*types: type) -> Callable[[BlockDescriber], BlockDescriber]:
    """Register a function that returns ``(heads, neurons)`` for blocks of the given types."""

    def deco(fn: BlockDescriber) -> BlockDescriber:
        for t in types:
            BLOCK_DESCRIBERS[t] = fn
        return fn

    return deco


def find_blocks(model: nn.Module) -> list[BlockUnits]:
    """Every registered block inside ``model``, in module order, with parameter names filled in."""
    names = {m: n for n, m in model.named_modules()}
    blocks: list[BlockUnits] = []
    for module in model.modules():
        fn = BLOCK_DESCRIBERS.get(type(module))
        if fn is None:
            continue
        heads, neurons = fn(module)
        for group in (heads, neurons):
            for role in group.roles:
                role.name = names[role.linear]
            for index in group.shared_rows:
                index.name = f"{names[index.module]}.{index.attr}".lstrip(".")
        blocks.append(BlockUnits(len(blocks), heads, neurons, module))
    return blocks


def unsupported_option(what: str, model_name: str) -> None:
    from elastic_export.core.errors import UserError

    raise UserError(f"{model_name}: {what} is not supported (its units cannot be sliced one by one)")


@dataclass
class InputSpec:
    """One model input: name, dtype (numpy name) and shape with symbolic dims as strings."""

    name: str
    dtype: str
    shape: list = field(default_factory=list)


def check_identity(module: nn.Module | None) -> bool:
    return module is None or isinstance(module, nn.Identity)


def bias_only_forward(out_proj: nn.Linear) -> Callable:
    """Forward of an attention module that kept 0 heads and owns its output projection.

    The attention contributes only the output projection's bias (zeros without one) at every
    token; returns ``(output, None)`` like a Hugging Face attention module. Installed by the
    adapters' ``resize(0)``, since a 0-wide ``view(..., -1, head_dim)`` cannot be reshaped.

    Args:
        out_proj: the attention's output projection (its bias is read at call time).
    """

    def forward(hidden_states, *args, **kwargs):
        shape = (*hidden_states.shape[:-1], out_proj.out_features)
        if out_proj.bias is None:
            return hidden_states.new_zeros(shape), None
        return out_proj.bias.expand(shape), None

    return forward


def qkv_heads(attn: nn.Module, q: nn.Linear, k: nn.Linear, v: nn.Linear, out: nn.Linear, count_attr: str,
              width: int) -> UnitGroup:
    """The heads of an attention with separate q / k / v projections whose forward reads its head
    count from ``attn.<count_attr>`` (and infers it from ``view(..., -1, head_dim)``).

    Args:
        attn: the module that holds the head count and runs the attention.
        q, k, v: the producer projections (head h owns output features h·width .. (h+1)·width).
        out: the output projection (consumer); with 0 heads it alone contributes, by its bias.
        count_attr: the attribute of ``attn`` that holds the head count.
        width: head dimension.
    """

    def resize(n: int) -> None:
        setattr(attn, count_attr, n)
        if n == 0:
            attn.forward = bias_only_forward(out)

    return UnitGroup(
        kind=HEADS,
        count=getattr(attn, count_attr),
        width=width,
        producers=[LinearRole(q, "out"), LinearRole(k, "out"), LinearRole(v, "out")],
        consumer=LinearRole(out, "in"),
        module=attn,
        resize=resize,
    )


def mlp_neurons(module: nn.Module, fc1: nn.Linear, fc2: nn.Linear) -> UnitGroup:
    """The neurons of a two-layer MLP ``fc2(act(fc1(x)))``: fc1's outputs, fc2's inputs."""
    return UnitGroup(
        kind=NEURONS,
        count=fc1.out_features,
        width=1,
        producers=[LinearRole(fc1, "out")],
        consumer=LinearRole(fc2, "in"),
        module=module,
    )


def gated_neurons(module: nn.Module, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> UnitGroup:
    """The neurons of a gated MLP ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU): neuron j is row j
    of ``gate`` and of ``up`` plus column j of ``down`` (cost 6·D·N)."""
    return UnitGroup(
        kind=NEURONS,
        count=down.in_features,
        width=1,
        producers=[LinearRole(gate, "out"), LinearRole(up, "out")],
        consumer=LinearRole(down, "in"),
        module=module,
        swiglu=True,
    )
