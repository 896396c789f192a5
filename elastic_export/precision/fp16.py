"""FP16 artifacts: an fp32 ONNX model -> a mixed-precision ONNX model with fp16 types and explicit Casts.

TensorRT's *strongly typed* mode (TensorRT 11 has no FP16 builder flag) and onnxruntime's CUDA
execution provider both run a model in the precision its ONNX types say, so the conversion must
write the precision into the graph. The conversion is onnxruntime's float16 converter
(``onnxruntime.transformers.float16``, the maintained fork of onnxconverter-common's; the
onnxconverter-common 1.16 converter leaves the exporter's ``Cast(to=FLOAT)`` nodes untouched, which
makes an invalid graph for every model here) with a block list, followed by a small
onnx-graphsurgeon clean-up:

* **fp16**: every MatMul / Gemm / Conv, their weights, the element-wise ops, GELU (Erf), the
  attention-mask arithmetic.
* **fp32** (a Cast to fp32 before, a Cast to fp16 after): ``LayerNormalization`` (and the
  ``ReduceMean`` / ``Pow`` / ``Sqrt`` of decomposed norms), ``Softmax``, every reduction, and the
  whole *tail* after the last ``LayerNormalization``: token pooling, the classifier / projection
  head and the final L2 normalisation. Their weights (norm gamma / beta, head weights) stay fp32.
  Norms and softmax sum many terms and overflow or lose too much precision in fp16; the tail is
  where the embedding the user compares is made, and it is cheap.
* **I/O**: int64 token inputs stay int64; float inputs (``pixel_values``) and every output stay
  **fp32** (a Cast to fp16 right after the input; the outputs come out of the fp32 tail), so an
  fp16 file is a drop-in replacement for its fp32 file with the same feeds and output types.

The clean-up removes the converter's ``Cast(fp16)`` -> ``Cast(fp32)`` round trips between two fp32
ops (they would round the fp32 tail to fp16 for nothing), sorts the graph, and the result is checked
with ``onnx.checker`` (full check) and strict shape inference.

onnxruntime's CPU execution provider runs these models (it has fp16 kernels for every op left in
fp16 here), so they are tested on any machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from elastic_export.checks.compare import FP16_RTOL, relative_error  # noqa: F401 - fp16's bound
from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.precisions import PRECISIONS

PRECISION_KEY = "elastic_export.precision"  # ONNX metadata key (a file format string, not a module)
FP32_OPS = frozenset({
    "LayerNormalization", "Softmax", "LogSoftmax",
    "ReduceMean", "ReduceSum", "ReduceL2", "ReduceL1", "ReduceSumSquare", "ReduceLogSumExp", "ReduceProd",
    "Pow", "Sqrt", "Reciprocal", "Exp", "Log",
})
"""Op types that always run in fp32: norms, softmax and reductions (they accumulate)."""


def fp16_name(fp32_name: str) -> str:
    """File name of the fp16 twin of an fp32 ONNX file: ``budget_s010.onnx`` -> ``budget_s010.fp16.onnx``."""
    return fp32_name[:-5] + ".fp16.onnx" if fp32_name.endswith(".onnx") else fp32_name + ".fp16.onnx"


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a unique name (the converter's block list works on names)."""
    seen: set[str] = set()
    for i, n in enumerate(model.graph.node):
        if not n.name or n.name in seen:
            n.name = f"{n.name or n.op_type}__{i}"
        seen.add(n.name)


def fp32_tail(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes after the last ``LayerNormalization``: pooling, head, normalisation.

    Args:
        model: a topologically sorted ONNX model.

    Returns:
        The names of every node that depends on the output of the last ``LayerNormalization``
        (empty when the graph has none).
    """
    nodes = list(model.graph.node)
    norms = [i for i, n in enumerate(nodes) if n.op_type == "LayerNormalization"]
    if not norms:
        return set()
    reach = set(nodes[norms[-1]].output)
    tail = set()
    for n in nodes[norms[-1] + 1:]:
        if reach.intersection(n.input):
            tail.add(n.name)
            reach.update(n.output)
    return tail


def _blocked_constants(model: onnx.ModelProto, blocked: set[str], ops: Iterable[str]) -> set[str]:
    """``Constant`` nodes read only by fp32 nodes: they stay fp32 too (e.g. the clip minimum 1e-12
    of the final normalisation, which fp16 would round to its smallest subnormal)."""
    ops = set(ops)
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    out = set()
    for n in model.graph.node:
        if n.op_type != "Constant":
            continue
        users = [u for o in n.output for u in readers.get(o, [])]
        if users and all(u.name in blocked or u.op_type in ops for u in users):
            out.add(n.name)
    return out


def _drop_round_trips(graph: gs.Graph) -> int:
    """Replace ``Cast(to=fp32)(Cast(to=fp16)(x))`` with ``x`` where ``x`` is fp32; returns how many."""
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    count = 0
    for node in list(graph.nodes):
        if node.op != "Cast" or node.attrs.get("to") != f32 or not node.outputs:
            continue
        mid = node.inputs[0]
        if len(mid.inputs) != 1:
            continue
        first = mid.inputs[0]
        if first.op != "Cast" or first.attrs.get("to") != f16:
            continue
        src, out = first.inputs[0], node.outputs[0]
        if src.dtype != np.float32:
            continue
        if out in graph.outputs:
            name = out.name
            out.name = name + "__unused"
            src.name = name
            src.shape = src.shape if src.shape is not None else out.shape
            graph.outputs[graph.outputs.index(out)] = src
        else:
            for consumer in list(out.outputs):
                for k, t in enumerate(consumer.inputs):
                    if t is out:
                        consumer.inputs[k] = src
        node.outputs.clear()
        count += 1
    return count


def check_fp16_model(model: onnx.ModelProto, what: str = "fp16 model") -> None:
    """``onnx.checker`` (full check) and strict shape inference; raises ``RuntimeError`` on failure."""
    try:
        onnx_io.check(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        raise RuntimeError(f"{what}: invalid after fp16 conversion: {first_line(e)}") from e


def to_fp16(model: onnx.ModelProto, fp32_ops: Iterable[str] = FP32_OPS) -> onnx.ModelProto:
    """Convert an fp32 model to fp16 with explicit Casts (see the module docstring for the recipe).

    Args:
        model: an fp32 ONNX model (not modified); metadata (the unit map) is kept.
        fp32_ops: op types kept in fp32 wherever they are.

    Returns:
        The checked mixed-precision model, with ``elastic_export.core.precisions`` = ``fp16`` in its
        metadata.
    """
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    src = onnx.ModelProto()
    src.CopyFrom(model)
    del src.graph.value_info[:]
    name_nodes(src)
    ops = set(DEFAULT_OP_BLOCK_LIST) | set(fp32_ops)
    blocked = fp32_tail(src)
    blocked |= _blocked_constants(src, blocked, ops)
    floats = [v.name for v in list(src.graph.input) + list(src.graph.output)
              if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT]
    src = onnx_io.infer_shapes(src)  # (the converter's own inference cannot take a model over 2 GiB)
    converted = convert_float_to_float16(src, keep_io_types=floats, op_block_list=sorted(ops),
                                         node_block_list=sorted(blocked), disable_shape_infer=True)
    graph = gs.import_onnx(converted)
    _drop_round_trips(graph)
    graph.cleanup(remove_unused_graph_inputs=False).toposort()
    out = gs.export_onnx(graph, do_type_check=True)
    del out.graph.value_info[:]
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    del out.metadata_props[:]
    out.metadata_props.extend(p for p in model.metadata_props if p.key != PRECISION_KEY)
    entry = out.metadata_props.add()
    entry.key, entry.value = PRECISION_KEY, "fp16"
    out.producer_name, out.producer_version = model.producer_name, model.producer_version
    out = onnx_io.infer_shapes(out, strict_mode=True)
    check_fp16_model(out)
    return out


def write_fp16(model: onnx.ModelProto, path: str | Path, external: bool | None = None) -> onnx.ModelProto:
    """Convert ``model`` with :func:`to_fp16` and save it to ``path``.

    Args:
        model: the fp32 model.
        path: where to write the fp16 model.
        external: weights in ``path.data`` (:func:`elastic_export.core.onnx_io.save`; None: by size).

    Returns:
        The fp16 model.
    """
    out = to_fp16(model)
    onnx_io.save(out, path, external)
    return out


def session_error(ref, sess, feeds: dict[str, np.ndarray]) -> float:
    """:func:`relative_error` of the onnxruntime session ``sess`` against ``ref`` on ``feeds`` (at real tokens)."""
    return relative_error(ref.run(None, feeds), sess.run(None, feeds), feeds.get("attention_mask"))


def check_precision(precision: str) -> str:
    """Refuse an unknown ``--precision`` (one-line :class:`UserError`)."""
    if precision not in PRECISIONS:
        raise UserError(f"--precision {precision}: choose from {', '.join(PRECISIONS)}")
    return precision


def add_fp16(model: onnx.ModelProto, directory: str | Path, fp32_name: str,
             feeds: dict[str, np.ndarray] | Sequence[dict[str, np.ndarray]] | None = None,
             rtol: float = FP16_RTOL) -> tuple[str, float | None]:
    """Write the fp16 twin of ``directory/fp32_name`` and, given ``feeds``, check it against the fp32 file.

    Args:
        model: the fp32 model saved as ``fp32_name``.
        directory: the artifact directory (being written).
        fp32_name: the fp32 file's name inside ``directory``.
        feeds: sample inputs (numpy), or several sets of them (e.g. one per budget index of the
            elastic graph); None skips the check.
        rtol: largest allowed :func:`relative_error` of the fp16 outputs (onnxruntime, CPU), over
            every set of feeds.

    Returns:
        (fp16 file name, largest relative error or None when not checked).

    Raises:
        RuntimeError: the fp16 model differs from the fp32 one by more than ``rtol``.
    """
    from elastic_export.checks.compare import twin_scores

    directory = Path(directory)
    name = fp16_name(fp32_name)
    write_fp16(model, directory / name, onnx_io.external_like(directory / fp32_name))
    if feeds is None:
        return name, None
    err = 0.0
    for e in twin_scores(directory, fp32_name, name, [feeds] if isinstance(feeds, dict) else feeds, session_error):
        err = max(err, e)
        if not err <= rtol:
            raise RuntimeError(f"{name}: fp16 outputs differ from {fp32_name} by {err:.2e} (relative), above {rtol:g}")
    return name, err
