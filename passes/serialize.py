"""Write an onnx-graphsurgeon graph straight to an ONNX file, without copying its weights.

``gs.export_onnx`` + ``onnx.save`` copy every weight three times (numpy -> TensorProto ->
GraphProto -> serialised bytes) before one write. A budget's file differs from the dense file only
in its sliced weights, so :func:`save_graph` writes the small part of the model (nodes, inputs,
outputs, metadata) through protobuf and appends each initializer as its own ``GraphProto``
``initializer`` record: a numpy array goes to the file from its own memory, and a weight the passes
left untouched (still the dense model's ``TensorProto``) is serialised once and reused for every
budget through a :class:`TensorCache`.

The file is an ordinary ONNX protobuf: fields may come in any order and a repeated field's
elements may be appended anywhere (the protobuf encoding rules every parser follows), so
``onnx.load``, onnxruntime and TensorRT read it as they read ``onnx.save``'s output; the tests
check that it loads back equal to ``gs.export_onnx`` of the same graph.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues

_MODEL_GRAPH = 7  # ModelProto.graph
_GRAPH_INITIALIZER = 5  # GraphProto.initializer
_TENSOR_RAW_DATA = 9  # TensorProto.raw_data
_LENGTH_DELIMITED = 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field_header(number: int, length: int) -> bytes:
    """Tag and length of a length-delimited protobuf field."""
    return _varint(number << 3 | _LENGTH_DELIMITED) + _varint(length)


class TensorCache:
    """Serialised ``TensorProto`` records of weights shared by many graphs (keyed by the proto)."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[onnx.TensorProto, bytes]] = {}

    def record(self, proto: onnx.TensorProto) -> bytes:
        hit = self._records.get(id(proto))
        if hit is None or hit[0] is not proto:
            hit = (proto, proto.SerializeToString())
            self._records[id(proto)] = hit
        return hit[1]


def _nbytes(piece: bytes | memoryview) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _initializer_pieces(const: gs.Constant, cache: TensorCache) -> list[bytes | memoryview]:
    """The bytes of one ``GraphProto.initializer`` record, as pieces to write in order."""
    values = const._values
    if isinstance(values, LazyValues) and values.tensor.name == const.name:
        body = [cache.record(values.tensor)]
    else:
        array = np.asarray(const.values)
        if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            array = array.copy(order="C")
        if array.dtype.byteorder == ">" or array.dtype == object:
            body = [OnnxExporter.export_tensor_proto(const).SerializeToString()]
        else:
            head = onnx.TensorProto(name=const.name, dims=array.shape,
                                    data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
            if const.data_location is not None:
                head.data_location = const.data_location
            raw = memoryview(array.reshape(-1)).cast("B")
            body = [head.SerializeToString(), _field_header(_TENSOR_RAW_DATA, raw.nbytes), raw]
    size = sum(_nbytes(b) for b in body)
    return [_field_header(_GRAPH_INITIALIZER, size)] + body


def model_skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """Everything of ``model`` but its graph (opsets, producer, metadata, functions)."""
    skeleton = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name == "graph":
            continue
        repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones have label only
        if repeated if repeated is not None else field.label == field.LABEL_REPEATED:
            getattr(skeleton, field.name).extend(value)
        elif field.message_type is not None:
            getattr(skeleton, field.name).CopyFrom(value)
        else:
            setattr(skeleton, field.name, value)
    return skeleton


def save_graph(graph: gs.Graph, skeleton: onnx.ModelProto, path: str | Path, cache: TensorCache | None = None) -> None:
    """Write ``graph`` as the graph of ``skeleton`` (a model without a graph) to ``path``.

    Args:
        graph: the graph to write (no value_info is written; onnxruntime infers shapes itself).
        skeleton: model-level fields: ir_version, opset imports, producer, metadata.
        path: the ``.onnx`` file (under 2 GiB: protobuf's limit, as for ``onnx.save``).
        cache: serialised records of untouched weights, shared across calls.
    """
    cache = cache or TensorCache()
    small = onnx.helper.make_graph(
        nodes=[OnnxExporter.export_node(n) for n in graph.nodes],
        name=graph.name,
        inputs=[OnnxExporter.export_value_info_proto(t, True) for t in graph.inputs],
        outputs=[OnnxExporter.export_value_info_proto(t, True) for t in graph.outputs],
        doc_string=graph.doc_string,
    ).SerializeToString()
    pieces: list[bytes | memoryview] = []
    for t in graph.tensors().values():
        if isinstance(t, gs.Constant):
            pieces += _initializer_pieces(t, cache)
    graph_size = len(small) + sum(_nbytes(p) for p in pieces)
    if graph_size + skeleton.ByteSize() >= 2**31:
        raise ValueError(f"{path}: model over 2 GiB; protobuf cannot hold it in one file")
    with open(path, "wb") as f:
        f.write(skeleton.SerializeToString())
        f.write(_field_header(_MODEL_GRAPH, graph_size))
        f.write(small)
        for p in pieces:
            f.write(p)
