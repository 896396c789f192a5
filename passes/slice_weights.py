"""Pass ``slice-weights``: cut each layer's weights to its kept prefix of units."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from elastic_export.passes.base import PassContext, constants, feature_positions, kv_kept, register_pass


def _take(const: gs.Constant, idx: np.ndarray, axis: int) -> None:
    const.values = np.ascontiguousarray(np.take(np.asarray(const.values), idx, axis=axis))


@register_pass("slice-weights")
def slice_weights(graph: gs.Graph, ctx: PassContext) -> gs.Graph:
    """For every layer and kind that keeps 0 < k < count units: producer weights keep the output
    features of the first k units (every packed group: fused qkv, packed GLU), their biases too,
    the consumer weight keeps the matching input features, and per-unit index initializers
    (``shared_rows``: which rows of a tensor shared by all layers each unit reads) keep k entries.

    Grouped-query attention: the shared key / value producers keep the kv heads the first k query
    heads read, and the index Gathers their first k entries.

    Guarantees: with the head reshapes fixed, the graph computes the dense model with units k.. of
    each layer hard-masked to zero (the dense export put units in rank order).
    """
    consts = constants(graph)
    for i, layer in enumerate(ctx.units):
        for kind in ("heads", "neurons"):
            count, width, k = layer[kind]["count"], layer[kind]["width"], ctx.target(kind, i)
            if k == 0 or k == count:
                continue
            for p in layer[kind]["producers"]:
                idx = feature_positions(k, count, width, p["groups"])
                _take(consts[p["weight"]], idx, p["axis"])
                if p["bias"] is not None:
                    _take(consts[p["bias"]], idx, 0)
            for ix in layer[kind].get("shared_rows", []):  # rows of a shared tensor (MPNet position bias)
                _take(consts[ix["index"]], np.arange(k), 0)
            c = layer[kind]["consumer"]
            _take(consts[c["weight"]], feature_positions(k, count, width), c["axis"])
            if "kv" in layer[kind]:
                _slice_shared(consts, layer[kind]["kv"], k, width)
            ctx.log.append(f"layer {i}: {kind} {count} -> {k}")
    return graph


def _slice_shared(consts: dict, kv: dict, k: int, width: int) -> None:
    """Shared key / value heads of k kept query heads: their producers keep the first m(k) kv heads
    (:func:`kv_kept`), and the query -> kv index its first k entries (all below m(k))."""
    m = kv_kept(kv, k)
    for p in kv["producers"]:
        idx = feature_positions(m, kv["count"], width, p["groups"])
        _take(consts[p["weight"]], idx, p["axis"])
        if p["bias"] is not None:
            _take(consts[p["bias"]], idx, 0)
    consts[kv["indices"]].values = np.asarray(kv["index"][:k], dtype=np.int64)
