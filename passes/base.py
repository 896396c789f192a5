"""Pass interface, registry and the verifying pass pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elastic_export.core.errors import UserError, first_line


@dataclass
class PassContext:
    """What a pass may read: the unit map and the target unit counts per layer.

    Args:
        units: the dense model's unit map (``elastic_export.units``), one dict per layer.
        heads: heads to keep per layer.
        neurons: neurons to keep per layer.
    """

    units: list[dict]
    heads: list[int]
    neurons: list[int]
    log: list[str] = field(default_factory=list)

    def target(self, kind: str, layer: int) -> int:
        return (self.heads if kind == "heads" else self.neurons)[layer]


@dataclass
class Pass:
    """A named graph rewrite. ``run`` mutates and returns the graph."""

    name: str
    run: Callable[[gs.Graph, PassContext], gs.Graph]
    doc: str = ""


PASSES: dict[str, Pass] = {}
#: one budget's passes, in order (registered by the modules of :mod:`elastic_export.passes`)
BUDGET_PIPELINE = ["drop-empty-blocks", "slice-weights", "fix-head-reshapes", "cleanup"]


def register_pass(name: str) -> Callable:
    def deco(fn: Callable[[gs.Graph, PassContext], gs.Graph]) -> Callable:
        PASSES[name] = Pass(name, fn, (fn.__doc__ or "").strip())
        return fn

    return deco


def nodes_by_name(graph: gs.Graph) -> dict[str, gs.Node]:
    return {n.name: n for n in graph.nodes}


def constants(graph: gs.Graph) -> dict[str, gs.Constant]:
    return {name: t for name, t in graph.tensors().items() if isinstance(t, gs.Constant)}


def verify(model: onnx.ModelProto, after: str) -> None:
    """The full check: ``onnx.checker`` accepts the model and no initializer is 0-sized."""
    from elastic_export.core import onnx_io

    try:
        onnx_io.check(model)
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"pass {after!r} produced an invalid graph: {first_line(e)}") from e
    for t in model.graph.initializer:
        if 0 in t.dims:
            raise RuntimeError(f"pass {after!r} left a 0-sized tensor {t.name}")


def verify_graph(graph: gs.Graph, after: str) -> None:
    """The in-memory check every pass must leave true, without serialising the weights.

    Every node input is a graph input, a constant, or the output of exactly one node that comes
    earlier in a topological order (the graph is sorted first if it is not); every graph output
    is produced; every op exists in its domain's registered schemas; no constant is 0-sized.
    """
    if not _sorted_inputs_defined(graph, after, raise_missing=False):
        try:
            graph.toposort()
        except Exception as e:  # a cycle
            raise RuntimeError(f"pass {after!r} left a graph that cannot be sorted ({e})") from e
        _sorted_inputs_defined(graph, after, raise_missing=True)
    produced = {t.name for n in graph.nodes for t in n.outputs} | {t.name for t in graph.inputs}
    for t in graph.outputs:
        if t.name not in produced:
            raise RuntimeError(f"pass {after!r}: graph output {t.name!r} is not produced")


def _sorted_inputs_defined(graph: gs.Graph, after: str, raise_missing: bool) -> bool:
    """One sweep in node order: False when a node reads a tensor no earlier node produced."""
    known = {t.name for t in graph.inputs}
    for n in graph.nodes:
        if not onnx.defs.has(n.op, n.domain or ""):
            raise RuntimeError(f"pass {after!r}: unknown op {n.domain or 'ai.onnx'}::{n.op} ({n.name})")
        for t in n.inputs:
            if isinstance(t, gs.Constant):
                if 0 in t.shape:
                    raise RuntimeError(f"pass {after!r} left a 0-sized tensor {t.name}")
            elif t.name and t.name not in known:
                if raise_missing:
                    raise RuntimeError(f"pass {after!r}: node {n.name} reads {t.name!r}, which nothing produces")
                return False
        for t in n.outputs:
            if t.name in known:
                raise RuntimeError(f"pass {after!r}: tensor {t.name!r} is produced twice")
            known.add(t.name)
    return True


def apply_passes(graph: gs.Graph, names: list[str], ctx: PassContext, check: bool = True) -> gs.Graph:
    """Run the named passes on ``graph`` in order; :func:`verify_graph` after each (``check``) or
    after the last one only."""
    for i, name in enumerate(names):
        if name not in PASSES:
            raise KeyError(f"unknown pass {name!r}; known: {', '.join(PASSES)}")
        graph = PASSES[name].run(graph, ctx)
        if check or i == len(names) - 1:
            verify_graph(graph, name)
    return graph


def run_passes(model: onnx.ModelProto, names: list[str], ctx: PassContext, check: bool = True,
               full_check: bool = True) -> onnx.ModelProto:
    """Run the named passes in order, verifying the graph after each one. The unit map is first
    checked against the graph (:func:`check_unit_map`): a corrupt model is refused before any pass.

    Args:
        model: input model (not modified).
        names: registered pass names.
        ctx: the unit map and target counts.
        check: run :func:`verify_graph` (in memory, cheap) between passes; always after the last.
        full_check: also run :func:`verify` (``onnx.checker``, which serialises the model) on the
            result. Off for the per-budget fast path, where onnxruntime loads every file anyway.
    """
    graph = gs.import_onnx(model)
    check_unit_map(graph, ctx.units)
    out = gs.export_onnx(apply_passes(graph, names, ctx, check))
    if full_check:
        verify(out, names[-1] if names else "none")
    return out


def _budget_context(units: list[dict], heads: list[int], neurons: list[int]) -> PassContext:
    """The pass context of one budget, after checking its counts against the unit map."""
    if len(heads) != len(units) or len(neurons) != len(units):
        raise UserError(f"plan has {len(heads)} layers but the ONNX model has {len(units)}")
    for i, layer in enumerate(units):
        for kind, want in (("heads", heads[i]), ("neurons", neurons[i])):
            if not 0 <= want <= layer[kind]["count"]:
                raise UserError(f"layer {i} has {layer[kind]['count']} {kind}; cannot keep {want}")
    return PassContext(units, list(heads), list(neurons))


def kv_kept(kv: dict, k: int) -> int:
    """Shared key / value heads that the first ``k`` query heads read: ``max(index[:k]) + 1``, since
    the dense export orders them by first use (a prefix of query heads reads a prefix of them)."""
    return int(max(kv["index"][:k])) + 1 if k else 0


def _sliced_units(ctx: PassContext) -> list[dict]:
    """The unit map of a sliced model: each layer's counts become the kept counts."""
    out = []
    for i, layer in enumerate(ctx.units):
        entry = {}
        for kind in ("heads", "neurons"):
            k = ctx.target(kind, i)
            entry[kind] = dict(layer[kind], count=k) if k else {"count": 0, "width": layer[kind]["width"]}
            kv = layer[kind].get("kv") if k else None
            if kv is not None:
                entry[kind]["kv"] = dict(kv, count=kv_kept(kv, k), index=kv["index"][:k])
        out.append(entry)
    return out


_FIX = "the ONNX model is corrupt or was edited after export; export it again"


def _check_counts(units) -> None:
    """Every layer of the unit map has integer head and neuron counts (>= 0) and widths (> 0)."""
    def counted(entry) -> bool:
        return (isinstance(entry, dict) and type(entry.get("count")) is int and entry["count"] >= 0
                and type(entry.get("width")) is int and entry["width"] > 0)

    if not isinstance(units, list) or not all(isinstance(L, dict) and counted(L.get("heads")) and counted(L.get("neurons"))
                                              for L in units):
        raise UserError(f"corrupt elastic-export unit map in the ONNX model (every layer needs integer head and "
                        f"neuron counts and widths); {_FIX}")


def dense_units(dense: onnx.ModelProto) -> list[dict]:
    from elastic_export.core.unit_map import get_units

    try:
        units = get_units(dense)
    except (ValueError, KeyError) as e:
        raise UserError(f"corrupt elastic-export unit map in the ONNX model ({e})")
    _check_counts(units)
    return units


_TENSOR_KEYS = ("weight", "bias")
_NODE_KEYS = ("reshape", "matmul", "add")


def _check_shared(i: int, kv: dict, count: int, tensors: dict, nodes: set) -> None:
    """Shared key / value heads: the index has one entry per query head, each a kv head in order of
    first use (so prefixes nest); the index initializer and its Gathers exist."""
    index = kv["index"]
    firsts = [h for j, h in enumerate(index) if h not in index[:j]]
    if len(index) != count or firsts != list(range(kv["count"])):
        raise UserError(f"layer {i} heads: the key / value index {index} does not fit {count} query heads and "
                        f"{kv['count']} key / value heads in order of first use; {_FIX}")
    if not isinstance(tensors.get(kv["indices"]), gs.Constant):
        raise UserError(f"layer {i} heads: the unit map names index {kv['indices']!r}, which is not a constant "
                        f"of the graph; {_FIX}")
    for name in kv["gathers"]:
        if name not in nodes:
            raise UserError(f"layer {i} heads: the unit map names node {name!r}, which the graph lacks; {_FIX}")


def check_unit_map(graph: gs.Graph, units: list[dict]) -> None:
    """Refuse (one-line :class:`UserError`) a model whose unit map does not describe its graph:
    every layer needs counts and widths, and every weight, bias, node and output it names must
    exist, so that no pass ever meets a missing name half-way through (a corrupt, truncated or
    hand-edited model)."""
    _check_counts(units)
    tensors = graph.tensors()
    nodes = {n.name for n in graph.nodes}
    try:
        for i, layer in enumerate(units):
            for kind in ("heads", "neurons"):
                entry = layer[kind]
                if entry["count"] == 0:
                    continue
                kv = entry.get("kv")
                if kv is not None:
                    _check_shared(i, kv, entry["count"], tensors, nodes)
                for role in [*entry["producers"], entry["consumer"], *(kv["producers"] if kv else [])]:
                    for key in _TENSOR_KEYS:
                        name = role.get(key)
                        if name is not None and not isinstance(tensors.get(name), gs.Constant):
                            raise UserError(f"layer {i} {kind}: the unit map names {key} {name!r}, which is not "
                                            f"a weight of the graph; {_FIX}")
                    for key in _NODE_KEYS:
                        name = role.get(key)
                        if name is not None and name not in nodes:
                            raise UserError(f"layer {i} {kind}: the unit map names node {name!r}, which the graph "
                                            f"lacks; {_FIX}")
                for ix in entry.get("shared_rows", []):
                    if not isinstance(tensors.get(ix["index"]), gs.Constant) or ix["gather"] not in nodes:
                        raise UserError(f"layer {i} {kind}: the unit map names index {ix['index']!r} or node "
                                        f"{ix['gather']!r}, which the graph lacks; {_FIX}")
                out = entry["consumer"].get("output")
                if out is not None and out not in tensors:
                    raise UserError(f"layer {i} {kind}: the unit map names tensor {out!r}, which the graph lacks; {_FIX}")
    except (KeyError, TypeError, AttributeError) as e:
        raise UserError(f"corrupt elastic-export unit map in the ONNX model (missing or bad {e}); {_FIX}") from None


def slice_model(dense: onnx.ModelProto, heads: list[int], neurons: list[int], names: list[str] | None = None,
                full_check: bool = True) -> onnx.ModelProto:
    """Dense rank-permuted ONNX -> the ONNX of one budget (per-layer head and neuron counts).

    The result keeps the dense model's opset, inputs, outputs and metadata; its unit map is
    updated to the new counts. To write many budgets to files, :class:`BudgetSlicer` is faster.

    Args:
        dense: the dense export (with its unit map).
        heads: heads to keep per layer.
        neurons: neurons to keep per layer.
        names: passes to run (default: the budget pipeline).
        full_check: ``onnx.checker`` and strict shape inference on the result (on a weightless
            copy, :func:`elastic_export.core.onnx_io.check`). Every pass is checked in memory either way.
    """
    from elastic_export.core import onnx_io
    from elastic_export.core.unit_map import set_units

    ctx = _budget_context(dense_units(dense), heads, neurons)
    out = run_passes(dense, names or BUDGET_PIPELINE, ctx, full_check=full_check)
    del out.graph.value_info[:]
    set_units(out, _sliced_units(ctx))
    if full_check:
        onnx.shape_inference.infer_shapes(onnx_io.weightless(out), strict_mode=True)  # raises on inconsistent shapes
    return out


class BudgetSlicer:
    """Writes the ONNX file of any number of budgets from one dense model, fast.

    The dense model is imported into onnx-graphsurgeon once; each budget runs the pass pipeline on
    a shallow copy of that graph (weights shared until a pass slices them) and is written by
    :func:`~elastic_export.passes.serialize.save_graph`, which streams sliced weights from their
    own memory and serialises each untouched dense weight once for all budgets. The file loads
    back equal to :func:`slice_model`'s model.

    Args:
        dense: the dense export (with its unit map); not modified.
        names: passes to run (default: the budget pipeline).
        external: weights in ``NAME.onnx.data`` (True / False; None: only above protobuf's 2 GiB).
    """

    def __init__(self, dense: onnx.ModelProto, names: list[str] | None = None, external: bool | None = None) -> None:
        from elastic_export.core.onnx_io import model_skeleton
        from elastic_export.passes.serialize import TensorCache

        self.units = dense_units(dense)
        self.names = list(names or BUDGET_PIPELINE)
        self._graph = gs.import_onnx(dense)
        check_unit_map(self._graph, self.units)
        self._skeleton = model_skeleton(dense)
        self._cache = TensorCache()
        self.external = external

    def save(self, heads: list[int], neurons: list[int], path: str | Path, full_check: bool = False) -> None:
        """Slice one budget and write it to ``path``.

        Args:
            heads: heads to keep per layer.
            neurons: neurons to keep per layer.
            path: the ``.onnx`` file to write.
            full_check: also run ``onnx.checker`` with strict shape inference on the written file.
        """
        from elastic_export.core.unit_map import set_units
        from elastic_export.passes.serialize import save_graph

        ctx = _budget_context(self.units, heads, neurons)
        graph = apply_passes(self._graph.copy(), self.names, ctx, check=True)
        skeleton = onnx.ModelProto()
        skeleton.CopyFrom(self._skeleton)
        set_units(skeleton, _sliced_units(ctx))
        save_graph(graph, skeleton, path, self._cache, self.external)
        if full_check:
            try:
                onnx.checker.check_model(str(path), full_check=True)
            except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
                raise RuntimeError(f"budget file {Path(path).name} is invalid: {first_line(e)}") from e


def feature_positions(units: int, count: int, width: int, groups: int = 1) -> np.ndarray:
    """Feature positions of the first ``units`` units on an axis laid out as (groups, count, width)."""
    per = np.arange(units * width)
    return np.concatenate([g * count * width + per for g in range(groups)])
