"""int8-qdq (static QDQ quantization for TensorRT) twins: the held-out split, the file's Q/DQ
placement, its check against fp32 on held-out calibration samples, the manifest, ``verify`` and bad input."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import save_tiny
from onnx import numpy_helper

from elastic_export.checks.verify import sample_inputs
from elastic_export.cli.main import main
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, Manifest
from elastic_export.core.precisions import PRECISIONS
from elastic_export.data.calibration import load_calibration
from elastic_export.passes import BudgetSlicer
from elastic_export.precision.int8_qdq import (
    MANIFEST_ENTRY,
    QDQ_MIN_COSINE,
    QDQ_SETTINGS,
    add_qdq,
    batches_min_cosine,
    qdq_name,
    split_heldout,
)
from elastic_export.serving.runtime import ElasticRuntime, SessionConfig

FP32_OPS = ("LayerNormalization", "Softmax", "Erf")  # norm, softmax, GELU: never fed by a DequantizeLinear


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_split_heldout_and_names():
    batches = [{"input_ids": np.arange(3 * i, 3 * i + 3)[:, None]} for i in range(3)]  # samples 0..8
    data = split_heldout(batches, {"source": "x"})
    assert [b["input_ids"][:, 0].tolist() for b in data.heldout] == [[3], [7]]
    assert sum(len(b["input_ids"]) for b in data.calib) == 7
    assert data.description == {"source": "x", "calibration_samples": 7, "heldout_samples": 2,
                                "heldout": "every 4th sample"}
    with pytest.raises(UserError, match="--calib-size") as e:
        split_heldout([{"input_ids": np.zeros((3, 4))}])
    assert "\n" not in str(e.value)
    assert qdq_name("budget_s030.onnx") == "budget_s030.int8-qdq.onnx" and "int8-qdq" in PRECISIONS


def test_qdq_budget_file(tmp_path, tiny_exports):
    """A tiny BERT budget's QDQ file: int8 per-channel weights, symmetric activations, Q/DQ only on
    MatMul inputs, runs on the CPU EP within the bound on held-out calibration samples."""
    enc = tiny_exports["hf-bert"].enc
    _, _, dense, plans = tiny_exports["hf-bert"].prepared(sparsities=(0.5,))
    BudgetSlicer(dense).save(plans[0].heads_per_layer, plans[0].neurons_per_layer, tmp_path / "budget.onnx")
    data = split_heldout(load_calibration(enc, None, size=16, batch_size=4).batches)
    name, cos = add_qdq(tmp_path, "budget.onnx", data)
    assert name == "budget.int8-qdq.onnx" and QDQ_MIN_COSINE <= cos <= 1.0 + 1e-9
    model = onnx.load(str(tmp_path / name))
    nodes, inits = model.graph.node, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producer = {o: n for n in nodes for o in n.output}
    dq = [n for n in nodes if n.op_type == "DequantizeLinear"]
    weights = [n for n in dq if n.input[0] in inits]
    assert weights and all(inits[n.input[0]].dtype == np.int8 for n in dq if n.input[0] in inits)
    per_channel = [n for n in weights if inits[n.input[1]].ndim == 1 and inits[n.input[1]].size > 1]
    assert per_channel and all(a.i == 1 for n in per_channel for a in n.attribute if a.name == "axis")
    zero_points = [inits[n.input[2]] for n in [*dq, *(n for n in nodes if n.op_type == "QuantizeLinear")]]
    assert all(z.dtype == np.int8 and not z.any() for z in zero_points)  # symmetric: TensorRT's zero point 0
    for n in nodes:
        fed = [producer[i].op_type for i in n.input if i in producer]
        if n.op_type in FP32_OPS:
            assert "DequantizeLinear" not in fed, n.name
    assert {producer[i].op_type for n in nodes if n.op_type == "QuantizeLinear" for i in n.input[:1]
            if i in producer}.isdisjoint({"MatMul", "Gemm"})  # MatMul outputs are not quantized
    ref, sess = (ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"]) for f in ("budget.onnx", name))
    assert batches_min_cosine(ref, sess, data.heldout) == pytest.approx(cos)
    with pytest.raises(RuntimeError, match="budget.int8-qdq.onnx"):
        add_qdq(tmp_path, "budget.onnx", data, bound=1.0 + 1e-9)


@pytest.fixture(scope="module")
def qdq_out(tmp_path_factory):
    """A tiny BERT directory exported with ``--precision fp32,int8-qdq`` (CLI), and its log."""
    from transformers import BertModel

    root = tmp_path_factory.mktemp("qdq")
    save_tiny(BertModel, root / "model")
    with pytest.raises(SystemExit) as e:
        main(["--model", str(root / "model"), "--budgets", "0.3,0.6", "--method", "magnitude", "--calib-size", "16",
              "--out", str(root / "out"), "--no-report", "--no-quick-eval", "--precision", "fp32,int8-qdq"])
    assert e.value.code == 0
    return root / "out"


def test_cli_precision_int8_qdq_manifest(qdq_out, capsys):
    m = json.loads((qdq_out / MANIFEST).read_text())
    assert m["precisions"] == ["fp32", "int8-qdq"]
    entries = [m["dense"], *m["budgets"]]
    assert [e["onnx_int8_qdq"] for e in entries] == ["dense.int8-qdq.onnx", "budget_s030.int8-qdq.onnx",
                                                     "budget_s060.int8-qdq.onnx"]
    for e in entries:
        assert QDQ_MIN_COSINE <= e["int8_qdq_min_cosine"] <= 1.0 + 1e-9 and e["onnx_int8"] is None
    entry = m[MANIFEST_ENTRY]
    assert entry["settings"] == QDQ_SETTINGS and entry["min_cosine_bound"] == QDQ_MIN_COSINE
    assert entry["calibration"]["calibration_samples"] == 12 and entry["calibration"]["heldout_samples"] == 4
    assert entry["elastic"] is None and "build-time constants" in entry["why_no_elastic"]
    assert not list(qdq_out.glob("elastic*qdq*"))


def test_verify_int8_qdq_and_corrupted(qdq_out, tmp_path, capsys):
    """verify re-checks every int8-qdq file; a file with wrong weight scales fails its row."""
    import shutil

    rc, out, err = _run(["verify", str(qdq_out)], capsys)
    assert rc == 0, (out + err)[-2000:]
    rows = [line for line in out.splitlines() if ".int8-qdq.onnx" in line]
    assert len(rows) == 3 and all(" int8-qdq " in r and "ok (min cosine" in r for r in rows)

    bad = tmp_path / "bad"
    shutil.copytree(qdq_out, bad)
    model = onnx.load(str(bad / "budget_s030.int8-qdq.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    for n in model.graph.node:  # scale every per-channel weight scale by a different factor per column
        if n.op_type == "DequantizeLinear" and n.input[0] in inits and len(inits[n.input[1]].dims) == 1:
            s = numpy_helper.to_array(inits[n.input[1]])
            inits[n.input[1]].CopyFrom(numpy_helper.from_array(s * np.linspace(-3, 3, s.size, dtype=s.dtype), n.input[1]))
    onnx.save(model, str(bad / "budget_s030.int8-qdq.onnx"))
    rc, out, err = _run(["verify", str(bad)], capsys)
    assert rc != 0
    rows = [line for line in out.splitlines() if "budget_s030.int8-qdq.onnx" in line]
    assert rows and "MISMATCH" in rows[0], out[-2000:]


def test_runtime_serves_int8_qdq(qdq_out):
    m = json.loads((qdq_out / MANIFEST).read_text())
    rt = ElasticRuntime.from_dir(qdq_out, precision="int8-qdq", config=SessionConfig(threads=1))
    feeds = sample_inputs(Manifest.load(qdq_out), onnx.load(str(qdq_out / "dense.onnx")), batch=2, seed=5)
    e = m["budgets"][0]
    assert rt.file(e["sparsity"]) == e["onnx_int8_qdq"]
    alone = ort.InferenceSession(str(qdq_out / e["onnx_int8_qdq"]), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert all(np.array_equal(a, b) for a, b in zip(rt.run(feeds, sparsity=e["sparsity"]).values(), alone))
    with pytest.raises(UserError, match="int8-qdq.*per-budget"):
        ElasticRuntime.from_dir(qdq_out, mode="elastic", precision="int8-qdq")


def test_cli_int8_qdq_too_few_calibration_samples(tmp_path, capsys, monkeypatch):
    """Nothing to hold out: one-line error, exit 2, nothing written (before the ranking)."""
    from transformers import BertModel

    monkeypatch.chdir(tmp_path)
    save_tiny(BertModel, tmp_path / "model")
    capsys.readouterr()
    rc, out, err = _run(["--model", "model", "--budgets", "0.3", "--method", "magnitude", "--out", "out",
                         "--calib-size", "3", "--precision", "int8-qdq"], capsys)
    assert rc == 2
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "int8-qdq" in errors[0] and "--calib-size" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
