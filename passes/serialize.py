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
check that it loads back equal to ``gs.export_onnx`` of the same graph. A model whose weights pass
protobuf's 2 GiB keeps them in ``NAME.onnx.data`` (ONNX external data, :mod:`elastic_export.core.onnx_io`):
the records then hold each tensor's offset and length, and the bytes stream to the data file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues

from elastic_export.core import onnx_io

_TENSOR_RAW_DATA = 9  # TensorProto.raw_data


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


def _raw(const: gs.Constant) -> tuple[onnx.TensorProto, memoryview] | None:
    """Header (name, dims, type) and raw little-endian bytes of a constant; None for types raw data cannot hold."""
    values = const._values
    if isinstance(values, LazyValues) and values.tensor.name == const.name and values.tensor.HasField("raw_data"):
        t = values.tensor
        head = onnx.TensorProto(name=const.name, dims=t.dims, data_type=t.data_type)
        return head, memoryview(t.raw_data)
    array = np.asarray(const.values)
    if array.dtype.byteorder == ">" or array.dtype == object:
        return None
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        array = array.copy(order="C")
    head = onnx.TensorProto(name=const.name, dims=array.shape, data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype))
    return head, memoryview(array.reshape(-1)).cast("B")


def _initializer_pieces(const: gs.Constant, cache: TensorCache) -> list[bytes | memoryview]:
    """The bytes of one ``GraphProto.initializer`` record, as pieces to write in order."""
    values = const._values
    if isinstance(values, LazyValues) and values.tensor.name == const.name:
        body = [cache.record(values.tensor)]
    else:
        parts = _raw(const)
        if parts is None:
            body = [OnnxExporter.export_tensor_proto(const).SerializeToString()]
        else:
            head, raw = parts
            if const.data_location is not None:
                head.data_location = const.data_location
            body = [head.SerializeToString(), onnx_io.field_header(_TENSOR_RAW_DATA, raw.nbytes), raw]
    size = sum(_nbytes(b) for b in body)
    return [onnx_io.field_header(onnx_io.GRAPH_INITIALIZER, size)] + body


class _DataFile:
    """The external data file being written: tensors appended at 4 KiB-aligned offsets."""

    ALIGN = 4096

    def __init__(self, path: Path) -> None:
        self.path, self.name, self.offset = path, path.name, 0
        self._f = open(path, "wb")

    def add(self, head: onnx.TensorProto, raw: memoryview) -> bytes:
        """Append ``raw``; the serialised ``head`` that points at it."""
        pad = -self.offset % self.ALIGN
        self._f.write(b"\0" * pad)
        self.offset += pad
        head.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.name), ("offset", str(self.offset)), ("length", str(raw.nbytes))):
            entry = head.external_data.add()
            entry.key, entry.value = key, value
        self._f.write(raw)
        self.offset += raw.nbytes
        return head.SerializeToString()

    def close(self) -> None:
        self._f.close()


def _external_pieces(const: gs.Constant, cache: TensorCache, data: _DataFile) -> list[bytes | memoryview]:
    """One initializer record whose bytes (``SIZE_THRESHOLD`` or more) go to ``data``; small ones stay inline."""
    parts = _raw(const)
    if parts is None or parts[1].nbytes < onnx_io.SIZE_THRESHOLD:
        return _initializer_pieces(const, cache)
    record = data.add(*parts)
    return [onnx_io.field_header(onnx_io.GRAPH_INITIALIZER, len(record)), record]


def _weight_bytes(graph: gs.Graph) -> int:
    return sum(int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
               for t in graph.tensors().values() if isinstance(t, gs.Constant))


def save_graph(graph: gs.Graph, skeleton: onnx.ModelProto, path: str | Path, cache: TensorCache | None = None,
               external: bool | None = None) -> bool:
    """Write ``graph`` as the graph of ``skeleton`` (a model without a graph) to ``path``.

    Args:
        graph: the graph to write (no value_info is written; onnxruntime infers shapes itself).
        skeleton: model-level fields: ir_version, opset imports, producer, metadata.
        path: the ``.onnx`` file.
        cache: serialised records of untouched weights, shared across calls.
        external: weights to ``path.data`` (ONNX external data): True, False, or None for
            :func:`elastic_export.core.onnx_io.needs_external` by size (a protobuf holds at most 2 GiB).

    Returns:
        True when an external data file was written.
    """
    cache = cache or TensorCache()
    path = Path(path)
    data_path = path.with_name(onnx_io.data_name(path.name))
    data_path.unlink(missing_ok=True)
    data = _DataFile(data_path) if onnx_io.needs_external(_weight_bytes(graph), external) else None
    small = onnx.helper.make_graph(
        nodes=[OnnxExporter.export_node(n) for n in graph.nodes],
        name=graph.name,
        inputs=[OnnxExporter.export_value_info_proto(t, True) for t in graph.inputs],
        outputs=[OnnxExporter.export_value_info_proto(t, True) for t in graph.outputs],
        doc_string=graph.doc_string,
    ).SerializeToString()
    pieces: list[bytes | memoryview] = []
    try:
        for t in graph.tensors().values():
            if isinstance(t, gs.Constant):
                pieces += _initializer_pieces(t, cache) if data is None else _external_pieces(t, cache, data)
    finally:
        if data is not None:
            data.close()
    graph_size = len(small) + sum(_nbytes(p) for p in pieces)
    if graph_size + skeleton.ByteSize() >= onnx_io.PROTOBUF_LIMIT:
        raise ValueError(f"{path}: graph over 2 GiB even with its weights in external data")
    with open(path, "wb") as f:
        f.write(skeleton.SerializeToString())
        f.write(onnx_io.field_header(onnx_io.MODEL_GRAPH, graph_size))
        f.write(small)
        for p in pieces:
            f.write(p)
    return data is not None
