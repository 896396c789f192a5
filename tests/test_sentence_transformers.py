"""The sentence-transformers layout (``export-st`` and ``--layout sentence-transformers``): every
(budget, precision) folder loads in the real sentence-transformers library (ONNX backend, through
Optimum's ORTModelForFeatureExtraction) and ``model.encode(texts)`` equals the project's runtime on
the same file. Bad input ends with exit code 2, one ``error:`` line and nothing written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _helpers import save_sentence_transformer
from conftest import _perturb, tiny_encoder

from elastic_export.cli.main import main
from elastic_export.serving.runtime import ElasticRuntime

TEXTS = ["the cat sat on the mat", "a dog ran in the park with a red ball", "hello world", "park",
         "the quick brown fox jumps over the lazy dog and the cat"]
WORDS = ("the a cat dog sat on mat ran in park with red ball hello world quick brown fox jumps over lazy and "
         "model budget onnx").split()
PRECISIONS = ("fp32", "fp16", "int8")


def _tokenizer(path: Path) -> None:
    """A WordPiece tokenizer of under 100 tokens (the tiny BERT has 512 ids)."""
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz",
             *(f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz")]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True).save_pretrained(path)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("st")


@pytest.fixture(scope="module")
def st_model(work) -> Path:
    """A tiny sentence-transformers BERT directory: Transformer -> mean Pooling -> Normalize."""
    path = work / "model"
    save_sentence_transformer(tiny_encoder("hf-bert"), path, {"word_embedding_dimension": 32,
                                                              "pooling_mode_mean_tokens": True})
    _tokenizer(path)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64, "do_lower_case": False}))
    return path


def _main(*args: str) -> int:
    with pytest.raises(SystemExit) as done:
        main([*map(str, args)])
    return done.value.code


@pytest.fixture(scope="module")
def artifacts(work, st_model) -> Path:
    """The main job with --layout sentence-transformers and every precision (2 budgets)."""
    out = work / "art"
    code = _main("--model", st_model, "--budgets", "0.3,0.6", "--method", "magnitude", "--seq-len", "16",
                 "--precision", ",".join(PRECISIONS), "--no-elastic-graph", "--no-report",
                 "--layout", "sentence-transformers", "--out", out)
    assert code == 0
    return out


def _encode(folder: Path) -> tuple[np.ndarray, object]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), backend="onnx", device="cpu")
    assert type(model[0].auto_model).__name__ == "ORTModelForFeatureExtraction"
    return model.encode(TEXTS, batch_size=len(TEXTS)), model.tokenizer  # one batch: int8's dynamic scales match


def _runtime(art: Path, tokenizer, sparsity: float, precision: str, pooled: bool = True) -> np.ndarray:
    """The project's runtime on the same texts (one batch, padded as sentence-transformers pads)."""
    rt = ElasticRuntime.from_dir(art, precision=precision)
    tok = tokenizer(TEXTS, padding=True, truncation=True, return_tensors="np")
    out = rt.run({k: tok[k].astype(np.int64) for k in rt.input_names}, sparsity=sparsity)
    if pooled:
        return out["sentence_embedding"]
    mask = tok["attention_mask"][..., None].astype(np.float32)
    return (out["last_hidden_state"] * mask).sum(1) / mask.sum(1)


def test_main_job_layout_loads_in_sentence_transformers(artifacts):
    manifest = json.loads((artifacts / "manifest.json").read_text())
    st = artifacts / manifest["sentence_transformers"]["dir"]
    names = [f"{tag}-{p}" for tag in ("s030", "s060") for p in PRECISIONS]
    assert manifest["sentence_transformers"]["folders"] == names
    assert sorted(p.name for p in st.iterdir()) == sorted(names)
    for name in names:
        folder = st / name
        info = json.loads((folder / "elastic_export.json").read_text())
        assert (folder / "onnx" / "model.onnx").read_bytes() == (artifacts / info["onnx"]).read_bytes()
        assert not list(folder.glob("*.safetensors"))  # the torch weights stay behind
        got, tokenizer = _encode(folder)
        want = _runtime(artifacts, tokenizer, info["sparsity"], info["precision"])
        assert got.shape == (len(TEXTS), 32)
        assert np.abs(got - want).max() <= 1e-4, name
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # the Normalize module ran


def test_export_st_subcommand(artifacts, work, capsys):
    out = work / "st-out"
    assert _main("export-st", artifacts, "--out", out, "--budgets", "0.6", "--precision", "int8,fp32") == 0
    assert capsys.readouterr().out.split() == ["wrote", str(out / "s060-int8"), "wrote", str(out / "s060-fp32")]
    assert sorted(p.name for p in out.iterdir()) == ["s060-fp32", "s060-int8"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]  # no temp dir, no lock
    same = artifacts / "sentence-transformers" / "s060-int8"
    assert sorted(p.name for p in (out / "s060-int8").rglob("*")) == sorted(p.name for p in same.rglob("*"))
    got, tokenizer = _encode(out / "s060-fp32")
    assert np.abs(got - _runtime(artifacts, tokenizer, 0.6, "fp32")).max() <= 1e-4


def test_plain_hf_directory_gets_mean_pooling(work):
    """No modules.json: Transformer + mean Pooling, the embedding the project ranks such a model with;
    with --external-data the model file's weights file goes along, under the name the model gives it."""
    plain, out = work / "plain", work / "plain-art"
    tiny = tiny_encoder("hf-bert")
    _perturb(tiny.module, seed=2).save_pretrained(plain)
    _tokenizer(plain)
    assert _main("--model", plain, "--budgets", "0.5", "--method", "magnitude", "--seq-len", "16", "--no-verify",
                 "--no-elastic-graph", "--no-report", "--external-data", "--out", out) == 0
    assert _main("export-st", out, "--out", work / "plain-st") == 0
    folder = work / "plain-st" / "s050-fp32"
    assert sorted(p.name for p in (folder / "onnx").iterdir()) == ["budget_s050.onnx.data", "model.onnx"]
    modules = json.loads((folder / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling"]
    got, tokenizer = _encode(folder)
    assert np.abs(got - _runtime(out, tokenizer, 0.5, "fp32", pooled=False)).max() <= 1e-4


def _snapshot(root: Path) -> dict[str, float]:
    return {os.path.relpath(os.path.join(d, f), root): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, dirs, files in os.walk(root) for f in [*files, *dirs]}


def _bad(capsys, root: Path, *args, expect: str) -> None:
    before = _snapshot(root)
    assert _main(*args) == 2
    captured = capsys.readouterr()
    lines = [x for x in captured.err.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error:")]  # the main job logs its progress first
    assert len(errors) == 1 and lines[-1] == errors[0] and expect in errors[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert _snapshot(root) == before


def test_bad_input(artifacts, st_model, work, tmp_path, capsys):
    out = tmp_path / "new"
    _bad(capsys, work, "export-st", artifacts, "--out", out, "--budgets", "0.45", expect="0.45 is not one of")
    _bad(capsys, work, "export-st", artifacts, "--out", out, "--precision", "bf16", expect="unknown precision 'bf16'")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("keep")
    _bad(capsys, tmp_path, "export-st", artifacts, "--out", tmp_path / "full", expect="is not empty")
    _bad(capsys, work, "export-st", work / "nowhere", "--out", out, expect="no manifest.json")
    plain = tmp_path / "plain"  # the source without its modules: the graph's embedding is sentence_embedding
    shutil.copytree(st_model, plain, ignore=shutil.ignore_patterns("modules.json", "1_Pooling"))
    _bad(capsys, work, "export-st", artifacts, "--out", out, "--model", plain, expect="'sentence_embedding' output")
    no_fp16 = tmp_path / "no-fp16"  # an artifact directory exported without --precision fp16
    shutil.copytree(artifacts, no_fp16, ignore=shutil.ignore_patterns("*.fp16.onnx", "sentence-transformers"))
    manifest = json.loads((no_fp16 / "manifest.json").read_text())
    manifest["precisions"] = ["fp32", "int8"]
    for b in manifest["budgets"]:
        b["onnx_fp16"] = None
    (no_fp16 / "manifest.json").write_text(json.dumps(manifest))
    _bad(capsys, tmp_path, "export-st", no_fp16, "--out", out, "--precision", "fp16", expect="has no fp16 file")
    manifest["model"]["modality"] = "image"  # the manifest of an image encoder
    (no_fp16 / "manifest.json").write_text(json.dumps(manifest))
    _bad(capsys, tmp_path, "export-st", no_fp16, "--out", out, expect="not a text encoder")
    assert not out.exists()


def test_layout_refused_for_image_models_before_ranking(tmp_path, capsys):
    from conftest import save_tiny
    from transformers import ViTModel

    save_tiny(ViTModel, tmp_path / "vit")
    _bad(capsys, tmp_path, "--model", tmp_path / "vit", "--budgets", "0.5", "--method", "magnitude",
         "--layout", "sentence-transformers", "--out", tmp_path / "out", expect="not a text encoder")
