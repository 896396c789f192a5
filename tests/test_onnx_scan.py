"""The weight-free scan of an ONNX file (elastic_export.core.onnx_scan) reads what onnx.load reads:
every node, and every initializer's name, type, shape and raw bytes, in order."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elastic_export.core.onnx_scan import MappedModel, ScanError, scan_buffer


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    raw = [numpy_helper.from_array(rng.standard_normal(s).astype(t), n)
           for n, s, t in (("w", (4, 3), np.float32), ("b", (3,), np.float16), ("scalar", (), np.float32),
                           ("idx", (2, 2), np.int64), ("big", (70, 30), np.float32), ("empty", (0, 3), np.float32))]
    typed = helper.make_tensor("typed", TensorProto.FLOAT, [2], [1.0, 2.0])  # float_data, no raw_data
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b2"], ["z"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3])],
                              initializer=[*raw, typed, numpy_helper.from_array(np.ones(3, np.float32), "b2")])
    return helper.make_model(graph, producer_name="test")


def _expected(model: onnx.ModelProto):
    return [(t.name, t.data_type, list(t.dims), t.raw_data if t.HasField("raw_data") else None)
            for t in model.graph.initializer]


def test_scan_reads_what_onnx_load_reads(tmp_path):
    model = _model()
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    with MappedModel(path) as m:
        got = [(t.name, t.data_type, t.dims, bytes(m.raw(t)) if t.raw else None) for t in m.scan.initializers]
        assert [n.SerializeToString() for n in m.scan.nodes] == [n.SerializeToString() for n in model.graph.node]
    assert got == _expected(onnx.load(path))
    assert scan_buffer(model.SerializeToString()).initializers[0].raw is not None


def test_external_data_has_no_raw_bytes_in_the_file(tmp_path):
    model = _model()
    path = tmp_path / "ext.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data",
              size_threshold=1024)
    with MappedModel(path) as m:
        by_name = {t.name: t for t in m.scan.initializers}
    assert by_name["big"].external and by_name["big"].raw is None  # 8400 bytes: moved out
    assert not by_name["w"].external and by_name["w"].raw is not None  # 48 bytes: kept inline


def test_packed_dims_are_read_too():
    """protobuf parsers accept repeated scalars packed or not; the scan reads both."""
    t = numpy_helper.from_array(np.zeros((2, 5), np.float32), "p")
    raw = t.raw_data
    packed = (bytes([0x0A, 2, 2, 5, 0x10, TensorProto.FLOAT, 0x42, 1]) + b"p"  # dims (1) as one run, type (2), name (8)
              + bytes([0x4A]) + _len(raw) + raw)  # raw_data (9)
    assert onnx.TensorProto.FromString(packed).dims == [2, 5]  # what protobuf itself reads
    for body in (t.SerializeToString(), packed):
        (init,) = scan_buffer(_wrap(body)).initializers
        assert (init.name, init.dims, init.data_type, init.raw[1]) == ("p", [2, 5], TensorProto.FLOAT, 40)


def _len(b: bytes) -> bytes:
    out, n = bytearray(), len(b)
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _wrap(body: bytes) -> bytes:
    inner = bytes([0x2A]) + _len(body) + body  # GraphProto.initializer (5)
    return bytes([0x3A]) + _len(inner) + inner  # ModelProto.graph (7)


@pytest.mark.parametrize("data", [b"not onnx", b"\x3a\xff\xff\xff\x0f", b"\x08",
                                  b"\x3a\x04\x0a\x02\x0a\x7f"])  # the last: a node whose input overruns it
def test_bytes_that_are_not_protobuf_are_refused(tmp_path, data):
    path = tmp_path / "bad.onnx"
    path.write_bytes(data)
    with pytest.raises(ScanError):
        MappedModel(path)
