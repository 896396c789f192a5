"""Pass ``fix-head-reshapes``: write each layer's explicit head count into its attention reshapes."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from elastic_export.passes.base import PassContext, kv_kept, nodes_by_name, register_pass


def shape_rank(node: gs.Node) -> int | None:
    shape = node.inputs[1]
    if isinstance(shape, gs.Constant):
        return int(np.asarray(shape.values).size)
    if shape.shape is not None and len(shape.shape) == 1 and isinstance(shape.shape[0], int):
        return shape.shape[0]
    if shape.inputs and shape.inputs[0].op == "Concat":
        return len(shape.inputs[0].inputs)
    return None


@register_pass("fix-head-reshapes")
def fix_head_reshapes(graph: gs.Graph, ctx: PassContext) -> gs.Graph:
    """For every layer that keeps k > 0 heads of width d: each q/k/v split Reshape gets the
    constant shape ``[0, 0, k, d]`` (fused qkv: ``[0, 0, 3, k, d]``) and the merge Reshape before
    the output projection gets ``[0, 0, k·d]``; shared key / value heads (grouped-query attention)
    get ``[0, 0, m, d]``, m the kv heads the k query heads read. No -1 and no shape arithmetic is
    left, so onnxruntime's attention fusion and TensorRT read the head count directly.
    """
    nodes = nodes_by_name(graph)
    for i, layer in enumerate(ctx.units):
        heads = layer["heads"]
        k, d = ctx.target("heads", i), heads["width"]
        if k == 0:
            continue
        kv = heads.get("kv")
        split = [(p, k) for p in heads["producers"]] + [(p, kv_kept(kv, k)) for p in (kv["producers"] if kv else [])]
        for p, n in split:
            node = nodes[p["reshape"]]
            dims = [0, 0] + ([p["groups"]] if p["groups"] > 1 else []) + [n, d]
            rank = shape_rank(node)
            if rank is not None and rank != len(dims):
                raise RuntimeError(f"layer {i}: split reshape {node.name} has rank {rank}, expected {len(dims)}")
            node.inputs[1] = gs.Constant(f"{node.name}/heads_shape", np.array(dims, dtype=np.int64))
        merge = nodes[heads["consumer"]["reshape"]]
        merge.inputs[1] = gs.Constant(f"{merge.name}/heads_shape", np.array([0, 0, k * d], dtype=np.int64))
    return graph
