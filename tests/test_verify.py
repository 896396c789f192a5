"""``elastic-export verify DIR`` (``elastic_export.checks.verify``): every artifact of a directory against the
hard-masked dense model derived from the directory's own dense.onnx.

One tiny BERT directory (fp32 + fp16, one budget with no heads left) is exported once per module;
each case copies it, damages the copy and runs the real console entry point
(``elastic_export.cli.main.main``; one case as a subprocess, the rest in-process to stay fast).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from _helpers import masked_torch, run_onnx
from onnx import helper, numpy_helper

from elastic_export.checks.verify import masked_dense
from elastic_export.cli.main import main
from elastic_export.serving.backends import get_backend

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --- the artifact directory ----------------------------------------------------------------------
def _save_tiny_bert(path: Path) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=72)
    BertModel(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    from elastic_export.pipeline import Options, run

    root = tmp_path_factory.mktemp("verify")
    bert = _save_tiny_bert(root / "bert")
    out = root / "out"
    m = run(Options(model=str(bert), budgets=(0.3, 0.6), out=str(out), method="magnitude", seq_len=16,
                    precision="fp16"), echo=lambda s: None)
    assert sum(m.budgets[1].heads_per_layer) == 0  # one budget with no attention left at all
    return out


@pytest.fixture
def art(pristine, tmp_path) -> Path:
    """A fresh copy of the exported directory to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "art"))


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the console entry point in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def one_error(err: str) -> str:
    """Exactly one ``error:`` line, the last one, and no traceback."""
    assert "Traceback" not in err
    lines = [line.strip() for line in re.split(r"[\r\n]+", err) if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _scale_weight(path: Path, suffix: str, factor: float = 1.01) -> None:
    """Multiply one weight (an initializer whose name ends with ``suffix``) in place."""
    model = onnx.load(str(path))
    t = next(t for t in model.graph.initializer if t.name.endswith(suffix))
    a = numpy_helper.to_array(t)
    t.CopyFrom(numpy_helper.from_array((a * factor).astype(a.dtype), t.name))
    onnx.save(model, str(path))


# --- passing -------------------------------------------------------------------------------------
def table(out: str) -> list[list[str]]:
    """The rows of the report table (columns are separated by two or more spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()[1:] if re.match(r"^(dense|all|\d)", line)]


def test_fresh_directory_passes_subprocess(pristine):
    """The real console script on a freshly exported directory: exit 0, a row per file."""
    p = subprocess.run([sys.executable, "-m", "elastic_export", "verify", str(pristine)], env=ENV,
                       capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and "error:" not in p.stderr
    m = json.loads((pristine / "manifest.json").read_text())
    rows = table(p.stdout)
    assert all(r[-1] == "ok" for r in rows), p.stdout
    files = [m["dense"]["onnx"], m["dense"]["onnx_fp16"]] + [f for b in m["budgets"] for f in (b["onnx"], b["onnx_fp16"])]
    assert {f for f in files} <= {r[1] for r in rows}, p.stdout
    # the pipeline's elastic graph: one row per budget index, and one for its dense index (vs dense.onnx)
    indices = range(len(m["budgets"]) + 1)
    assert m["elastic"]["dense_index"] == len(m["budgets"])
    elastic_rows = [r for r in rows if r[2] == "elastic"]
    assert [r[1] for r in elastic_rows] == [f"{m['elastic']['onnx']}[{i}]" for i in indices]
    assert elastic_rows[-1][0] == "dense" and elastic_rows[-1][3] == "dense"
    # --precision fp16: the elastic graph's fp16 twin, also one row per index
    assert m["elastic"]["onnx_fp16"] == "elastic.fp16.onnx" and 0 < m["elastic"]["fp16_max_rel_error"] <= 1e-2
    assert [r[1] for r in rows if r[2] == "elastic fp16"] == [f"elastic.fp16.onnx[{i}]" for i in indices]
    # the manifest's model.source (a local directory) loads, so the torch hard-masked model is compared too
    assert len([r for r in rows if r[2] == "torch"]) == 1 + len(m["budgets"]), p.stdout
    assert f"all {len(rows)} checks passed" in p.stdout


def test_options(art, capsys):
    rc, out, err = cli(capsys, "verify", str(art), "--batch", "3", "--seq-len", "40", "--seed", "7", "--no-torch")
    assert rc == 0, out + err
    assert "(3, 40)" in err and "torch" not in out
    rc, out, err = cli(capsys, "verify", str(art), "--batch", "0")
    assert rc == 2 and "--batch" in one_error(err)


def test_explicit_model_must_match(art, tmp_path, capsys):
    """--model that is not the model of the artifacts (same config, one weight changed) is refused."""
    from safetensors.torch import load_file, save_file

    other = _save_tiny_bert(tmp_path / "other")
    f = next(other.glob("*.safetensors"))
    state = load_file(str(f))
    key = next(k for k in state if k.endswith("intermediate.dense.weight"))
    state[key] = state[key] * 1.5
    save_file(state, str(f), metadata={"format": "pt"})
    rc, out, err = cli(capsys, "verify", str(art), "--model", str(other))
    assert rc == 2 and "fingerprint" in one_error(err)


# --- damaged artifacts ---------------------------------------------------------------------------
@pytest.mark.parametrize("which,factor", [("onnx", 1.01), ("onnx_fp16", -1.0)])
def test_corrupt_budget_weights(art, capsys, which, factor):
    """fp32: 1% on one weight matrix is far beyond 1e-4; fp16 is checked at 1e-2 relative."""
    m = json.loads((art / "manifest.json").read_text())
    name = m["budgets"][0][which]
    _scale_weight(art / name, "layer.0.output.dense.weight", factor)  # the first MLP's output projection
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 1, out + err
    msg = one_error(err)
    assert name in msg and "differs" in msg
    assert [r[1] for r in table(out) if r[-1].startswith("MISMATCH")] == [name]


def test_corrupt_elastic_fp16_weights(art, capsys):
    """The fp16 elastic graph is checked at every budget index, at 1e-2 relative."""
    model = onnx.load(str(art / "elastic.fp16.onnx"))
    t = next(t for t in model.graph.initializer if t.name.endswith("layer.0.output.dense.weight"))
    a = numpy_helper.to_array(t)
    t.CopyFrom(numpy_helper.from_array((-a).astype(a.dtype), t.name))
    onnx.save(model, str(art / "elastic.fp16.onnx"))
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 1, out + err
    assert "elastic.fp16.onnx" in one_error(err)
    bad = [r for r in table(out) if r[-1].startswith("MISMATCH")]
    assert bad and all(r[1].startswith("elastic.fp16.onnx[") for r in bad)


def test_corrupt_dense_weights(art, capsys):
    """A damaged dense model is the reference, so every budget now differs from it."""
    _scale_weight(art / "dense.onnx", "attention.output.dense.weight", 1.5)
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 1 and "differs" in one_error(err)


def test_deleted_budget(art, capsys):
    (art / "budget_s060.onnx").unlink()
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2, out + err
    msg = one_error(err)
    assert "budget_s060.onnx" in msg and "missing" in msg
    assert "budget_s030.onnx" in out  # the other files are still checked and listed


def test_truncated_fp16_file(art, capsys):
    p = art / "budget_s030.fp16.onnx"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2 and "budget_s030.fp16.onnx" in one_error(err) and "corrupt" in one_error(err)


def test_deleted_dense(art, capsys):
    (art / "dense.onnx").unlink()
    rc, out, err = cli(capsys, "verify", str(art))
    assert rc == 2 and "dense.onnx" in one_error(err)
    assert out == ""


@pytest.mark.parametrize("breakage", ["not-json", "no-budgets", "wrong-layer-count", "too-many-heads",
                                      "escaping-path", "no-directory"])
def test_broken_manifest(art, capsys, breakage):
    target = str(art)
    if breakage == "not-json":
        (art / "manifest.json").write_text("{ not json")
    elif breakage == "no-budgets":
        _edit_manifest(art, lambda m: m.pop("budgets"))
    elif breakage == "wrong-layer-count":
        _edit_manifest(art, lambda m: m["budgets"][0].update(heads_per_layer=[1, 1, 1]))
    elif breakage == "too-many-heads":
        _edit_manifest(art, lambda m: m["budgets"][0].update(heads_per_layer=[9, 0]))
    elif breakage == "escaping-path":
        _edit_manifest(art, lambda m: m["budgets"][0].update(onnx_fp16="../../etc/passwd"))
    else:
        target = str(art / "nowhere")
    rc, out, err = cli(capsys, "verify", target)
    assert rc == 2, out + err
    one_error(err)
    assert out == ""  # refused before any check


# --- the elastic graph and TensorRT engines ------------------------------------------------------
def build_elastic(d: Path, order: list[int] | None = None, name: str = "elastic.onnx") -> None:
    """A real elastic graph for the manifest contract ({onnx, budget_input}): every budget's graph
    merged into one, the outputs picked by an int64 scalar ``budget_index`` (Equal + Where)."""
    m = json.loads((d / "manifest.json").read_text())
    models = [onnx.load(str(d / b["onnx"])) for b in m["budgets"]]
    order = order or list(range(len(models)))
    nodes, inits = [], []
    for i, model in enumerate(models):
        p = onnx.compose.add_prefix(model, f"b{i}_")
        nodes += [helper.make_node("Identity", [v.name], [f"b{i}_{v.name}"]) for v in model.graph.input]
        nodes += list(p.graph.node)
        inits += list(p.graph.initializer)
    outs = [o.name for o in models[0].graph.output]
    for o in outs:
        cur = f"b{order[-1]}_{o}"
        for pos in reversed(range(len(models) - 1)):
            inits.append(numpy_helper.from_array(np.array(pos, np.int64), f"idx{pos}_{o}"))
            nodes.append(helper.make_node("Equal", ["budget_index", f"idx{pos}_{o}"], [f"eq{pos}_{o}"]))
            nodes.append(helper.make_node("Where", [f"eq{pos}_{o}", f"b{order[pos]}_{o}", cur], [f"sel{pos}_{o}"]))
            cur = f"sel{pos}_{o}"
        nodes.append(helper.make_node("Identity", [cur], [o]))
    inputs = list(models[0].graph.input) + [helper.make_tensor_value_info("budget_index", onnx.TensorProto.INT64, [])]
    graph = helper.make_graph(nodes, "elastic", inputs, list(models[0].graph.output), inits)
    model = helper.make_model(graph, opset_imports=list(models[0].opset_import))
    model.ir_version = models[0].ir_version
    onnx.checker.check_model(model)
    onnx.save(model, str(d / name))
    _edit_manifest(d, lambda m: m.update(elastic={"onnx": name, "budget_input": "budget_index",
                                                  "budgets": [b["sparsity"] for b in m["budgets"]]}))


def test_elastic_graph_with_corrupt_weights(art, capsys):
    """The pipeline's own elastic graph, one MLP weight changed: every index differs, dense included."""
    m = json.loads((art / "manifest.json").read_text())
    assert m["elastic"] and m["elastic"]["budget_input"] == "budget_index"
    _scale_weight(art / m["elastic"]["onnx"], "layer.0.output.dense.weight")
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 1 and f"{m['elastic']['onnx']}[0]" in one_error(err)
    assert [r[1] for r in table(out) if r[-1].startswith("MISMATCH")] == \
        [f"{m['elastic']['onnx']}[{i}]" for i in range(len(m["budgets"]) + 1)]


def test_elastic_graph_index_mapping(art, capsys):
    """A graph that answers index 0 with budget 1 (and the reverse) is caught; the same graph built
    in manifest order passes (an int64 scalar index works as well as the pipeline's shape [1])."""
    build_elastic(art, name="merged.onnx")
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 0, out + err
    assert [r[1] for r in table(out) if r[2] == "elastic"] == ["merged.onnx[0]", "merged.onnx[1]"]
    build_elastic(art, order=[1, 0], name="merged.onnx")
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 1 and "merged.onnx[0]" in one_error(err)


def test_elastic_graph_broken_entry(art, capsys):
    _edit_manifest(art, lambda m: m["elastic"].update(budget_input="sparsity_index"))
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2 and "sparsity_index" in one_error(err)
    _edit_manifest(art, lambda m: m["elastic"].update(budget_input="budget_index", budgets=[0.6, 0.3]))
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2 and "corrupt" in one_error(err)
    _edit_manifest(art, lambda m: m["elastic"].update(budgets=[b["sparsity"] for b in m["budgets"]], dense_index=0))
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2 and "corrupt" in one_error(err) and "dense_index" in one_error(err)


def test_engines(art, capsys):
    """An engine file the manifest lists: skipped with the reason where TensorRT cannot run here;
    where it can, this file (not a real engine) must be reported corrupt. A listed engine that is
    not there is always an error."""
    (art / "budget_s030.engine").write_bytes(b"not a TensorRT engine")
    _edit_manifest(art, lambda m: m["budgets"][0].update(engine="budget_s030.engine"))
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    why = get_backend("tensorrt").unavailable()  # verify checks engines through the backend registry
    row = next(line for line in out.splitlines() if "budget_s030.engine" in line)
    if why:
        assert rc == 0, out + err
        assert "skipped" in row and why in row
    else:
        assert rc == 2 and "budget_s030.engine" in one_error(err)
    (art / "budget_s030.engine").unlink()
    rc, out, err = cli(capsys, "verify", str(art), "--no-torch")
    assert rc == 2 and "budget_s030.engine" in one_error(err) and "missing" in one_error(err)


# --- the reference itself ------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["timm-vit", "timm-vit-glu-packed", "hf-roberta", "hf-dinov2-swiglu"])
def test_masked_dense_is_the_hard_masked_model(name, tiny_exports):
    """Zeroing the consumer weights beyond each layer's prefix == torch hard masks (fused qkv,
    packed GLU, RoBERTa, SwiGLU + layer scale), including layers left with 0 heads / 0 neurons."""
    enc = tiny_exports[name].enc
    inv, rk, dense, plans = tiny_exports[name].prepared(sparsities=(0.0, 0.5, 0.9))
    feeds = enc.sample_inputs(batch=2, seq_len=9)
    for plan in plans:
        got = run_onnx(masked_dense(dense, plan.heads_per_layer, plan.neurons_per_layer), feeds)
        want = masked_torch(enc, plan, rk, feeds)
        assert max(float(np.abs(a - b).max()) for a, b in zip(got, want)) <= 1e-4, plan.sparsity
