"""The elastic graph (passes/elastic_graph.py): one ONNX, weights once, ``budget_index`` selects.

Every budget index must compute what that budget's own ONNX (``slice_model``) and the hard-masked
torch model compute, within 1e-4, including layers that keep 0 heads or 0 neurons. The tiny models'
dense exports are the session's shared ones (``conftest``'s ``tiny_exports``), read only.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _helpers import masked_torch, max_err, run_onnx
from conftest import tiny_encoder

from elastic_export.core.errors import UserError
from elastic_export.export.dense import get_units
from elastic_export.passes import build_elastic_model, get_elastic, slice_model

# prepared()'s ranking ranks layer 0's heads and the last layer's neurons below everything, so
# 0.25 .. 0.9 empty those sub-blocks (0.9 empties every layer's heads on the tiny models).
SPARSITIES = (0.0, 0.25, 0.5, 0.9)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, feeds: dict, index) -> list[np.ndarray]:
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    return sess.run(None, {**np_feeds, "budget_index": np.array(index, dtype=np.int64)})


def _float_bytes(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) * 4 for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)


def _zero_block_bytes(units: list[dict], heads: list[list[int]], neurons: list[list[int]]) -> int:
    """One unit's consumer rows per sub-block that some budget empties (the only extra weights)."""
    total = 0
    for i, layer in enumerate(units):
        for kind, table in (("heads", heads), ("neurons", neurons)):
            if any(row[i] == 0 for row in table):
                total += layer[kind]["width"] * layer[kind]["consumer"]["out_features"] * 4
    return total


def test_every_budget_index_matches_its_budget(tiny_export):
    """Every architecture, every budget index == the per-budget ONNX == the hard-masked model."""
    enc = tiny_export.enc
    inv, rk, dense, plans = tiny_export.prepared(sparsities=SPARSITIES)
    heads = [p.heads_per_layer for p in plans]
    neurons = [p.neurons_per_layer for p in plans]
    assert any(row[0] == 0 for row in heads) and any(row[-1] == 0 for row in neurons)
    elastic = build_elastic_model(dense, heads, neurons)
    onnx.checker.check_model(elastic, full_check=True)
    assert [i.name for i in elastic.graph.input] == [i.name for i in dense.graph.input] + ["budget_index"]
    assert [o.name for o in elastic.graph.output] == [o.name for o in dense.graph.output]
    # the weights are stored once: the dense floats plus the zero rows of emptied sub-blocks
    assert _float_bytes(elastic) == _float_bytes(dense) + _zero_block_bytes(get_units(dense), heads, neurons)
    feeds = enc.sample_inputs(batch=3, seq_len=11)
    sess = _session(elastic)
    for b, plan in enumerate(plans):
        got = _run(sess, feeds, [b])
        per_budget = run_onnx(slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer), feeds)
        assert max_err(got, per_budget) <= 1e-4, (b, plan.sparsity)
        assert max_err(got, masked_torch(enc, plan, rk, feeds)) <= 1e-4, (b, plan.sparsity)


@pytest.mark.parametrize("name", ["hf-bert", "timm-vit", "timm-vit-glu-packed", "hf-dinov2-swiglu", "hf-modernbert", "hf-mpnet"])
def test_arbitrary_tables_with_empty_and_constant_columns(name, tiny_exports):
    """Tables need not nest: random counts, every layer empty at one budget, full at another, and
    columns that never change (a constant instead of a Gather), including one constant at 0."""
    enc = tiny_exports[name].enc
    inv, rk, dense, plans = tiny_exports[name].prepared(sparsities=(0.3,))
    units = get_units(dense)
    rng = np.random.default_rng(0)
    L = len(units)
    heads = [[0] * L, [u["heads"]["count"] for u in units]]
    neurons = [[0] * L, [u["neurons"]["count"] for u in units]]
    for _ in range(3):
        heads.append([int(rng.integers(0, u["heads"]["count"] + 1)) for u in units])
        neurons.append([int(rng.integers(0, u["neurons"]["count"] + 1)) for u in units])
    for row in heads:
        row[1] = 0  # layer 1 never keeps a head: the zero rows at every budget
    for row in neurons:
        row[0] = 5  # layer 0 keeps 5 neurons at every budget
    elastic = build_elastic_model(dense, heads, neurons)
    feeds = enc.sample_inputs(batch=2, seq_len=9)
    sess = _session(elastic)
    for b, (h, n) in enumerate(zip(heads, neurons)):
        assert max_err(_run(sess, feeds, [b]), run_onnx(slice_model(dense, h, n), feeds)) <= 1e-4, (h, n)


@pytest.fixture(scope="module")
def bert(tiny_exports):
    enc = tiny_exports["hf-bert"].enc
    inv, rk, dense, plans = tiny_exports["hf-bert"].prepared(sparsities=SPARSITIES)
    elastic = build_elastic_model(dense, [p.heads_per_layer for p in plans], [p.neurons_per_layer for p in plans])
    return enc, dense, plans, elastic


def test_bad_budget_index(bert):
    """Negative indices count from the end (ONNX Gather); out of range, a wrong shape or dtype
    fail the run with onnxruntime's INVALID_ARGUMENT instead of computing some other budget."""
    enc, dense, plans, elastic = bert
    feeds = enc.sample_inputs(batch=2, seq_len=7)
    sess = _session(elastic)
    B = len(plans)
    assert max_err(_run(sess, feeds, [-1]), _run(sess, feeds, [B - 1])) == 0.0
    assert max_err(_run(sess, feeds, [-B]), _run(sess, feeds, [0])) == 0.0
    for bad in ([B], [-B - 1], [10**9]):
        with pytest.raises(Exception, match="out of data bounds"):
            _run(sess, feeds, bad)
    with pytest.raises(Exception, match="budget_index"):
        _run(sess, feeds, [0, 1])  # shape [2]
    with pytest.raises(Exception, match="budget_index"):
        _run(sess, feeds, 0)  # a scalar: the input is declared with shape [1]
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    with pytest.raises(Exception, match="int64"):
        sess.run(None, {**np_feeds, "budget_index": np.array([0], dtype=np.int32)})
    # and a good index still works after the failures
    assert max_err(_run(sess, feeds, [0]), _run(sess, feeds, [0])) == 0.0


def test_switching_budgets_in_one_session(bert):
    """Budgets switch per call in one session, in any order, with no state carried over."""
    enc, dense, plans, elastic = bert
    feeds = enc.sample_inputs(batch=2, seq_len=7)
    sess = _session(elastic)
    first = [_run(sess, feeds, [b]) for b in range(len(plans))]
    for b in (3, 0, 2, 2, 1, 3, 0):
        assert max_err(_run(sess, feeds, [b]), first[b]) == 0.0
    # the budgets really differ
    assert max_err(first[0], first[-1]) > 1e-3


def test_elastic_model_metadata_and_interface(bert, tmp_path):
    enc, dense, plans, elastic = bert
    meta = get_elastic(elastic)
    assert meta == {"budget_input": "budget_index", "heads": [p.heads_per_layer for p in plans],
                    "neurons": [p.neurons_per_layer for p in plans]}
    budget_in = elastic.graph.input[-1]
    assert budget_in.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_value for d in budget_in.type.tensor_type.shape.dim] == [1]
    with pytest.raises(UserError, match="unit map"):  # it is not sliced again
        slice_model(elastic, plans[0].heads_per_layer, plans[0].neurons_per_layer)
    with pytest.raises(UserError, match="not an elastic"):
        get_elastic(dense)
    # saved and loaded from a file, with another input name
    other = build_elastic_model(dense, [plans[1].heads_per_layer], [plans[1].neurons_per_layer], budget_input="b")
    onnx.save(other, str(tmp_path / "e.onnx"))
    onnx.checker.check_model(str(tmp_path / "e.onnx"), full_check=True)
    sess = ort.InferenceSession(str(tmp_path / "e.onnx"), providers=["CPUExecutionProvider"])
    feeds = enc.sample_inputs(batch=1, seq_len=5)
    got = sess.run(None, {**{k: v.numpy() for k, v in feeds.items()}, "b": np.array([0], dtype=np.int64)})
    assert max_err(got, run_onnx(slice_model(dense, plans[1].heads_per_layer, plans[1].neurons_per_layer), feeds)) <= 1e-4
    # the file holds the weights once: about the dense size, well under the per-budget files together
    onnx.save(elastic, str(tmp_path / "all.onnx"))
    onnx.save(dense, str(tmp_path / "dense.onnx"))
    size, dense_size = (tmp_path / "all.onnx").stat().st_size, (tmp_path / "dense.onnx").stat().st_size
    assert size < 1.15 * dense_size


def test_bad_tables_are_refused(bert):
    enc, dense, plans, elastic = bert
    h, n = plans[1].heads_per_layer, plans[1].neurons_per_layer
    with pytest.raises(UserError, match="one head and one neuron plan"):
        build_elastic_model(dense, [], [])
    with pytest.raises(UserError, match="one head and one neuron plan"):
        build_elastic_model(dense, [h, h], [n])
    with pytest.raises(UserError, match="layers"):
        build_elastic_model(dense, [h[:-1]], [n[:-1]])
    with pytest.raises(UserError, match="cannot keep 5"):
        build_elastic_model(dense, [[5] * len(h)], [n])
    with pytest.raises(UserError, match="cannot keep -1"):
        build_elastic_model(dense, [h], [[-1] * len(n)])
    with pytest.raises(UserError, match="already has a tensor named 'input_ids'"):
        build_elastic_model(dense, [h], [n], budget_input="input_ids")


@pytest.mark.parametrize("name", ["hf-bert", "timm-vit-glu-packed", "hf-modernbert"])
def test_no_zero_sized_matmul_at_run_time(name, tiny_exports):
    """A budget that empties every sub-block runs no 0-sized MatMul (DESIGN.md invariant 3): every
    MatMul input and output, observed in onnxruntime, has only non-zero dimensions."""
    enc = tiny_exports[name].enc
    inv, rk, dense, plans = tiny_exports[name].prepared(sparsities=(0.3,))
    L = len(get_units(dense))
    empty = [0] * L
    elastic = build_elastic_model(dense, [empty, plans[0].heads_per_layer], [empty, plans[0].neurons_per_layer])
    probe = onnx.ModelProto()
    probe.CopyFrom(elastic)
    names = {t for n in probe.graph.node if n.op_type in ("MatMul", "Gemm") for t in [*n.input, *n.output]}
    names -= {o.name for o in probe.graph.output} | {t.name for t in probe.graph.initializer}
    assert len(names) > 4 * L
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in sorted(names))
    feeds = enc.sample_inputs(batch=2, seq_len=7)
    sess = _session(probe)
    for b in (0, 1):
        outs = sess.run(None, {**{k: v.numpy() for k, v in feeds.items()}, "budget_index": np.array([b], np.int64)})
        assert all(0 not in o.shape for o in outs)
    # and the empty budget is exactly the model without any attention or MLP (biases only)
    assert max_err(_run(_session(elastic), feeds, [0]), run_onnx(slice_model(dense, empty, empty), feeds)) <= 1e-4


def test_pipeline_writes_and_verifies_the_elastic_graph(tmp_path):
    """``pipeline.run`` writes elastic.onnx, checks every index, and lists it in the manifest;
    ``--no-elastic-graph`` leaves it out."""
    from elastic_export import pipeline
    from elastic_export.cli.main import main
    from elastic_export.core.manifest import Manifest

    model = tmp_path / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    out = tmp_path / "out"
    opts = pipeline.Options(model=str(model), budgets=(0.2, 0.5, 0.9), out=str(out), seq_len=16, method="magnitude",
                            quick_eval=False, report=False)
    m = pipeline.run(opts, echo=lambda s: None)
    assert Manifest.load(out).elastic == m.elastic
    e = m.elastic
    assert e.onnx == "elastic.onnx" and e.budget_input == "budget_index" and e.budgets == [0.2, 0.5, 0.9]
    assert e.dense_index == 3 and e.max_abs_error <= 1e-4
    ids = np.array([[5, 17, 300, 9, 2, 0]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}
    sess = ort.InferenceSession(str(out / e.onnx), providers=["CPUExecutionProvider"])
    # every budget index equals its budget's file, and the dense index equals dense.onnx
    for b, entry in enumerate([*m.budgets, m.dense]):
        own = ort.InferenceSession(str(out / entry.onnx), providers=["CPUExecutionProvider"]).run(None, feeds)
        got = sess.run(None, {**feeds, e.budget_input: np.array([b], dtype=np.int64)})
        assert max_err(got, own) <= 1e-4
    assert get_elastic(onnx.load(str(out / e.onnx)))["heads"][3] == [u["heads"]["count"] for u in
                                                                         get_units(onnx.load(str(out / "dense.onnx")))]
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(model), "--budgets", "0.3", "--seq-len", "16", "--method", "magnitude",
              "--no-elastic-graph", "--no-verify", "--no-quick-eval", "--no-report", "--out", str(out)])
    assert exit_.value.code == 0
    assert Manifest.load(out).elastic is None and not (out / "elastic.onnx").exists()
