"""The in-memory ONNX checks of :mod:`elastic_export.core.onnx_io`: ``onnx.checker`` and shape inference
on a weightless copy, the weights checked on their own (nothing serialised), as strict as onnx's own."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from elastic_export.core import onnx_io


def _model(w_shape: tuple[int, int] = (64, 64), listed_as_input: bool = False) -> onnx.ModelProto:
    """x (2, 64) @ w + b -> relu: one weight over the 1 KiB threshold, one bias under it."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(w_shape).astype(np.float32), "w")
    b = numpy_helper.from_array(np.arange(64, dtype=np.float32) / 64, "b")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])]
    if listed_as_input:  # IR < 4 style: initializers also listed as graph inputs
        inputs += [helper.make_tensor_value_info("w", TensorProto.FLOAT, list(w_shape))]
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["u"]),
         helper.make_node("Relu", ["u"], ["y"])],
        "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _weight(model: onnx.ModelProto) -> TensorProto:
    return next(t for t in model.graph.initializer if t.name == "w")


@pytest.mark.parametrize("listed_as_input", [False, True])
def test_check_accepts_a_valid_model(listed_as_input):
    onnx_io.check(_model(listed_as_input=listed_as_input), full_check=True)


def _truncate(t: TensorProto) -> None:
    t.raw_data = t.raw_data[:-4]


def _undefine(t: TensorProto) -> None:
    t.data_type = TensorProto.UNDEFINED


def _two_fields(t: TensorProto) -> None:
    t.float_data.extend([1.0])


def _external_without_location(t: TensorProto) -> None:
    t.ClearField("raw_data")
    t.data_location = TensorProto.EXTERNAL
    e = t.external_data.add()
    e.key, e.value = "offset", "0"


@pytest.mark.parametrize("spoil,message", [
    (_truncate, "16380 bytes of raw data for shape [64, 64] (16384 expected)"),
    (_undefine, "undefined data type 0"),
    (_two_fields, "2 value fields (one expected)"),
    (_external_without_location, "external data without a location"),
])
def test_check_refuses_a_bad_weight_naming_it(spoil, message):
    model = _model()
    spoil(_weight(model))
    with pytest.raises(onnx.checker.ValidationError, match="initializer 'w'") as e:
        onnx_io.check(model)
    assert message in str(e.value)


def test_check_still_checks_the_graph():
    model = _model()
    model.graph.node[1].input[0] = "nowhere"  # reads a tensor nothing produces
    with pytest.raises(onnx.checker.ValidationError):
        onnx_io.check(model)


def test_full_check_refuses_inconsistent_shapes():
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx_io.check(_model(w_shape=(32, 64)), full_check=True)  # (2, 64) @ (32, 64)


def test_infer_shapes_matches_onnx_on_the_whole_model():
    ours = onnx_io.infer_shapes(_model())
    theirs = onnx.shape_inference.infer_shapes(_model())
    assert [v.SerializeToString() for v in ours.graph.value_info] == [v.SerializeToString() for v in theirs.graph.value_info]
    assert ours.graph.output[0].type == theirs.graph.output[0].type
    assert [d.dim_value for d in ours.graph.output[0].type.tensor_type.shape.dim] == [2, 64]
    assert len(ours.graph.initializer) == 2  # the weights stay in the model


def test_check_accepts_an_empty_tensor_without_values():
    model = _model()
    model.graph.initializer.append(helper.make_tensor("roi", TensorProto.FLOAT, [0], []))
    onnx.checker.check_model(model)  # onnx's own accepts it
    onnx_io.check(model)


def test_save_writes_onnx_save_s_bytes(tmp_path):
    """save() streams an inline model one initializer at a time: the same bytes as onnx.save."""
    model = _model()
    model.doc_string, model.graph.doc_string = "a model", "a graph"
    onnx.helper.set_model_props(model, {"k": "v"})
    model.graph.value_info.extend([helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 64])])
    onnx.save(model, str(tmp_path / "theirs.onnx"))
    assert onnx_io.save(model, tmp_path / "ours.onnx") is False
    assert (tmp_path / "ours.onnx").read_bytes() == (tmp_path / "theirs.onnx").read_bytes()
