"""One elastic ONNX graph for every budget: weights stored once, a ``budget_index`` input selects.

The dense export is rank-permuted, so every budget keeps a per-layer *prefix* of each layer's heads
and neurons (DESIGN.md invariant 1). The elastic graph keeps the dense weights once and, per layer,
holds a small constant table of what each budget keeps; ``Gather(table, budget)`` picks the row of
the budget asked for, ``Slice`` cuts the weight (and bias) prefixes at run time, and the attention
reshapes take the gathered head count.

Interface: one extra graph input ``budget_index`` (int64, shape ``[1]``), the position of the
budget in the list the graph was built from (the manifest's ``budgets`` order). Negative values
count from the end (ONNX ``Gather`` semantics: ``-1`` is the last budget); anything outside
``[-B, B-1]`` makes onnxruntime's bounds-checked ``Gather`` fail the run (INVALID_ARGUMENT) rather
than compute some other budget. Backends that do not bounds-check ``Gather`` (TensorRT) must be
given valid indices.

Zero widths: a sub-block that keeps 0 units at some budget still computes one unit there (no
0-sized MatMul, no 0-head reshape), but its consumer projection reads a block of zero rows stored
after the real ones (one unit's worth, e.g. ``d_h × D``), so the sub-block contributes exactly its
output bias, as in the hard-masked model. The extra work is one unit's; the extra storage one unit's
consumer rows per such sub-block. (A non-finite activation of that unit would turn ``0·inf`` into
NaN; finite inputs never do.)

Passes (registered like the per-budget ones; run by :func:`build_elastic_model`):
``budget-input`` → ``elastic-slice-weights`` → ``elastic-head-reshapes`` → ``cleanup``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import BUDGET_INPUT
from elastic_export.passes.base import PassContext, constants, kv_kept, nodes_by_name, register_pass, run_passes
from elastic_export.passes.head_reshapes import shape_rank

ELASTIC_KEY = "elastic_export.elastic"
BUDGET = "elastic/budget"
ELASTIC_PIPELINE = ["budget-input", "elastic-slice-weights", "elastic-head-reshapes", "cleanup"]


@dataclass
class ElasticContext(PassContext):
    """A :class:`PassContext` for the elastic graph: per-budget tables instead of one budget.

    Args:
        units: the dense model's unit map.
        heads: per layer, the most heads any budget keeps.
        neurons: per layer, the most neurons any budget keeps.
        heads_table: ``heads_table[b][layer]``, heads budget ``b`` keeps.
        neurons_table: ``neurons_table[b][layer]``, neurons budget ``b`` keeps.
        budget_input: name of the int64 ``[1]`` graph input that selects the budget.
    """

    heads_table: list[list[int]] = field(default_factory=list)
    neurons_table: list[list[int]] = field(default_factory=list)
    budget_input: str = BUDGET_INPUT

    def column(self, kind: str, layer: int) -> np.ndarray:
        """Units of ``kind`` that layer ``layer`` keeps, one entry per budget."""
        table = self.heads_table if kind == "heads" else self.neurons_table
        return np.array([row[layer] for row in table], dtype=np.int64)

    @property
    def n_budgets(self) -> int:
        return len(self.heads_table)


def _select(graph: gs.Graph, rows: np.ndarray, name: str) -> gs.Tensor:
    """The row of ``rows`` (one per budget) that the budget input selects.

    A table whose rows are all equal becomes a constant; otherwise ``Gather(table, budget)``.
    Identical tables share one Gather (named by the table's digest).
    """
    rows = np.asarray(rows, dtype=np.int64)
    if (rows == rows[0]).all():
        return gs.Constant(f"{name}/const", np.ascontiguousarray(rows[0]))
    key = hashlib.sha1(rows.tobytes() + str(rows.shape).encode()).hexdigest()[:12]
    out_name = f"elastic/select_{key}"
    tensors = graph.tensors()
    if out_name in tensors:
        return tensors[out_name]
    out = gs.Variable(out_name, dtype=np.int64, shape=list(rows.shape[1:]))
    table = gs.Constant(f"elastic/table_{key}", np.ascontiguousarray(rows))
    graph.nodes.append(gs.Node("Gather", f"elastic/Gather_{key}", {"axis": 0}, [table, tensors[BUDGET]], [out]))
    return out


def _replace_uses(tensor: gs.Tensor, new: gs.Tensor, nodes: list[gs.Node]) -> None:
    """Make ``nodes`` (the uses of ``tensor`` before the new Slice was added) read ``new``."""
    for node in nodes:
        for k, t in enumerate(node.inputs):
            if t is tensor:
                node.inputs[k] = new


def _slice(graph: gs.Graph, data: gs.Constant, starts: gs.Tensor, ends: gs.Tensor, axis: int, name: str) -> gs.Variable:
    out = gs.Variable(f"{name}/sliced", dtype=data.values.dtype)
    axes = graph.tensors().get(f"elastic/axes_{axis}") or gs.Constant(f"elastic/axes_{axis}", np.array([axis], dtype=np.int64))
    graph.nodes.append(gs.Node("Slice", f"{name}/Slice", inputs=[data, starts, ends, axes], outputs=[out]))
    return out


def _reshape(graph: gs.Graph, data: gs.Variable, shape: list[int], name: str) -> gs.Variable:
    out = gs.Variable(f"{name}/flat", dtype=data.dtype)
    shape_c = gs.Constant(f"{name}/flat_shape", np.array(shape, dtype=np.int64))
    graph.nodes.append(gs.Node("Reshape", f"{name}/Reshape", inputs=[data, shape_c], outputs=[out]))
    return out


def _varies(ctx: ElasticContext, kind: str, layer: int) -> bool:
    """Whether some budget keeps fewer than all units of ``kind`` in ``layer``."""
    return bool((ctx.column(kind, layer) < ctx.units[layer][kind]["count"]).any())


@register_pass("budget-input")
def budget_input(graph: gs.Graph, ctx: ElasticContext) -> gs.Graph:
    """Adds the graph input ``ctx.budget_input`` (int64, shape ``[1]``) after the model's own
    inputs, and the scalar ``elastic/budget`` = ``Gather(arange(B), Squeeze(budget_index))``.

    Guarantees: every table lookup reads ``elastic/budget``, so an index outside ``[-B, B-1]`` is
    refused by this one Gather, and a negative index counts from the end.
    """
    if any(t.name == ctx.budget_input for t in graph.inputs) or ctx.budget_input in graph.tensors():
        raise UserError(f"the model already has a tensor named {ctx.budget_input!r}")
    idx = gs.Variable(ctx.budget_input, dtype=np.int64, shape=[1])
    graph.inputs.append(idx)
    scalar = gs.Variable(f"{BUDGET}/scalar", dtype=np.int64, shape=[])
    axes = gs.Constant(f"{BUDGET}/squeeze_axes", np.array([0], dtype=np.int64))
    graph.nodes.append(gs.Node("Squeeze", f"{BUDGET}/Squeeze", inputs=[idx, axes], outputs=[scalar]))
    budget = gs.Variable(BUDGET, dtype=np.int64, shape=[])
    arange = gs.Constant(f"{BUDGET}/indices", np.arange(ctx.n_budgets, dtype=np.int64))
    graph.nodes.append(gs.Node("Gather", f"{BUDGET}/Check", {"axis": 0}, [arange, scalar], [budget]))
    return graph.toposort()


def _slice_shared_rows(graph: gs.Graph, consts: dict, indices: list[dict], k: np.ndarray, zero: gs.Constant,
                   name: str) -> None:
    """Per-unit index initializers (rows of a tensor shared by all layers) -> a ``Slice`` of their
    first ``max(k, 1)`` entries (the units the producers compute at each budget)."""
    if not indices:
        return
    end = _select(graph, np.maximum(k, 1)[:, None], f"{name}/index_end")
    for ix in indices:
        const = consts[ix["index"]]
        uses = list(const.outputs)
        _replace_uses(const, _slice(graph, const, zero, end, 0, f"elastic/{ix['index']}"), uses)


def _slice_producer(graph: gs.Graph, consts: dict, p: dict, features: int, end: gs.Tensor, zero: gs.Constant) -> None:
    """Replace a producer's weight and bias by a ``Slice`` of their first ``end`` unit features in
    every packed group (the stored weight is reshaped to expose the group axis)."""
    g, axis = p["groups"], p["axis"]
    for tname, ax in ((p["weight"], axis), (p["bias"], 0)):
        if tname is None:
            continue
        const = consts[tname]
        values = np.asarray(const.values)
        if g > 1:  # expose the group axis: (..., g, count·width, ...)
            shape = list(values.shape)
            const.values = np.ascontiguousarray(values.reshape(shape[:ax] + [g, features] + shape[ax + 1:]))
        uses = list(const.outputs)
        out = _slice(graph, const, zero, end, ax + (1 if g > 1 else 0), f"elastic/{tname}")
        if g > 1:
            flat = [0, -1] if ax == 1 else ([-1, values.shape[1]] if values.ndim == 2 else [-1])
            out = _reshape(graph, out, flat, f"elastic/{tname}")
        _replace_uses(const, out, uses)


def _slice_shared(graph: gs.Graph, consts: dict, kv: dict, k: np.ndarray, width: int, name: str,
                  zero: gs.Constant) -> None:
    """Shared key / value heads per budget: the producers keep the first m kv heads and the index
    Gathers read the first ``max(k, 1)`` entries of the query -> kv index, with m the kv heads
    those query heads read (``max(k, 1)``: the one computed head of an emptied sub-block)."""
    kept = np.maximum(k, 1)
    m = np.array([kv_kept(kv, int(n)) for n in kept], dtype=np.int64)
    end = _select(graph, (m * width)[:, None], f"{name}/kv_end")
    for p in kv["producers"]:
        _slice_producer(graph, consts, p, kv["count"] * width, end, zero)
    const = consts[kv["indices"]]
    uses = list(const.outputs)
    out = _slice(graph, const, zero, _select(graph, kept[:, None], f"{name}/kv_index_end"), 0, f"elastic/{kv['indices']}")
    _replace_uses(const, out, uses)


@register_pass("elastic-slice-weights")
def elastic_slice_weights(graph: gs.Graph, ctx: ElasticContext) -> gs.Graph:
    """For every layer and kind where some budget keeps k < count units: each producer weight
    (and bias) is replaced by a ``Slice`` of its first ``max(k, 1)`` units in every packed group
    (fused qkv, packed GLU: the stored weight is reshaped to expose the group axis), and the
    consumer weight by a ``Slice`` of the matching input rows, where the table gives k per budget;
    per-unit index initializers (``shared_rows``) by a ``Slice`` of their first ``max(k, 1)`` entries.

    Grouped-query attention: the shared key / value producers keep the kv heads the first
    ``max(k, 1)`` query heads read, and the index Gathers that many entries of the index.

    Where some budget keeps k = 0, the consumer weight gets one unit's worth of zero rows appended,
    and that budget slices exactly those rows: the sub-block then adds exactly 0 before its output
    bias, with no 0-sized tensor anywhere.

    Guarantees: at budget b the graph computes the dense model with units ``k_b..`` of each layer
    hard-masked (given the head reshapes of ``elastic-head-reshapes``).
    """
    consts = constants(graph)
    zero = gs.Constant("elastic/zero", np.array([0], dtype=np.int64))
    for i, layer in enumerate(ctx.units):
        for kind in ("heads", "neurons"):
            if not _varies(ctx, kind, i):
                continue
            count, width = layer[kind]["count"], layer[kind]["width"]
            k = ctx.column(kind, i)
            end = _select(graph, (np.maximum(k, 1) * width)[:, None], f"elastic/l{i}/{kind}/end")
            for p in layer[kind]["producers"]:
                _slice_producer(graph, consts, p, count * width, end, zero)
            if "kv" in layer[kind]:
                _slice_shared(graph, consts, layer[kind]["kv"], k, width, f"elastic/l{i}/{kind}", zero)
            _slice_shared_rows(graph, consts, layer[kind].get("shared_rows", []), k, zero, f"elastic/l{i}/{kind}")
            c = layer[kind]["consumer"]
            const = consts[c["weight"]]
            starts, ends = np.zeros_like(k), k * width
            if (k == 0).any():
                values = np.asarray(const.values)
                pad_shape = list(values.shape)
                pad_shape[c["axis"]] = width
                const.values = np.concatenate([values, np.zeros(pad_shape, values.dtype)], axis=c["axis"])
                starts = np.where(k == 0, count * width, 0)
                ends = np.where(k == 0, count * width + width, k * width)
            uses = list(const.outputs)
            start_t = _select(graph, starts[:, None], f"elastic/l{i}/{kind}/consumer_start")
            end_t = _select(graph, ends[:, None], f"elastic/l{i}/{kind}/consumer_end")
            out = _slice(graph, const, start_t, end_t, c["axis"], f"elastic/{c['weight']}")
            _replace_uses(const, out, uses)
            ctx.log.append(f"layer {i}: {kind} {count} -> {k.tolist()} per budget")
    return graph.toposort()


@register_pass("elastic-head-reshapes")
def elastic_head_reshapes(graph: gs.Graph, ctx: ElasticContext) -> gs.Graph:
    """For every layer where some budget keeps fewer than all heads: each q/k/v split Reshape
    reads its shape ``[0, 0, h, d]`` (fused qkv: ``[0, 0, 3, h, d]``; shared key / value heads:
    ``[0, 0, m, d]``, m the kv heads those h query heads read) and the merge Reshape ``[0, 0, h·d]``
    from a per-budget table, with ``h = max(kept heads, 1)`` (the slice width of
    ``elastic-slice-weights``). Layers every budget keeps whole stay as exported.
    """
    nodes = nodes_by_name(graph)
    for i, layer in enumerate(ctx.units):
        if not _varies(ctx, "heads", i):
            continue
        d = layer["heads"]["width"]
        h = np.maximum(ctx.column("heads", i), 1)
        zeros = np.zeros_like(h)
        kv = layer["heads"].get("kv")
        m = np.array([kv_kept(kv, int(n)) for n in h], dtype=np.int64) if kv else None
        split = [(p, h) for p in layer["heads"]["producers"]] + [(p, m) for p in (kv["producers"] if kv else [])]
        for j, (p, n) in enumerate(split):
            node = nodes[p["reshape"]]
            cols = [zeros, zeros] + ([np.full_like(h, p["groups"])] if p["groups"] > 1 else []) + [n, np.full_like(h, d)]
            rank = shape_rank(node)
            if rank is not None and rank != len(cols):
                raise RuntimeError(f"layer {i}: split reshape {node.name} has rank {rank}, expected {len(cols)}")
            node.inputs[1] = _select(graph, np.stack(cols, axis=1), f"elastic/l{i}/split_shape_{j}")
        merge = nodes[layer["heads"]["consumer"]["reshape"]]
        merge.inputs[1] = _select(graph, np.stack([zeros, zeros, h * d], axis=1), f"elastic/l{i}/merge_shape")
    return graph.toposort()


def build_elastic_model(dense: onnx.ModelProto, heads: list[list[int]], neurons: list[list[int]],
                        budget_input: str = BUDGET_INPUT) -> onnx.ModelProto:
    """Dense rank-permuted ONNX -> one ONNX whose ``budget_input`` selects among the budgets.

    Args:
        dense: the dense export (with its unit map in ``metadata_props``); not modified.
        heads: ``heads[b][layer]``, heads budget ``b`` keeps in each layer.
        neurons: ``neurons[b][layer]``, neurons budget ``b`` keeps in each layer.
        budget_input: name of the extra int64 input of shape ``[1]``: the budget's index into
            ``heads`` / ``neurons`` (the manifest's ``budgets`` order).

    Returns:
        The elastic model: the dense model's inputs plus ``budget_input``, the same outputs, the
        weights once (plus one unit of zero rows per sub-block that some budget empties), checked
        with ``onnx.checker`` (full check). Its metadata (``elastic_export.elastic``) holds the
        budget input name and both tables; it has no unit map (it is not sliced further).

    Raises:
        UserError: no budgets, tables of the wrong shape, or counts outside ``[0, count]``.
    """
    from elastic_export.core.unit_map import UNITS_KEY
    from elastic_export.passes.base import dense_units

    units = dense_units(dense)
    if not heads or len(heads) != len(neurons):
        raise UserError(f"need one head and one neuron plan per budget (got {len(heads)} and {len(neurons)})")
    for b, (hb, nb) in enumerate(zip(heads, neurons)):
        if len(hb) != len(units) or len(nb) != len(units):
            raise UserError(f"budget {b}: plan has {len(hb)}/{len(nb)} layers but the ONNX model has {len(units)}")
        for i, layer in enumerate(units):
            for kind, want in (("heads", hb[i]), ("neurons", nb[i])):
                if not 0 <= int(want) <= layer[kind]["count"]:
                    raise UserError(f"budget {b}: layer {i} has {layer[kind]['count']} {kind}; cannot keep {want}")
    heads = [[int(x) for x in row] for row in heads]
    neurons = [[int(x) for x in row] for row in neurons]
    ctx = ElasticContext(units, [max(c) for c in zip(*heads)], [max(c) for c in zip(*neurons)],
                         heads_table=heads, neurons_table=neurons, budget_input=budget_input)
    out = run_passes(dense, ELASTIC_PIPELINE, ctx)
    del out.graph.value_info[:]
    keep = [p for p in out.metadata_props if p.key != UNITS_KEY]
    del out.metadata_props[:]
    out.metadata_props.extend(keep)
    entry = out.metadata_props.add()
    entry.key = ELASTIC_KEY
    entry.value = json.dumps({"budget_input": budget_input, "heads": heads, "neurons": neurons}, sort_keys=True)
    out = onnx_io.infer_shapes(out, strict_mode=True)
    onnx_io.check(out, full_check=True)
    return out


def dense_counts(dense: onnx.ModelProto) -> tuple[list[int], list[int]]:
    """Per layer, every head and every neuron of the dense model: the table row of the elastic
    graph's dense index (sparsity 0.0), to append after the budgets' rows."""
    from elastic_export.passes.base import dense_units

    units = dense_units(dense)
    return [layer["heads"]["count"] for layer in units], [layer["neurons"]["count"] for layer in units]


def get_elastic(model: onnx.ModelProto) -> dict:
    """The ``elastic_export.elastic`` metadata of an elastic model: budget_input, heads, neurons."""
    for p in model.metadata_props:
        if p.key == ELASTIC_KEY:
            return json.loads(p.value)
    raise UserError("this ONNX model is not an elastic-export elastic graph (no budget tables)")
