"""Pass ``drop-empty-blocks``: a sub-block that keeps 0 units disappears; its output bias stays."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from elastic_export.passes.base import PassContext, constants, register_pass


@register_pass("drop-empty-blocks")
def drop_empty_blocks(graph: gs.Graph, ctx: PassContext) -> gs.Graph:
    """For every layer and kind whose target count is 0, every use of the sub-block's output
    (the consumer projection plus its bias) reads a constant instead: the bias, or zeros.

    Guarantees: the sub-block's MatMuls no longer reach any output (``cleanup`` removes them),
    so no 0-sized MatMul is ever built; the function equals the hard-masked dense model.
    """
    consts = constants(graph)
    tensors = graph.tensors()
    for i, layer in enumerate(ctx.units):
        for kind in ("heads", "neurons"):
            if ctx.target(kind, i) != 0 or layer[kind]["count"] == 0:
                continue
            c = layer[kind]["consumer"]
            out = tensors[c["output"]]
            if c["bias"] is not None:
                value = np.array(consts[c["bias"]].values, copy=True)
            else:
                value = np.zeros(c["out_features"], dtype=np.float32)
            replacement = gs.Constant(f"{c['output']}/empty_{kind}", value)
            if out in graph.outputs:
                raise RuntimeError(f"layer {i} {kind}: sub-block output is a graph output; cannot drop it")
            for node in list(out.outputs):
                for k, t in enumerate(node.inputs):
                    if t is out:
                        node.inputs[k] = replacement
            ctx.log.append(f"layer {i}: dropped {kind}")
    return graph
