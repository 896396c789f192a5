"""Pass interface, registry and the verifying pass pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elastic_export.errors import UserError


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
    """The checks every pass must leave true: a valid ONNX model with no 0-sized tensor."""
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise RuntimeError(f"pass {after!r} produced an invalid graph: {str(e).splitlines()[0]}") from e
    for t in model.graph.initializer:
        if 0 in t.dims:
            raise RuntimeError(f"pass {after!r} left a 0-sized tensor {t.name}")


def run_passes(model: onnx.ModelProto, names: list[str], ctx: PassContext, check: bool = True) -> onnx.ModelProto:
    """Run the named passes in order, verifying the graph after each one.

    Args:
        model: input model (not modified).
        names: registered pass names.
        ctx: the unit map and target counts.
        check: run :func:`verify` between passes (always after the last one).
    """
    graph = gs.import_onnx(model)
    out = model
    for i, name in enumerate(names):
        if name not in PASSES:
            raise KeyError(f"unknown pass {name!r}; known: {', '.join(PASSES)}")
        graph = PASSES[name].run(graph, ctx)
        if check or i == len(names) - 1:
            out = gs.export_onnx(graph)
            verify(out, name)
    return out


def slice_model(dense: onnx.ModelProto, heads: list[int], neurons: list[int], names: list[str] | None = None) -> onnx.ModelProto:
    """Dense rank-permuted ONNX -> the ONNX of one budget (per-layer head and neuron counts).

    The result keeps the dense model's opset, inputs, outputs and metadata; its unit map is
    updated to the new counts, and shapes are inferred afresh.
    """
    from elastic_export.export import get_units, set_units
    from elastic_export.passes import BUDGET_PIPELINE

    try:
        units = get_units(dense)
    except (ValueError, KeyError) as e:
        raise UserError(f"corrupt elastic-export unit map in the ONNX model ({e})")
    if len(heads) != len(units) or len(neurons) != len(units):
        raise UserError(f"plan has {len(heads)} layers but the ONNX model has {len(units)}")
    for i, layer in enumerate(units):
        for kind, want in (("heads", heads[i]), ("neurons", neurons[i])):
            if not 0 <= want <= layer[kind]["count"]:
                raise UserError(f"layer {i} has {layer[kind]['count']} {kind}; cannot keep {want}")
    ctx = PassContext(units, list(heads), list(neurons))
    out = run_passes(dense, names or BUDGET_PIPELINE, ctx)
    del out.graph.value_info[:]
    new_units = []
    for i, layer in enumerate(units):
        entry = {}
        for kind in ("heads", "neurons"):
            entry[kind] = dict(layer[kind], count=ctx.target(kind, i)) if ctx.target(kind, i) else {"count": 0, "width": layer[kind]["width"]}
        new_units.append(entry)
    set_units(out, new_units)
    out = onnx.shape_inference.infer_shapes(out, strict_mode=True)
    return out


def feature_positions(units: int, count: int, width: int, groups: int = 1) -> np.ndarray:
    """Feature positions of the first ``units`` units on an axis laid out as (groups, count, width)."""
    per = np.arange(units * width)
    return np.concatenate([g * count * width + per for g in range(groups)])
