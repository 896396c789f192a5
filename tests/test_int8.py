"""int8 (onnxruntime dynamic quantization) twins of the dense model and every budget: the file,
the pipeline's check, the CLI's ``--precision`` list and ``verify``."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import save_tiny

from elastic_export.checks.verify import sample_inputs
from elastic_export.cli.main import main
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, Manifest
from elastic_export.passes import BudgetSlicer
from elastic_export.precision.int8 import INT8_MIN_COSINE, add_int8, int8_name, parse_precisions, quantize, session_min_cosine
from elastic_export.serving.runtime import ElasticRuntime, SessionConfig

QUANT_OPS = {"DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul", "QLinearMatMul"}


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path)).graph.node}


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def test_parse_precisions():
    assert parse_precisions("fp32") == ("fp32",)
    assert parse_precisions("int8") == ("fp32", "int8")
    assert parse_precisions("int8, fp16,fp32,int8") == ("fp32", "fp16", "int8")
    for bad in ("int4", "fp32,bf16", "", ","):
        with pytest.raises(UserError, match="--precision"):
            parse_precisions(bad)
    assert int8_name("budget_s030.onnx") == "budget_s030.int8.onnx"


def test_int8_budget_file(tmp_path, tiny_exports):
    """A tiny BERT budget's int8 file: smaller, quantized MatMuls, runs, cosine within the bound."""
    enc = tiny_exports["hf-bert"].enc
    _, _, dense, plans = tiny_exports["hf-bert"].prepared(sparsities=(0.5,))
    BudgetSlicer(dense).save(plans[0].heads_per_layer, plans[0].neurons_per_layer, tmp_path / "budget.onnx")
    feeds = {k: v.numpy() for k, v in enc.sample_inputs(batch=4, seed=3).items()}
    name, cos = add_int8(tmp_path, "budget.onnx", feeds)
    assert name == "budget.int8.onnx"
    assert (tmp_path / name).stat().st_size < (tmp_path / "budget.onnx").stat().st_size
    assert _ops(tmp_path / name) & QUANT_OPS and not _ops(tmp_path / "budget.onnx") & QUANT_OPS
    assert INT8_MIN_COSINE <= cos < 1.0
    ref, sess = (ort.InferenceSession(str(tmp_path / f), providers=["CPUExecutionProvider"])
                 for f in ("budget.onnx", name))
    assert [o.name for o in sess.get_outputs()] == [o.name for o in ref.get_outputs()]
    assert session_min_cosine(ref, sess, feeds) == pytest.approx(cos)
    with pytest.raises(RuntimeError, match="budget.int8.onnx"):
        add_int8(tmp_path, "budget.onnx", feeds, bound=1.0 + 1e-9)


def test_cli_precision_int8_and_verify(tmp_path, capsys, monkeypatch):
    """``--precision fp32,int8`` writes, checks and lists an int8 twin of every file; verify re-checks them."""
    from transformers import BertModel

    monkeypatch.chdir(tmp_path)
    save_tiny(BertModel, tmp_path / "model")
    rc, out, err = _run(["--model", "model", "--budgets", "0.3,0.6", "--method", "magnitude", "--calib-size", "8",
                         "--out", "out", "--no-report", "--no-quick-eval", "--precision", "fp32,int8"], capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["precisions"] == ["fp32", "int8"]
    entries = [m["dense"], *m["budgets"]]
    assert [e["onnx_int8"] for e in entries] == ["dense.int8.onnx", "budget_s030.int8.onnx", "budget_s060.int8.onnx"]
    for e in entries:
        assert INT8_MIN_COSINE <= e["int8_min_cosine"] <= 1.0 and e["onnx_fp16"] is None
        assert _ops(tmp_path / "out" / e["onnx_int8"]) & QUANT_OPS
    assert "int8: 3 files (*.int8.onnx), min embedding cosine vs fp32" in out

    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-2000:]
    rows = [line for line in out.splitlines() if ".int8.onnx" in line]
    assert len(rows) == 3 and all(" int8 " in r and "ok (min cosine" in r for r in rows)

    # the runtime serves the int8 files (per-budget mode), each exactly as the file alone
    rt = ElasticRuntime.from_dir("out", precision="int8", config=SessionConfig(threads=1))
    feeds = sample_inputs(Manifest.load("out"), onnx.load("out/dense.onnx"), batch=2, seed=5)
    for e in m["budgets"]:
        assert rt.file(e["sparsity"]) == e["onnx_int8"]
        alone = ort.InferenceSession(f"out/{e['onnx_int8']}", providers=["CPUExecutionProvider"]).run(None, feeds)
        assert all(np.array_equal(a, b) for a, b in zip(rt.run(feeds, sparsity=e["sparsity"]).values(), alone))
    with pytest.raises(UserError, match="per-budget"):
        ElasticRuntime.from_dir("out", mode="elastic", precision="int8")

    # the elastic graph slices a weight at run time wherever budgets differ in width: dynamic
    # quantization skips those MatMuls (only constant weights are quantized), hence no elastic.int8.onnx
    quantize(tmp_path / "out" / "elastic.onnx", tmp_path / "elastic.int8.onnx")
    assert _quantized_matmuls(tmp_path / "elastic.int8.onnx") == _const_b_matmuls(tmp_path / "out" / "elastic.onnx")
    assert _quantized_matmuls(tmp_path / "elastic.int8.onnx") < _quantized_matmuls(tmp_path / "out" / "dense.int8.onnx")


def _quantized_matmuls(path) -> int:
    return sum(n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") for n in onnx.load(str(path)).graph.node)


def _const_b_matmuls(path) -> int:
    model = onnx.load(str(path))
    inits = {i.name for i in model.graph.initializer}
    return sum(n.op_type in ("MatMul", "Gemm") and n.input[1] in inits for n in model.graph.node)


def test_cli_unknown_precision(tmp_path, capsys, monkeypatch):
    from transformers import BertModel

    monkeypatch.chdir(tmp_path)
    save_tiny(BertModel, tmp_path / "model")
    capsys.readouterr()
    rc, out, err = _run(["--model", "model", "--budgets", "0.3", "--method", "magnitude", "--out", "out",
                         "--precision", "fp32,int4"], capsys)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "--precision" in err and "int4" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_int8_cosine_of_mean_pooled_hidden_state():
    """Without an embedding output, the mask-weighted mean of ``last_hidden_state`` is compared."""
    from elastic_export.precision.int8 import embedding

    hidden = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    mask = np.array([[1, 1, 0]])
    np.testing.assert_allclose(embedding(["last_hidden_state"], [hidden], mask), [[2, 3, 4, 5]])
    np.testing.assert_allclose(embedding(["x", "pooler_output"], [hidden, np.ones((1, 4))]), [[1, 1, 1, 1]])
