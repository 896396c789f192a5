"""For every architecture: sliced ONNX (onnxruntime) == hard-masked torch model within 1e-4.

The tiny models' dense exports are the session's shared ones (``conftest``'s ``tiny_export``), read only."""

import json

import numpy as np
import onnx
from _helpers import masked_torch, max_err, run_onnx

from elastic_export.export.dense import get_units, permuted_module
from elastic_export.models.adapters import find_blocks
from elastic_export.models.inventory import build_inventory
from elastic_export.passes import slice_model
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import make_plans
from elastic_export.ranking.reference import prefix_keep, sliced_copy
from elastic_export.ranking.scoring import METHODS


def _no_zero_sized_matmul(model: onnx.ModelProto) -> bool:
    """No MatMul / Gemm input has a static dimension of size 0 (DESIGN.md invariant 3)."""
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
        for v in inferred.graph.value_info
    }
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    return not any(
        0 in shapes.get(i, []) for n in model.graph.node if n.op_type in ("MatMul", "Gemm") for i in n.input
    )


def test_sliced_onnx_matches_masked_torch(tiny_export):
    enc = tiny_export.enc
    inv, rk, dense, plans = tiny_export.prepared()
    assert any(0 in p.heads_per_layer for p in plans), "a budget must empty some layer's heads"
    onnx.checker.check_model(str(tiny_export.path))
    feeds = enc.sample_inputs(batch=3, seq_len=11)
    perm = permuted_module(enc, rk)
    for plan in plans:
        model = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
        onnx.checker.check_model(model, full_check=True)
        assert _no_zero_sized_matmul(model)
        want = masked_torch(enc, plan, rk, feeds)
        assert max_err(run_onnx(model, feeds), want) <= 1e-4, plan.sparsity
        sliced = enc.export_module(sliced_copy(perm, find_blocks, prefix_keep(plan)))
        got = [t.detach().numpy() for t in sliced(*feeds.values())]
        assert max_err(got, want) <= 1e-4


def test_dense_export_is_dynamic(tiny_export):
    """The dense ONNX runs at other batch sizes (and sequence lengths for text)."""
    enc = tiny_export.enc
    inv, rk, dense, plans = tiny_export.prepared(sparsities=(0.3,))
    model = slice_model(dense, plans[0].heads_per_layer, plans[0].neurons_per_layer)
    for batch, seq in ((1, 5), (4, 13)):
        feeds = enc.sample_inputs(batch=batch, seq_len=seq)
        assert max_err(run_onnx(model, feeds), masked_torch(enc, plans[0], rk, feeds)) <= 1e-4


def test_minilm_real_model(minilm, tmp_path):
    """The real pre-trained all-MiniLM-L6-v2 with the real one-shot ranking, four budgets."""
    from elastic_export.data.calibration import load_calibration

    inv = build_inventory(minilm)
    calib = load_calibration(minilm, size=8, batch_size=4)
    heads, neurons = METHODS["initial"](minilm, inv, calib)
    heads[2][:] = -1.0  # make sure one budget leaves layer 2 with no heads
    rk = Ranking(heads, neurons, {})
    from elastic_export.export.dense import export_dense

    dense = export_dense(minilm, rk, tmp_path / "dense.onnx")
    plans = make_plans(rk, inv, [0.1, 0.3, 0.45, 0.6])
    assert any(p.heads_per_layer[2] == 0 for p in plans)
    feeds = minilm.sample_inputs(batch=2, seq_len=24)
    for plan in plans:
        assert abs(plan.achieved_sparsity - plan.sparsity) < 0.01
        model = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
        got = run_onnx(model, feeds)
        assert max_err(got, masked_torch(minilm, plan, rk, feeds)) <= 1e-4
        # sentence embeddings stay unit-norm
        np.testing.assert_allclose(np.linalg.norm(got[1], axis=-1), 1.0, atol=1e-5)
    units = get_units(dense)
    assert json.dumps(units)  # the unit map is plain JSON
