"""Dense export: the rank-permuted dense model to ONNX, once, with a map of its units.

The exported graph computes exactly what the original model computes (units are only reordered).
Afterwards every prunable weight is renamed to its torch parameter name (found by value, so the
exporter's own naming does not matter) and the graph carries, in ``metadata_props``
(``elastic_export.units``), where each layer's units live: weight and bias initializers with the
unit axis, the MatMul / Add nodes, and the attention Reshape nodes; for grouped-query attention
also (``heads.kv``) the shared key / value heads: their count, producers, the query -> kv index and
the Gathers that apply it. The passes read only that.
"""

from __future__ import annotations

import copy
import hashlib
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError
from elastic_export.core.unit_map import UNITS_KEY, get_units, set_units  # noqa: F401 (re-exported)
from elastic_export.models.adapters import HEADS, NEURONS, find_blocks
from elastic_export.models.encoder import Encoder
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.reference import permute_units

OPSET = 17
PASS_THROUGH = {"Identity", "Cast", "Dropout"}


def _rms_norm_symbolic(g, x, shape, weight, eps):
    """``aten::rms_norm`` (``F.rms_norm``: timm ``RmsNorm``, ``nn.RMSNorm``), which the TorchScript
    exporter lacks at opset 17: ``x / sqrt(mean(x², normalized dims) + eps) · weight``."""
    from torch.onnx import symbolic_helper as sh

    dims = sh._get_const(shape, "is", "normalized_shape")
    e = torch.finfo(torch.float32).eps if sh._is_none(eps) else sh._get_const(eps, "f", "eps")
    mean = g.op("ReduceMean", g.op("Mul", x, x), axes_i=list(range(-len(dims), 0)), keepdims_i=1)
    y = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, g.op("Constant", value_t=torch.tensor(e, dtype=torch.float32)))))
    return y if sh._is_none(weight) else g.op("Mul", y, weight)


torch.onnx.register_custom_op_symbolic("aten::rms_norm", _rms_norm_symbolic, OPSET)


def permuted_module(encoder: Encoder, ranking: Ranking) -> torch.nn.Module:
    """A copy of the model with every layer's units in rank order."""
    module = copy.deepcopy(encoder.module)
    permute_units(find_blocks(module), ranking)
    return module


def _digest(a: np.ndarray) -> str:
    """A weight's values and shape, hashed from its own memory (no copy of the bytes)."""
    h = hashlib.sha1(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data, usedforsecurity=False)
    h.update(str(a.shape).encode())
    return h.hexdigest()


class _Graph:
    """Small index over an ONNX graph for the post-export analysis."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.inits = {t.name: t for t in g.initializer}
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)

    def rename_input(self, node, old: str, new: str) -> None:
        for k, name in enumerate(node.input):
            if name == old:
                node.input[k] = new
        self.consumers.setdefault(new, []).append(node)
        self.consumers[old] = [n for n in self.consumers.get(old, []) if n is not node]

    def const(self, name: str) -> np.ndarray | None:
        """Value of an initializer or Constant output (through Identity chains), else None."""
        for _ in range(8):
            n = self.producer.get(name)
            if n is None or n.op_type != "Identity":
                break
            name = n.input[0]
        if name in self.inits:
            return numpy_helper.to_array(self.inits[name])
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant":
            return numpy_helper.to_array(n.attribute[0].t)
        return None

    def add_init(self, array: np.ndarray, name: str) -> None:
        t = numpy_helper.from_array(array, name)
        self.model.graph.initializer.append(t)
        self.inits[name] = t


def _own_weight(g: _Graph, by_digest: dict, W: torch.Tensor, name: str) -> tuple:
    """Find the initializer holding ``W`` (as W^T for MatMul or W for Gemm), give it ``name``
    and return (matmul_node, axis_of_output_features)."""
    w = W.detach().cpu().numpy()
    for arr, out_axis in ((w.T, 1), (w, 0)):
        hit = by_digest.get(_digest(arr))
        if hit is None:
            continue
        users = [n for n in g.consumers.get(hit, []) if n.op_type in ("MatMul", "Gemm")]
        if not users:
            continue
        node = users[0]
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            if (out_axis == 0) != bool(trans_b):
                continue
        g.add_init(arr.copy(), name)
        g.rename_input(node, hit, name)
        return node, out_axis
    raise UserError(f"dense export: could not find the weight {name} in the exported graph (unsupported pattern)")


def _bias_after(g: _Graph, node, bias: torch.Tensor | None, name: str) -> tuple[str | None, str]:
    """The Add that applies ``bias`` after ``node``: (add node name or None, output tensor name)."""
    out = node.output[0]
    if node.op_type == "Gemm" or bias is None:
        if node.op_type == "Gemm" and len(node.input) > 2:
            g.add_init(g.const(node.input[2]).copy(), name)
            g.rename_input(node, node.input[2], name)
        return None, out
    b = bias.detach().cpu().numpy()
    for add in g.consumers.get(out, []):
        if add.op_type != "Add":
            continue
        other = [i for i in add.input if i != out][0]
        value = g.const(other)
        if value is not None and value.shape == b.shape and np.array_equal(value, b):
            g.add_init(value.copy(), name)
            g.rename_input(add, other, name)
            return add.name, add.output[0]
    raise UserError(f"dense export: could not find the bias {name} after {node.name} (unsupported pattern)")


def _next_reshape(g: _Graph, tensor: str) -> str:
    for _ in range(4):
        users = g.consumers.get(tensor, [])
        for n in users:
            if n.op_type == "Reshape":
                return n.name
        through = [n for n in users if n.op_type in PASS_THROUGH]
        if not through:
            break
        tensor = through[0].output[0]
    raise UserError(f"dense export: no head-split Reshape after {tensor} (unsupported attention pattern)")


def _prev_reshape(g: _Graph, tensor: str) -> str:
    for _ in range(4):
        n = g.producer.get(tensor)
        if n is None:
            break
        if n.op_type == "Reshape":
            return n.name
        if n.op_type not in PASS_THROUGH:
            break
        tensor = n.input[0]
    raise UserError(f"dense export: no head-merge Reshape before {tensor} (unsupported attention pattern)")


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node of ``graph`` reads, also from inside its subgraphs (an ``If``
    branch reads outer tensors by name, without listing them as inputs)."""
    names = set()
    for n in graph.node:
        names.update(n.input)
        for a in n.attribute:
            for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names |= _read_names(sub)
    return names


def _is_index_gather(g: _Graph, node, value: np.ndarray) -> bool:
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    if node.op_type != "Gather" or axis != 1 or len(node.input) < 2:
        return False
    index = g.const(node.input[1])
    return index is not None and index.shape == value.shape and np.array_equal(index, value)


def _index_gather(g: _Graph, start: str, value: np.ndarray, name: str):
    """The ``Gather(shared, index, axis=1)`` whose constant index is ``value`` and whose output
    meets the attention within a few nodes after the head-split Reshape ``start`` (the layer's
    rows of a tensor shared by all layers, e.g. MPNet's position bias); it gets its own index
    initializer ``name`` (the exporter may share one constant between layers with equal values)."""
    nodes = {n.name: n for n in g.model.graph.node}
    frontier, seen = [nodes[start]], set()
    for _ in range(8):
        nxt = []
        for node in frontier:
            for inp in node.input:
                src = g.producer.get(inp)
                if src is not None and _is_index_gather(g, src, value):
                    g.add_init(value.copy(), name)
                    g.rename_input(src, src.input[1], name)
                    return src
            for out in node.output:
                nxt += [n for n in g.consumers.get(out, []) if n.name not in seen]
        seen.update(n.name for n in nxt)
        frontier = nxt
    raise UserError(f"dense export: no Gather of {name} after {start} (unsupported attention pattern)")


def _producer(g: _Graph, by_digest: dict, role, heads: bool) -> dict:
    """Unit-map entry of one producer layer: its weight, bias, MatMul and (heads) split Reshape."""
    mm, out_axis = _own_weight(g, by_digest, role.linear.weight, f"{role.name}.weight")
    bias = role.bias
    add, out = _bias_after(g, mm, bias, f"{role.name}.bias")
    p = {"weight": f"{role.name}.weight", "axis": out_axis, "groups": role.groups,
         "bias": f"{role.name}.bias" if bias is not None else None, "matmul": mm.name}
    if heads:
        p["reshape"] = _next_reshape(g, out)
    return p


def _kv_gather(g: _Graph, reshape: str, index: np.ndarray) -> object:
    """The Gather (axis 1) that reads the query heads' key / value heads after ``reshape``: the
    first one downstream whose indices are the constant ``index``."""
    node = next(n for n in g.model.graph.node if n.name == reshape)
    frontier, seen = [node.output[0]], set()
    while frontier and len(seen) < 64:
        tensor = frontier.pop(0)
        for n in g.consumers.get(tensor, []):
            if n.name in seen:
                continue
            seen.add(n.name)
            axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
            if n.op_type == "Gather" and n.input[0] == tensor and axis == 1:
                value = g.const(n.input[1])
                if value is not None and value.ndim == 1 and np.array_equal(value, index):
                    return n
            frontier.extend(n.output)
    raise UserError(f"dense export: no key / value head Gather after {reshape} (unsupported attention pattern)")


def _shared_map(g: _Graph, by_digest: dict, grp) -> dict:
    """Unit-map entry of shared key / value heads: their producers, the query -> kv index and the
    Gathers that apply it, which all read one initializer named ``<attention>.kv_index``."""
    kv = grp.kv
    producers = [_producer(g, by_digest, role, True) for role in kv.producers]
    index = np.asarray(kv.index, dtype=np.int64)
    name = f"{kv.producers[0].name.rsplit('.', 1)[0]}.kv_index"
    g.add_init(index.copy(), name)
    gathers = []
    for p in producers:
        node = _kv_gather(g, p["reshape"], index)
        old = node.input[1]
        g.rename_input(node, old, name)
        gathers.append(node.name)
        const = g.producer.get(old)
        if const is not None and const.op_type == "Constant" and not g.consumers.get(old):
            g.model.graph.node.remove(const)  # the exporter's copy of the index, now unread
    return {"count": kv.count, "producers": producers, "index": index.tolist(), "indices": name, "gathers": gathers}


def _unit_map(model: onnx.ModelProto, module: torch.nn.Module) -> list[dict]:
    g = _Graph(model)
    by_digest: dict[str, str] = {}
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        if arr.ndim == 2:
            by_digest.setdefault(_digest(arr), t.name)
    layers = []
    for b in find_blocks(module):
        entry = {}
        for kind in (HEADS, NEURONS):
            grp = b.group(kind)
            producers = [_producer(g, by_digest, role, kind == HEADS) for role in grp.producers]
            c = grp.consumer
            mm, out_axis = _own_weight(g, by_digest, c.linear.weight, f"{c.name}.weight")
            add, out = _bias_after(g, mm, c.linear.bias, f"{c.name}.bias")
            consumer = {"weight": f"{c.name}.weight", "axis": 1 - out_axis, "matmul": mm.name,
                        "bias": f"{c.name}.bias" if c.linear.bias is not None else None, "add": add,
                        "output": out, "out_features": c.linear.out_features}
            if kind == HEADS:
                consumer["reshape"] = _prev_reshape(g, mm.input[0])
            entry[kind] = {"count": grp.count, "width": grp.width, "producers": producers, "consumer": consumer}
            if grp.shared_rows:
                entry[kind]["shared_rows"] = [
                    {"index": ix.name, "gather": _index_gather(g, producers[0].get("reshape") or producers[0]["matmul"],
                                                               ix.value.detach().cpu().numpy(), ix.name).name}
                    for ix in grp.shared_rows]
            if grp.kv is not None:
                entry[kind]["kv"] = _shared_map(g, by_digest, grp)
        layers.append(entry)
    used = _read_names(model.graph)
    dead = [n for n in model.graph.node if n.op_type == "Constant" and not set(n.output) & used]
    for n in dead:  # index constants replaced by a layer's own initializer
        model.graph.node.remove(n)
    keep = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return layers


def _static_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Every tensor's shape as shape inference sees it (None for a symbolic or unknown dim)."""
    g = model.graph
    dims = {t.name: list(t.dims) for t in g.initializer}
    for v in [*g.input, *g.value_info, *g.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            dims[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
    return dims


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove the nodes no other node (or subgraph) and no graph output reads, until none is left."""
    while True:
        read = _read_names(graph) | {o.name for o in graph.output}
        dead = [n for n in graph.node if not set(n.output) & read]
        if not dead:
            return
        for n in dead:
            graph.node.remove(n)


def _drop_empty_inputs(model: onnx.ModelProto) -> None:
    """Drop the ``Concat`` inputs that are empty along its axis, with what only they read, so that the
    dense export holds no 0-sized weight (no budget pass may leave one): ``DINOv3ViTModel`` without
    register tokens concatenates a (batch, 0, D) expansion of its 0-sized ``register_tokens``.

    Raises:
        UserError: a 0-sized weight is still read after that (an unsupported pattern).
    """
    g = model.graph
    if not any(0 in t.dims for t in g.initializer):
        return
    dims = _static_dims(onnx.shape_inference.infer_shapes(onnx_io.weightless(model)))
    for n in g.node:
        if n.op_type != "Concat":
            continue
        axis = next(a.i for a in n.attribute if a.name == "axis")
        keep = [i for i in n.input if not (i in dims and dims[i][axis if axis >= 0 else axis + len(dims[i])] == 0)]
        if keep and len(keep) < len(n.input):
            del n.input[:]
            n.input.extend(keep)
    _drop_dead_nodes(g)
    read = _read_names(g)
    for t in [t for t in g.initializer if 0 in t.dims]:
        if t.name in read:
            raise UserError(f"dense export: the 0-sized weight {t.name} is read other than by a Concat "
                            "(unsupported pattern)")
        g.initializer.remove(t)


def _state_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's parameters and buffers (shared tensors once)."""
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _torch_export(args: tuple, kw: dict, scratch_parent: Path, nbytes: int) -> onnx.ModelProto:
    """``torch.onnx.export`` of ``args`` (module, inputs) with ``kw``, read back as a ``ModelProto``: in
    memory while the weights' ``nbytes`` are below half of :data:`onnx_io.INLINE_LIMIT` (a 436 MB model
    written to disk and parsed back from it cost 2-3 s more; the half leaves room for constants folded
    from the weights), else through a folder of its own (torch writes a model over 2 GiB as one file per
    weight)."""
    import io

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            if 2 * nbytes < onnx_io.INLINE_LIMIT:
                buffer = io.BytesIO()
                torch.onnx.export(*args, buffer, **kw)
                return onnx.load_from_string(buffer.getvalue())
            with tempfile.TemporaryDirectory(prefix=".export.", dir=scratch_parent) as tmp:
                torch.onnx.export(*args, str(Path(tmp) / "model.onnx"), **kw)
                return onnx.load(str(Path(tmp) / "model.onnx"))


def export_dense(encoder: Encoder, ranking: Ranking, path: str | Path, external: bool | None = None) -> onnx.ModelProto:
    """Export the rank-permuted dense model to ``path`` (opset 17, dynamic batch / sequence).

    Args:
        external: weights in ``path.data`` (:mod:`elastic_export.core.onnx_io`): True / False, or None for
            only when they pass protobuf's 2 GiB.

    Returns:
        The saved ONNX model (with the unit map in its metadata; weights in memory either way).
    """
    module = permuted_module(encoder, ranking)
    wrapper = encoder.export_module(module)
    specs = encoder.input_specs()
    feeds = encoder.sample_inputs(batch=2, seq_len=min(encoder.seq_len, 16) if encoder.seq_len else None)
    dynamic = {s.name: {i: d for i, d in enumerate(s.shape) if isinstance(d, str)} for s in specs}
    outputs = encoder.output_names()
    for o in outputs:
        dynamic[o] = {0: "batch", 1: "sequence"} if (encoder.modality == "text" and o == "last_hidden_state") else {0: "batch"}
    path = Path(path)
    args = (wrapper, tuple(feeds[s.name] for s in specs))
    kw = dict(input_names=[s.name for s in specs], output_names=outputs, dynamic_axes=dynamic, opset_version=OPSET,
              do_constant_folding=True, dynamo=False)
    model = _torch_export(args, kw, path.parent, _state_bytes(module))
    _drop_empty_inputs(model)
    layers = _unit_map(model, module)
    del model.graph.value_info[:]
    set_units(model, layers)
    onnx_io.check(model)
    onnx_io.save(model, path, external)
    return model
