"""The main job as a user runs it: the default model, the manifest contract, atomic output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from conftest import tiny_encoder

from elastic_export import pipeline
from elastic_export.core.manifest import load_manifest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "elastic_export", *args], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """README command 1: ``elastic-export --budgets 0.1..0.6`` in a fresh directory."""
    cwd = tmp_path_factory.mktemp("readme")
    res = _cli("--budgets", "0.1..0.6", cwd=cwd)
    assert res.returncode == 0, res.stderr[-2000:]
    return cwd / "elastic-out", res


def test_default_run_manifest(default_run):
    out, res = default_run
    m = load_manifest(out)
    assert m["format"] == "elastic-export/1"
    assert m["model"]["source"] == "all-MiniLM-L6-v2" and m["model"]["fingerprint"].startswith("sha256:")
    assert [i["name"] for i in m["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert m["inputs"][0]["shape"] == ["batch", "sequence"]
    assert [o["name"] for o in m["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    assert m["outputs"][0]["shape"] == ["batch", "sequence", 384] and m["outputs"][1]["shape"] == ["batch", 384]
    assert m["tokens"] == 128
    assert [b["sparsity"] for b in m["budgets"]] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    for b in m["budgets"]:
        assert abs(b["achieved_sparsity"] - b["sparsity"]) < 0.01
        assert len(b["heads_per_layer"]) == 6 and len(b["neurons_per_layer"]) == 6
        assert b["engine"] is None and b["max_abs_error"] <= 1e-4
    assert m["ranking"]["method"] == "elastic"
    e = m["elastic"]
    assert e["onnx"] == "elastic.onnx" and e["budget_input"] == "budget_index"
    assert e["budgets"] == [b["sparsity"] for b in m["budgets"]] and e["max_abs_error"] <= 1e-4
    # the weights once: about the dense file's size
    assert abs((out / e["onnx"]).stat().st_size / (out / m["dense"]["onnx"]).stat().st_size - 1) < 0.01
    assert "elastic.onnx" in res.stdout
    assert (out / m["ranking"]["file"]).is_file()
    # the printed table names every budget file
    for b in m["budgets"]:
        assert b["onnx"] in res.stdout


def test_default_run_onnx_files(default_run):
    out, _ = default_run
    m = load_manifest(out)
    files = [m["dense"]["onnx"]] + [b["onnx"] for b in m["budgets"]]
    sizes = [(out / f).stat().st_size for f in files]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    params = [m["dense"]["params"]] + [b["params"] for b in m["budgets"]]
    assert params == sorted(params, reverse=True)
    import numpy as np

    ids = np.array([[101, 2023, 2003, 1037, 3231, 102, 0, 0]], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": (ids > 0).astype(np.int64), "token_type_ids": np.zeros_like(ids)}
    dense_emb = None
    for f in files:
        onnx.checker.check_model(str(out / f))
        sess = ort.InferenceSession(str(out / f), providers=["CPUExecutionProvider"])
        hidden, emb = sess.run(None, feeds)
        assert hidden.shape == (1, 8, 384) and emb.shape == (1, 384)
        if dense_emb is None:
            dense_emb = emb
        else:  # a pruned model still points roughly the same way as the dense one
            assert float((emb * dense_emb).sum()) > 0.3


def test_no_temp_dirs_left(default_run):
    out, _ = default_run
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


def test_ranking_is_deterministic(tmp_path):
    """``rank`` in a fresh process and again in this one (another hash seed, other global RNG states
    after the tests before it) writes the same bytes; one torch thread in both (a test before may have
    set this process's)."""
    import torch

    from elastic_export.cli.main import main

    args = ["rank", "--seq-len", "16", "--calib-size", "4", "--steps", "3", "--out"]
    res = subprocess.run([sys.executable, "-m", "elastic_export", *args, str(tmp_path / "a.safetensors")],
                         capture_output=True, text=True, env={**ENV, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(SystemExit) as done:
            main([*args, str(tmp_path / "b.safetensors")])
    finally:
        torch.set_num_threads(threads)
    assert done.value.code == 0
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def _tiny_dir(tmp_path: Path) -> Path:
    enc = tiny_encoder("hf-bert")
    d = tmp_path / "tiny-bert"
    enc.module.save_pretrained(d)
    return d


def test_reuse_ranking_and_replace_previous_output(tmp_path):
    model = _tiny_dir(tmp_path)
    out = tmp_path / "out"
    opts = pipeline.Options(model=str(model), budgets=(0.2, 0.5), out=str(out), seq_len=16, calib_size=8,
                            method="magnitude")  # the ranking's method is not what this test is about
    first = pipeline.run(opts, echo=lambda s: None)
    ranking = out / first.ranking.file
    saved = tmp_path / "ranking.safetensors"
    saved.write_bytes(ranking.read_bytes())
    opts.ranking, opts.budgets = str(saved), (0.3,)
    second = pipeline.run(opts, echo=lambda s: None)  # a previous artifact set is replaced
    assert [b.sparsity for b in second.budgets] == [0.3]
    assert sorted(p.name for p in out.iterdir()) == ["budget_s030.onnx", "dense.onnx", "elastic.onnx",
                                                     "latency_profile.json", "manifest.json", "ranking.safetensors",
                                                     "report.html"]
    assert (out / "ranking.safetensors").read_bytes() == saved.read_bytes()


def test_failed_run_keeps_previous_output(tmp_path, monkeypatch):
    model = _tiny_dir(tmp_path)
    out = tmp_path / "out"
    opts = pipeline.Options(model=str(model), budgets=(0.2,), out=str(out), seq_len=16, calib_size=8,
                            method="magnitude")  # the ranking's method is not what this test is about
    pipeline.run(opts, echo=lambda s: None)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(*a, **k):
        raise RuntimeError("simulated crash during slicing")

    monkeypatch.setattr(pipeline.BudgetSlicer, "save", boom)
    opts.budgets = (0.4,)
    with pytest.raises(RuntimeError, match="simulated"):
        pipeline.run(opts, echo=lambda s: None)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_manifest_paths_must_stay_inside(tmp_path):
    from elastic_export.core.errors import UserError

    m = {"format": "elastic-export/1", "model": {}, "inputs": [], "outputs": [], "ranking": {"file": "r"},
         "dense": {"onnx": "../outside.onnx"}, "budgets": []}
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="leaves"):
        load_manifest(tmp_path)
    m["dense"]["onnx"] = "/etc/passwd"
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="relative"):
        load_manifest(tmp_path)


def test_timm_name_at_custom_resolution(tmp_path):
    """A timm name built at --image-size is calibrated and exported at that size."""
    opts = pipeline.Options(model="vit_tiny_patch16_224", pretrained=False, image_size=48, budgets=(0.3,),
                            out=str(tmp_path / "out"), calib_size=4, align=8)
    m = pipeline.run(opts, echo=lambda s: None)
    assert m.inputs[0].shape == ["batch", 3, 48, 48]
    assert m.tokens == 9 + 1
    assert all(n % 8 == 0 for n in m.budgets[0].neurons_per_layer)
    assert m.budgets[0].max_abs_error <= 1e-4




def test_readme_serve_on_the_default_run(default_run, tmp_path, capsys):
    """The README's serving commands on the default main job's artifacts, as a user runs them:
    ``elastic-export index elastic-out corpus.jsonl``, ``elastic-export serve elastic-out`` (a port block the
    OS reports free instead of 8000), examples/06_triton_client.py and the README's OpenAI-client and
    search snippet (its URL swapped) against it."""
    import re

    from _helpers import link_copy, serve_process, stop_process

    from elastic_export.core.manifest import load_manifest

    out, _ = default_run
    link_copy(out, tmp_path / "elastic-out")
    docs = {"files": "Use open() in a with statement to read a file.", "loops": "A for loop runs over a sequence.",
            "dicts": "A dictionary maps keys to values.", "errors": "try and except handle an exception."}
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in docs.items()))
    r = subprocess.run([sys.executable, "-m", "elastic_export", "index", "elastic-out", "corpus.jsonl"], cwd=tmp_path,
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    p, port, lines = serve_process("elastic-out", cwd=tmp_path)
    try:
        assert lines[-1].startswith("ready: router 'elastic' + 7 budget models")
        r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "examples" / "06_triton_client.py"),
                            "How do I open a file?", "Use the with statement.", "--url", f"127.0.0.1:{port + 1}"],
                           capture_output=True, text=True, env=ENV, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "served sparsity [0.3, 0.3] (fp32)" in r.stdout
        readme = (Path(__file__).parents[1] / "README.md").read_text().split("## Serving and search\n")[1]
        code = re.findall(r"```python\n(.*?)```", readme, re.S)[0].replace("127.0.0.1:8003", f"127.0.0.1:{port + 3}")
        capsys.readouterr()
        exec(compile(code, "README.md", "exec"), {})
        dims, served, ids = capsys.readouterr().out.strip().split(" ", 2)
        assert dims == "384" and float(served) in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
        assert json.loads(ids.replace("'", '"'))[0] == "files"  # the document about opening files, found first
    finally:
        code, rest = stop_process(p)
    assert code == 0 and "stopped" in rest
    manifest = load_manifest(tmp_path / "elastic-out")
    t = manifest["triton"]
    assert {m["platform"] for m in t["models"]} == {"python"} and len(t["models"]) == 7
    assert manifest["index"]["count"] == 4 and manifest["index"]["corpus"]["path"] == "corpus.jsonl"


def test_docs_runtime_snippet_on_the_default_run(default_run, tmp_path, monkeypatch):
    """docs/runtime.md's first snippet, run literally on the quick start's ``elastic-out``."""
    import re

    import numpy as np

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elastic-out").symlink_to(default_run[0])
    doc = (Path(__file__).parents[1] / "docs" / "runtime.md").read_text()
    code = re.findall(r"```python\n(.*?)```", doc, re.S)[0]
    ns: dict = {}
    exec(compile(code, "docs/runtime.md", "exec"), ns)
    rt = ns["rt"]
    assert rt.sparsities == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6] and ns["s"] in rt.sparsities
    np.testing.assert_allclose(ns["emb"], rt.encode(["How do I open a file?"], sparsity=0.4), atol=1e-6)
    assert set(ns["out"]) == set(rt.output_names)
    readme = (Path(__file__).parents[1] / "README.md").read_text().split("## Runtime\n")[1]
    ns2: dict = {}
    exec(compile(re.findall(r"```python\n(.*?)```", readme, re.S)[0], "README.md", "exec"), ns2)
    np.testing.assert_allclose(ns2["emb"], ns["emb"], atol=1e-6)


def test_docs_python_snippets_on_the_default_run(default_run, tmp_path, monkeypatch):
    """docs/python.md: the Python API snippet, then the elastic graph's, run literally after the quick start."""
    import re

    import numpy as np

    monkeypatch.chdir(tmp_path)
    (tmp_path / "elastic-out").symlink_to(default_run[0])
    doc = (Path(__file__).parents[1] / "docs" / "python.md").read_text()
    api, graph = re.findall(r"```python\n(.*?)```", doc, re.S)
    ns: dict = {}
    exec(compile(api, "docs/python.md", "exec"), ns)
    assert [b.sparsity for b in ns["manifest"].budgets] == [0.25, 0.45]
    assert (tmp_path / "results.json").is_file() and (tmp_path / "results.png").is_file()
    onnx.checker.check_model(onnx.load(tmp_path / "b.onnx"))
    assert len(ns["model"].graph.node) > 0
    ns = {}
    exec(compile(graph, "docs/python.md", "exec"), ns)
    budget = ort.InferenceSession(str(default_run[0] / "budget_s040.onnx"), providers=["CPUExecutionProvider"])
    for got, want in zip(ns["out"], budget.run(None, ns["feeds"])):  # index 3 is the 0.4 budget
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_docs_sentence_transformers_snippets_on_the_default_run(default_run, tmp_path, monkeypatch, capsys):
    """docs/sentence_transformers.md: its ``export-st`` command, then its Python snippet, literally."""
    import re
    import shlex

    import numpy as np
    from _helpers import link_copy

    from elastic_export.cli import main
    from elastic_export.serving.runtime import ElasticRuntime

    monkeypatch.chdir(tmp_path)
    link_copy(default_run[0], tmp_path / "elastic-out")
    doc = (Path(__file__).parents[1] / "docs" / "sentence_transformers.md").read_text()
    (commands,) = re.findall(r"```bash\n(.*?)```", doc, re.S)
    for line in commands.splitlines():
        args = shlex.split(line, comments=True)
        assert args[0] == "elastic-export", line
        with pytest.raises(SystemExit) as e:
            main(args[1:])
        assert e.value.code == 0, capsys.readouterr().err[-2000:]
    (code,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    ns: dict = {}
    exec(compile(code, "docs/sentence_transformers.md", "exec"), ns)
    want = ElasticRuntime.from_dir("elastic-out", sparsities=(0.0, 0.3)).encode(
        ["elastic transformers", "one ranking, many budgets"], sparsity=0.3)
    np.testing.assert_allclose(ns["embeddings"], want, atol=1e-5)
