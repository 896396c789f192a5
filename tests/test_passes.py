"""Each graph pass on its own, and the verifying pass pipeline."""

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from _helpers import masked_torch, max_err, run_onnx
from onnx import helper, numpy_helper

from elastic_export.core.errors import UserError
from elastic_export.export.dense import get_units
from elastic_export.passes import PASSES, BudgetSlicer, PassContext, run_passes, slice_model
from elastic_export.passes.base import register_pass, verify, verify_graph


@pytest.fixture(scope="module")
def setup(tiny_exports):
    enc = tiny_exports["hf-bert"].enc
    inv, rk, dense, plans = tiny_exports["hf-bert"].prepared()
    plan = next(p for p in plans if 0 in p.heads_per_layer and 0 < max(p.heads_per_layer) < 4)
    return enc, rk, dense, plan


def _ctx(dense, plan):
    return PassContext(get_units(dense), plan.heads_per_layer, plan.neurons_per_layer)


def test_every_pass_is_documented():
    for p in PASSES.values():
        assert p.doc, p.name


def test_drop_empty_blocks_removes_the_sub_block(setup):
    enc, rk, dense, plan = setup
    units = get_units(dense)
    out = run_passes(dense, ["drop-empty-blocks", "cleanup"], _ctx(dense, plan))
    names = {n.name for n in out.graph.node}
    for i, layer in enumerate(units):
        q_matmul = layer["heads"]["producers"][0]["matmul"]
        assert (q_matmul in names) == (plan.heads_per_layer[i] > 0)


def test_slice_weights_cuts_initializers(setup):
    enc, rk, dense, plan = setup
    units = get_units(dense)
    out = run_passes(dense, ["drop-empty-blocks", "slice-weights", "cleanup"], _ctx(dense, plan))
    inits = {t.name: t for t in out.graph.initializer}
    for i, layer in enumerate(units):
        n = plan.neurons_per_layer[i]
        if n:
            fc1 = layer["neurons"]["producers"][0]
            assert list(inits[fc1["weight"]].dims)[fc1["axis"]] == n
            fc2 = layer["neurons"]["consumer"]
            assert list(inits[fc2["weight"]].dims)[fc2["axis"]] == n
        h = plan.heads_per_layer[i]
        if h:
            q = layer["heads"]["producers"][0]
            assert list(inits[q["weight"]].dims)[q["axis"]] == h * layer["heads"]["width"]


def test_fix_head_reshapes_writes_explicit_counts(setup):
    enc, rk, dense, plan = setup
    units = get_units(dense)
    graph = gs.import_onnx(run_passes(dense, ["drop-empty-blocks", "slice-weights", "fix-head-reshapes"],
                                      _ctx(dense, plan)))
    nodes = {n.name: n for n in graph.nodes}
    for i, layer in enumerate(units):
        k, d = plan.heads_per_layer[i], layer["heads"]["width"]
        if not k:
            continue
        for p in layer["heads"]["producers"]:
            shape = nodes[p["reshape"]].inputs[1]
            assert isinstance(shape, gs.Constant) and shape.values.tolist() == [0, 0, k, d]
        merge = nodes[layer["heads"]["consumer"]["reshape"]].inputs[1]
        assert merge.values.tolist() == [0, 0, k * d]


def test_cleanup_keeps_graph_inputs(setup):
    enc, rk, dense, plan = setup
    everything_empty = PassContext(get_units(dense), [0] * 3, [0] * 3)
    out = run_passes(dense, ["drop-empty-blocks", "cleanup"], everything_empty)
    assert [i.name for i in out.graph.input] == [i.name for i in dense.graph.input]
    assert not any(n.op_type == "MatMul" and "encoder.layer" in "".join(n.input) for n in out.graph.node)


def test_full_pipeline_matches_masked_model(setup):
    enc, rk, dense, plan = setup
    feeds = enc.sample_inputs(batch=3, seq_len=10)
    out = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
    assert max_err(run_onnx(out, feeds), masked_torch(enc, plan, rk, feeds)) <= 1e-4
    assert [(u["heads"]["count"], u["neurons"]["count"]) for u in get_units(out)] == list(
        zip(plan.heads_per_layer, plan.neurons_per_layer))


def test_verify_rejects_zero_sized_tensors():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 0])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])
    w = numpy_helper.from_array(np.zeros((0, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    with pytest.raises(RuntimeError, match="0-sized"):
        verify(helper.make_model(graph), "test")


def _empty_tokens_model(op: str) -> onnx.ModelProto:
    """x (B, 3, 4) joined (``op`` Concat) or added (Add) with a (B, 0, 4) expansion of a 0-sized
    weight, as DINOv3 without register tokens exports its ``register_tokens``."""
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 3, 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    inits = [numpy_helper.from_array(np.zeros((1, 0, 4), np.float32), "reg"),
             numpy_helper.from_array(np.array([2, 1, 1], np.int64), "shape")]
    nodes = [helper.make_node("Expand", ["reg", "shape"], ["regs"]),
             helper.make_node("Concat", ["regs", "x"], ["y"], axis=1) if op == "Concat"
             else helper.make_node("Add", ["regs", "x"], ["y"])]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)])


def test_dense_export_drops_empty_concat_inputs():
    from elastic_export.export.dense import _drop_empty_inputs

    model = _empty_tokens_model("Concat")
    _drop_empty_inputs(model)
    assert [(n.op_type, list(n.input)) for n in model.graph.node] == [("Concat", ["x"])]
    assert "reg" not in [t.name for t in model.graph.initializer]  # (the unit map drops unread ones later)
    with pytest.raises(UserError, match="0-sized weight reg"):
        _drop_empty_inputs(_empty_tokens_model("Add"))


def test_unknown_pass_and_bad_counts(setup):
    enc, rk, dense, plan = setup
    with pytest.raises(KeyError):
        run_passes(dense, ["no-such-pass"], _ctx(dense, plan))
    with pytest.raises(UserError):
        slice_model(dense, [5, 5, 5], plan.neurons_per_layer)
    with pytest.raises(UserError):
        slice_model(dense, [1, 1], [1, 1])


def test_fast_path_writes_the_same_model(setup):
    """Skipping the serialising checks changes nothing in the result."""
    enc, rk, dense, plan = setup
    fast = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer, full_check=False)
    full = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
    assert fast.SerializeToString() == full.SerializeToString()
    onnx.checker.check_model(fast, full_check=True)


def test_budget_slicer_files_load_back_equal_to_slice_model(setup, tmp_path):
    """The streamed file of every budget (incl. empty sub-blocks and the dense widths) is the
    model slice_model builds, byte for byte once loaded; the dense model is left untouched."""
    enc, rk, dense, plan = setup
    before = dense.SerializeToString()
    layers = len(plan.heads_per_layer)
    full = [u["heads"]["count"] for u in get_units(dense)], [u["neurons"]["count"] for u in get_units(dense)]
    cases = [(plan.heads_per_layer, plan.neurons_per_layer), full, ([0] * layers, [0] * layers),
             (plan.heads_per_layer, plan.neurons_per_layer)]  # again: the shared weight cache is reused
    slicer = BudgetSlicer(dense)
    for i, (heads, neurons) in enumerate(cases):
        path = tmp_path / f"b{i}.onnx"
        slicer.save(heads, neurons, path, full_check=True)
        want = slice_model(dense, heads, neurons)
        assert onnx.load(str(path)).SerializeToString() == want.SerializeToString(), i
    assert dense.SerializeToString() == before
    got = run_onnx(onnx.load(str(tmp_path / "b0.onnx")), enc.sample_inputs(batch=2, seed=3))
    assert max_err(got, masked_torch(enc, plan, rk, enc.sample_inputs(batch=2, seed=3))) < 1e-4


def test_budget_slicer_refuses_bad_counts(setup, tmp_path):
    enc, rk, dense, plan = setup
    with pytest.raises(UserError, match="cannot keep"):
        BudgetSlicer(dense).save([99] * len(plan.heads_per_layer), plan.neurons_per_layer, tmp_path / "x.onnx")
    assert not (tmp_path / "x.onnx").exists()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int32, np.bool_, np.uint8, np.float64])
def test_save_graph_matches_graphsurgeon_export(tmp_path, dtype):
    """Streamed initializers of every dtype (and 0-d, empty-name-free) load back as gs.export_onnx writes them."""
    from elastic_export.core.onnx_io import model_skeleton
    from elastic_export.passes.serialize import TensorCache, save_graph

    x = gs.Variable("x", np.float32, (2, 3))
    w = gs.Constant("w", (np.arange(6).reshape(2, 3) % 2).astype(dtype))
    s = gs.Constant("s", np.array(3, dtype=dtype))
    wf = gs.Variable("wf", np.float32, None)
    sf = gs.Variable("sf", np.float32, None)
    y = gs.Variable("y", np.float32, (2, 3))
    g = gs.Graph(inputs=[x], outputs=[y], opset=17,
                 nodes=[gs.Node("Cast", inputs=[w], outputs=[wf], attrs={"to": onnx.TensorProto.FLOAT}),
                        gs.Node("Cast", inputs=[s], outputs=[sf], attrs={"to": onnx.TensorProto.FLOAT}),
                        gs.Node("Add", inputs=[x, wf], outputs=[(t := gs.Variable("t", np.float32, None))]),
                        gs.Node("Mul", inputs=[t, sf], outputs=[y])])
    want = gs.export_onnx(g)
    del want.graph.value_info[:]
    want.metadata_props.add(key="k", value="v")
    path = tmp_path / "m.onnx"
    save_graph(g, model_skeleton(want), path, TensorCache())
    got = onnx.load(str(path))
    assert got.SerializeToString() == want.SerializeToString()
    onnx.checker.check_model(got, full_check=True)


def _corrupt(dense, how: str):
    import json as _json

    from elastic_export.export.dense import UNITS_KEY

    bad = onnx.ModelProto()
    bad.CopyFrom(dense)
    units = get_units(bad)
    if how == "renamed-weight":
        name = units[0]["neurons"]["producers"][0]["weight"]
        next(t for t in bad.graph.initializer if t.name == name).name = name + "_edited"
    elif how == "missing-node":
        name = units[-1]["heads"]["consumer"]["reshape"]
        node = next(n for n in bad.graph.node if n.name == name)
        bad.graph.node.remove(node)
    elif how == "garbage-map":
        next(p for p in bad.metadata_props if p.key == UNITS_KEY).value = "{not json"
    elif how == "map-wrong-types":
        units[0]["heads"]["count"] = "four"
        next(p for p in bad.metadata_props if p.key == UNITS_KEY).value = _json.dumps(units)
    elif how == "map-missing-keys":
        del units[1]["neurons"]["consumer"]
        next(p for p in bad.metadata_props if p.key == UNITS_KEY).value = _json.dumps(units)
    return bad


@pytest.mark.parametrize("how", ["renamed-weight", "missing-node", "garbage-map", "map-wrong-types", "map-missing-keys"])
def test_corrupt_model_is_refused_before_any_pass(setup, tmp_path, how):
    """A model whose unit map does not describe its graph: one-line UserError from every entry
    point of the passes, and no file written."""
    from elastic_export.passes import build_elastic_model

    enc, rk, dense, plan = setup
    bad = _corrupt(dense, how)
    heads, neurons = plan.heads_per_layer, plan.neurons_per_layer
    for call in (lambda: slice_model(bad, heads, neurons),
                 lambda: BudgetSlicer(bad).save(heads, neurons, tmp_path / "b.onnx"),
                 lambda: build_elastic_model(bad, [heads], [neurons])):
        with pytest.raises(UserError) as e:
            call()
        assert "\n" not in str(e.value) and ("corrupt" in str(e.value) or "unit map" in str(e.value))
    assert not (tmp_path / "b.onnx").exists()


def _graph(nodes_fn):
    x = gs.Variable("x", np.float32, (1, 2))
    y = gs.Variable("y", np.float32, (1, 2))
    g = gs.Graph(inputs=[x], outputs=[y], opset=17)
    nodes_fn(g, x, y)
    return g


@pytest.mark.parametrize("case,match", [
    ("unknown-op", "unknown op"),
    ("undefined-input", "nothing produces"),
    ("zero-constant", "0-sized"),
    ("twice", "produced twice"),
    ("no-output", "not produced"),
])
def test_verify_graph_catches_broken_graphs(case, match):
    def build(g, x, y):
        if case == "unknown-op":
            g.nodes.append(gs.Node("NoSuchOp", inputs=[x], outputs=[y]))
        elif case == "undefined-input":
            g.nodes.append(gs.Node("Add", inputs=[x, gs.Variable("ghost", np.float32)], outputs=[y]))
        elif case == "zero-constant":
            g.nodes.append(gs.Node("MatMul", inputs=[x, gs.Constant("w", np.zeros((0, 2), np.float32))], outputs=[y]))
        elif case == "twice":
            g.nodes += [gs.Node("Relu", inputs=[x], outputs=[y]), gs.Node("Relu", inputs=[x], outputs=[y])]
    with pytest.raises(RuntimeError, match=match):
        verify_graph(_graph(build), "test")


def test_verify_graph_sorts_an_unsorted_graph():
    def build(g, x, y):
        mid = gs.Variable("mid", np.float32, (1, 2))
        g.nodes += [gs.Node("Relu", inputs=[mid], outputs=[y]), gs.Node("Neg", inputs=[x], outputs=[mid])]
    g = _graph(build)
    verify_graph(g, "test")
    assert [n.op for n in g.nodes] == ["Neg", "Relu"]


def test_pipeline_checks_between_passes(setup):
    """A pass that breaks the graph is caught right after it runs, naming it."""
    enc, rk, dense, plan = setup

    @register_pass("test-break-graph")
    def _break(graph, ctx):
        graph.nodes[0].inputs[0] = gs.Variable("ghost", np.float32)
        return graph

    try:
        with pytest.raises(RuntimeError, match="test-break-graph"):
            run_passes(dense, ["test-break-graph", "cleanup"], _ctx(dense, plan))
    finally:
        PASSES.pop("test-break-graph")
