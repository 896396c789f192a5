"""Pass ``cleanup``: remove what no output needs and sort the graph."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from elastic_export.passes.base import PassContext, register_pass


@register_pass("cleanup")
def cleanup(graph: gs.Graph, ctx: PassContext) -> gs.Graph:
    """Dead nodes and initializers are removed, graph inputs are kept (a model's interface never
    changes with the budget), and nodes are topologically sorted."""
    return graph.cleanup(remove_unused_graph_inputs=False).toposort()
