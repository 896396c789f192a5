"""The one output comparison (``elastic_export.checks.compare``) and the one CPU session factory
(``targets.onnxruntime.cpu_session``) that every in-package check goes through."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elastic_export.checks.compare import ATOL, compare_outputs, fmt_error, max_abs_error
from elastic_export.core import onnx_io
from elastic_export.targets.onnxruntime import cpu_session

ROOT = Path(__file__).resolve().parents[1]


def _add_model(bias: np.ndarray) -> onnx.ModelProto:
    """y = x + bias (float32, x shaped like the bias); the bias is an initializer."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(bias.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(bias.shape))],
        [numpy_helper.from_array(bias.astype(np.float32), "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_within_and_beyond_atol():
    want = [np.zeros((2, 3), np.float32)]
    ok = compare_outputs([want[0] + 5e-5], want)
    assert ok.ok and ok.tol == "abs 1e-04" and ok.max_abs == pytest.approx(5e-5) and ok.problem == ""
    bad = compare_outputs([want[0] + 2e-3], want)
    assert not bad.ok and bad.problem == "max abs error 2.0e-03 > 0.0001"


def test_rtol_and_shapes_and_nan():
    want = [np.full((2, 3), 10.0, np.float32)]
    rel = compare_outputs([want[0] * 1.05], want, atol=None, rtol=1e-2)
    assert rel.tol == "rel 1e-02" and rel.problem == "relative error 5.0e-02 > 0.01"
    shape = compare_outputs([np.zeros((2, 4))], want)
    assert shape.max_abs is None and shape.tol is None and shape.problem == "output shape (2, 4), expected (2, 3)"
    assert compare_outputs([], want).problem == "0 outputs, expected 1"
    nan = compare_outputs([np.full((2, 3), np.nan)], want)
    assert math.isinf(nan.max_abs) and not nan.ok  # NaN is never within a tolerance
    assert fmt_error(None) == "-" and fmt_error(math.inf) == "inf" and fmt_error(1.5e-5) == "1.5e-05"


def test_float32_difference_is_the_rounded_exact_one():
    """The main job records the float32 difference; verify the exact (float64) one."""
    a, b = np.float32(1e-5), np.float32(-3.3333333e-5)
    exact = max_abs_error([np.array([a])], [np.array([b])])
    single = max_abs_error([np.array([a])], [np.array([b])], np.float32)
    assert exact == float(np.float64(a) - np.float64(b)) and single == float(np.float32(a - b))
    assert compare_outputs([np.array([b])], [np.array([a])], dtype=np.float32).max_abs == single
    assert ATOL == 1e-4


def test_cpu_session_from_file_bytes_and_model(tmp_path):
    bias = np.arange(6, dtype=np.float32).reshape(2, 3)
    model = _add_model(bias)
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = np.ones((2, 3), np.float32)
    for src in (tmp_path / "m.onnx", str(tmp_path / "m.onnx"), model.SerializeToString(), model):
        (y,) = cpu_session(src).run(None, {"x": x})
        np.testing.assert_array_equal(y, x + bias)
    assert cpu_session(model, threads=1).get_session_options().intra_op_num_threads == 1


def test_cpu_session_takes_a_big_model_through_a_scratch_file(monkeypatch):
    """A model over the inline limit is not serialised in memory: it goes through a scratch
    folder (external data) that lives as long as the session."""
    monkeypatch.setattr(onnx_io, "INLINE_LIMIT", 1)
    bias = np.full((2, 4096), 2.0, np.float32)  # over onnx_io.SIZE_THRESHOLD: written to model.onnx.data
    sess = cpu_session(_add_model(bias))
    scratch = Path(sess._scratch.name)
    assert (scratch / "model.onnx").is_file() and len(onnx_io.files(scratch / "model.onnx")) == 2
    (y,) = sess.run(None, {"x": np.zeros((2, 4096), np.float32)})
    np.testing.assert_array_equal(y, bias)
    del sess
    assert not scratch.exists()


def test_every_session_goes_through_the_factory():
    """No package module but targets/onnxruntime.py builds an onnxruntime session itself; the one
    exception is the Triton Python-backend budget model, a file copied into a model repository that
    runs inside the server, where elastic-export may not be installed."""
    factory = ROOT / "targets" / "onnxruntime.py"
    in_server = ROOT / "targets" / "triton_onnx_model.py"
    found = [f"{p.relative_to(ROOT)}:{n}" for folder in ("elastic_export", "passes", "targets")
             for p in sorted((ROOT / folder).rglob("*.py")) if p not in (factory, in_server)
             for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"InferenceSession\s*\(", line)]
    assert not found, f"use targets.onnxruntime.cpu_session / make_session instead: {found}"
