"""``elastic-export eval`` and the held-out retrieval set: tiny text and image models exported by the
real pipeline, evaluated from their ONNX files in onnxruntime."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import _perturb

from elastic_export.cli.main import main
from elastic_export.core import results
from elastic_export.core.errors import UserError
from elastic_export.data.retrieval_data import candidate_pairs, heldout_pairs, write_pairs_jsonl
from elastic_export.measure.evaluation import EVAL_RESULTS, evaluate, plot_results
from elastic_export.measure.metrics import bootstrap_ci, knn_accuracy, recall_at
from elastic_export.models.loader import default_model_path
from elastic_export.pipeline import Options, run

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
QUIET = dict(echo=lambda s: None)


# --- fixtures: tiny models, their artifact directories, data --------------------------------------
def _tiny_bert_dir(path: Path, pooling: bool) -> Path:
    """A tiny BERT with the real 30522-token vocabulary, so MiniLM's tokenizer fits it."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    _perturb(BertModel(cfg, add_pooling_layer=False), seed=1).save_pretrained(path)
    src = default_model_path()
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, path / f)
    if pooling:  # a sentence-transformers directory: the artifacts get a sentence_embedding output
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    return path


def _image_folder(path: Path, per_class: int = 10) -> Path:
    """Two classes of small drawn images: reddish discs and bluish bars."""
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    for cls in ("blue_bars", "red_discs"):
        (path / cls).mkdir(parents=True)
        for i in range(per_class):
            if cls == "red_discs":
                bg, fg = (200 + rng.randrange(40), rng.randrange(60), rng.randrange(60)), (255, 230, 200)
            else:
                bg, fg = (rng.randrange(60), rng.randrange(60), 180 + rng.randrange(60)), (20, 20, 20)
            img = Image.new("RGB", (40, 40), bg)
            d = ImageDraw.Draw(img)
            x, y = rng.randrange(4, 20), rng.randrange(4, 20)
            if cls == "red_discs":
                d.ellipse((x, y, x + 16, y + 16), fill=fg)
            else:
                d.rectangle((x, 0, x + 6, 39), fill=fg)
            img.save(path / cls / f"{i:02d}.png")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("eval")


@pytest.fixture(scope="module")
def text_dirs(work) -> list[Path]:
    """Artifacts of one tiny BERT ranked by two methods, plus a second tiny BERT (no pooling config)."""
    pooled = _tiny_bert_dir(work / "bert-pooled", pooling=True)
    plain = _tiny_bert_dir(work / "bert-plain", pooling=False)
    out = []
    for model, method, name in ((pooled, "random", "a-random"), (pooled, "magnitude", "b-magnitude"),
                                (plain, "random", "c-plain")):
        opts = Options(model=str(model), method=method, budgets=(0.3, 0.6), out=str(work / name), seq_len=16,
                       calib_size=8, quick_eval=False, report=False)  # eval reads neither
        run(opts, **QUIET)
        out.append(work / name)
    return out


@pytest.fixture(scope="module")
def pairs_file(work) -> Path:
    return write_pairs_jsonl(work / "pairs.jsonl", heldout_pairs(n=48))


@pytest.fixture(scope="module")
def text_eval(work, text_dirs, pairs_file):
    """``elastic-export eval`` on the three text directories, through the console entry point."""
    out, png = work / "res" / "text.json", work / "res" / "text.png"
    with pytest.raises(SystemExit) as e:
        main(["eval", *map(str, text_dirs), "--pairs", str(pairs_file), "--max-pairs", "40",
              "--out", str(out), "--plot", str(png)])
    assert e.value.code == 0
    return results.load(out).eval_view(), out, png


@pytest.fixture(scope="module")
def image_folder(work) -> Path:
    return _image_folder(work / "images")


@pytest.fixture(scope="module")
def vit_dir(work) -> Path:
    opts = Options(model="vit_tiny_patch16_224", pretrained=False, image_size=32, method="magnitude",
                   budgets=(0.3, 0.6), out=str(work / "vit"), quick_eval=False, report=False)  # eval reads neither
    run(opts, **QUIET)
    return work / "vit"


# --- held-out retrieval set ------------------------------------------------------------------------
def test_heldout_pairs_deterministic_and_sized(tmp_path):
    a = heldout_pairs(n=50)
    assert a == heldout_pairs(n=50) and len(a) == 50
    assert heldout_pairs(n=50, seed=1) != a
    for p in a:
        assert set(p) == {"query", "doc"}
        assert len(p["query"].split()) >= 4 and len(p["doc"].split()) >= 15
        assert p["query"].lower() not in p["doc"].lower()
    assert len({p["query"] for p in a}) == len({p["doc"] for p in a}) == 50
    pool = candidate_pairs()
    assert len(pool) > 1000 and len(heldout_pairs(n=10**6)) == len(pool)
    assert len(heldout_pairs()) == 1000
    # the module's command line, in a fresh interpreter with another hash seed: the same bytes
    write_pairs_jsonl(tmp_path / "here.jsonl", a)
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    res = subprocess.run([sys.executable, "-m", "elastic_export.data.retrieval_data", "--n", "50",
                          "--out", str(tmp_path / "there.jsonl")], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "there.jsonl").read_bytes() == (tmp_path / "here.jsonl").read_bytes()


def test_heldout_pairs_disjoint_from_calibration_text():
    from pydoc_data.topics import topics

    from elastic_export.data.calibration import default_texts

    calib = " ".join(" ".join(topics[k].split()) for k in sorted(topics))
    paragraphs = set(default_texts())
    for p in candidate_pairs():
        assert p["query"] not in calib and p["doc"] not in calib, p["source"]
        assert p["doc"] not in paragraphs


# --- metrics on handmade inputs --------------------------------------------------------------------
def test_recall_and_knn_on_handmade_vectors():
    docs = np.eye(12, dtype=np.float32)
    q = docs.copy()
    q[0] = docs[1]  # query 0 points at doc 1: its own doc is 2nd or worse
    r = recall_at(q, docs)
    assert r[1] == pytest.approx(11 / 12) and r[10] == pytest.approx(1.0)
    feats = np.array([[1, 0.1], [1, 0.2], [1, 0.0], [0, 1], [0.1, 1], [0.2, 1]], dtype=np.float32)
    labels = np.array([0, 0, 0, 1, 1, 1])
    assert knn_accuracy(feats, labels, (1, 3)) == {1: 1.0, 3: 1.0}
    acc = knn_accuracy(feats, labels, (1,), split=0.34)
    assert acc[1] == 1.0


def test_bootstrap_band_holds_the_mean_and_narrows_with_more_samples():
    rng = np.random.default_rng(1)
    hits = rng.random(4000) < 0.8
    widths = []
    for n in (50, 200, 800, 3200):
        lo, hi = bootstrap_ci(hits[:n])
        assert lo <= hits[:n].mean() <= hi and 0.0 <= lo < hi <= 1.0
        widths.append(hi - lo)
    assert widths == sorted(widths, reverse=True) and widths[-1] < widths[0] / 4  # ~ 1 / sqrt(n)
    assert bootstrap_ci(hits[:200]) == bootstrap_ci(hits[:200])  # a fixed seed: the same band every run
    assert bootstrap_ci(np.ones(30)) == [1.0, 1.0] and bootstrap_ci([0.25]) == [0.25, 0.25]
    values = rng.normal(size=300)
    assert bootstrap_ci(values, chunk=7) == bootstrap_ci(values, chunk=1000)  # chunking changes nothing
    lo, hi = bootstrap_ci(values, level=0.5)
    wide = bootstrap_ci(values, level=0.99)
    assert wide[0] < lo < hi < wide[1]


# --- text artifacts --------------------------------------------------------------------------------
def test_text_eval_metrics(text_eval, text_dirs):
    res, _, _ = text_eval
    assert res["datasets"]["pairs"]["count"] == 40
    assert [r["method"] for r in res["results"]] == ["random", "magnitude", "random"]
    assert [r["label"] for r in res["results"]] == ["a-random", "magnitude", "c-plain"]  # methods repeat
    for r in res["results"]:
        budgets = r["budgets"]
        assert [b["sparsity"] for b in budgets] == [0.0, 0.3, 0.6]
        gflops = [b["gflops"] for b in budgets]
        assert gflops == sorted(gflops, reverse=True)
        for b in budgets:
            for key in ("recall@1", "recall@10", "sym_recall@1", "sym_recall@10"):
                assert 0.0 <= b[key] <= 1.0
            assert b["recall@1"] <= b["recall@10"] and b["sym_recall@1"] <= b["sym_recall@10"]
            for key, (lo, hi) in b["ci95"].items():  # every figure has its band, holding it
                assert lo - 1e-9 <= b[key] <= hi + 1e-9
            assert set(b["ci95"]) == {"fidelity_cosine", "recall@1", "recall@10", "sym_recall@1", "sym_recall@10"}
        assert r["samples"] == {"fidelity_cosine": 80, "recall@1": 40, "recall@10": 40, "sym_recall@1": 40,
                                "sym_recall@10": 40}  # every query and document; the queries
        dense = budgets[0]
        assert dense["fidelity_cosine"] == pytest.approx(1.0, abs=1e-5)
        assert dense["recall@1"] == dense["sym_recall@1"] and dense["recall@10"] == dense["sym_recall@10"]
        assert budgets[-1]["fidelity_cosine"] < dense["fidelity_cosine"] - 1e-4
    assert res["settings"]["bootstrap"]["resamples"] == 1000 and res["settings"]["bootstrap"]["level"] == 0.95


def test_text_eval_files_and_table(text_eval):
    res, out, png = text_eval
    assert png.read_bytes()[:8] == PNG_MAGIC
    from PIL import Image

    with Image.open(png) as img:
        img.verify()
    assert sorted(p.name for p in out.parent.iterdir()) == ["text.json", "text.png"]  # no temp files left
    # the in-process API gives the same numbers as the command line
    again = evaluate([r["dir"] for r in res["results"][:1]], pairs=res["datasets"]["pairs"]["source"],
                     max_pairs=40, **QUIET)
    assert again["results"][0]["budgets"] == res["results"][0]["budgets"]


def test_cli_prints_table_and_writes_into_each_dir_by_default(text_dirs, pairs_file, capsys, tmp_path):
    from _helpers import link_copy

    a, b = link_copy(text_dirs[0], tmp_path / "a"), link_copy(text_dirs[1], tmp_path / "b")
    with pytest.raises(SystemExit) as e:
        main(["eval", str(a), str(b), "--pairs", str(pairs_file), "--max-pairs", "8"])
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["dir/method", "sparsity", "GFLOPs", "fidelity", "R@1", "R@10", "sym", "R@10"]
    assert len(lines) == 9 and lines[1].split()[1] == "dense" and "random" in lines[1] and "magnitude" in lines[4]
    assert lines[-2:] == [f"wrote {a / EVAL_RESULTS}", f"wrote {b / EVAL_RESULTS}"]
    assert json.loads((a / EVAL_RESULTS).read_text())["format"] == results.FORMAT  # the one results schema
    in_a, in_b = (results.load(d / EVAL_RESULTS).eval_view() for d in (a, b))
    assert [r["dir"] for r in in_a["results"]] == [str(a), str(b)]  # each directory's own result first
    assert [r["dir"] for r in in_b["results"]] == [str(b), str(a)] and in_b["results"][1] == in_a["results"][0]
    with pytest.raises(SystemExit) as e:  # an explicit --out: that file only
        main(["eval", str(a), "--pairs", str(pairs_file), "--max-pairs", "8", "--out", str(tmp_path / "x.json")])
    assert e.value.code == 0 and (tmp_path / "x.json").is_file()
    assert results.load(a / EVAL_RESULTS).eval_view() == in_a


# --- image artifacts -------------------------------------------------------------------------------
def test_image_eval_knn(vit_dir, image_folder, tmp_path):
    res = evaluate([vit_dir], images=image_folder, **QUIET)
    assert res["datasets"]["images"]["count"] == 20
    assert res["datasets"]["images"]["classes"] == ["blue_bars", "red_discs"]
    budgets = res["results"][0]["budgets"]
    assert [b["sparsity"] for b in budgets] == [0.0, 0.3, 0.6]
    for b in budgets:
        assert 0.0 <= b["knn@1"] <= 1.0 and 0.0 <= b["knn@10"] <= 1.0
        assert "recall@1" not in b
        assert set(b["ci95"]) == {"fidelity_cosine", "knn@1", "knn@10"}
        assert all(lo - 1e-9 <= b[k] <= hi + 1e-9 for k, (lo, hi) in b["ci95"].items())
    assert res["results"][0]["samples"] == {"fidelity_cosine": 20, "knn@1": 20, "knn@10": 20}
    assert budgets[0]["fidelity_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert budgets[-1]["fidelity_cosine"] < budgets[0]["fidelity_cosine"] - 1e-4
    png = plot_results(res, tmp_path / "img.png")
    assert png.read_bytes()[:8] == PNG_MAGIC
    split = evaluate([vit_dir], images=image_folder, split=0.3, **QUIET)
    assert all(0.0 <= b["knn@1"] <= 1.0 for b in split["results"][0]["budgets"])
    # without a folder: fidelity on synthetic images, no k-NN
    bare = evaluate([vit_dir], **QUIET)["results"][0]["budgets"]
    assert bare[0]["fidelity_cosine"] == pytest.approx(1.0, abs=1e-5) and bare[0]["knn@1"] is None


# --- bad input -------------------------------------------------------------------------------------
def test_bad_input_is_a_user_error(tmp_path, text_dirs, vit_dir, image_folder, pairs_file):
    with pytest.raises(UserError, match="no such directory"):
        evaluate([tmp_path / "missing"], **QUIET)
    with pytest.raises(UserError, match="no manifest.json"):
        evaluate([tmp_path], **QUIET)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "a b c d", "doc": "x"}\nnot json\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: not a JSON line"):
        evaluate([text_dirs[0]], pairs=bad, **QUIET)
    bad.write_text('{"query": "a b c d"}\n')
    with pytest.raises(UserError, match="'query' and 'doc'"):
        evaluate([text_dirs[0]], pairs=bad, **QUIET)
    with pytest.raises(UserError, match="is a text model"):
        evaluate([text_dirs[0]], images=image_folder, **QUIET)
    with pytest.raises(UserError, match="is an image model"):
        evaluate([vit_dir], pairs=pairs_file, **QUIET)
    with pytest.raises(UserError, match="sub-folders"):
        evaluate([vit_dir], images=tmp_path, **QUIET)
    # artifacts without tokenizer/ whose model source has no tokenizer
    copy = tmp_path / "no-tokenizer"
    shutil.copytree(text_dirs[0], copy)
    shutil.rmtree(copy / "tokenizer", ignore_errors=True)
    m = json.loads((copy / "manifest.json").read_text())
    m["model"]["source"] = str(tmp_path)
    m.pop("preprocess", None)
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="has no tokenizer"):
        evaluate([copy], pairs=pairs_file, **QUIET)


def test_cli_bad_input_one_line_exit_2(tmp_path, text_dirs, capsys):
    cases = [
        ["eval", str(tmp_path / "missing")],
        ["eval", str(text_dirs[0]), "--pairs", str(tmp_path / "none.jsonl")],
        ["eval", str(text_dirs[0]), "--out", str(tmp_path)],  # a directory, refused before any work
        ["eval", str(text_dirs[0]), "--max-pairs", "1"],
        ["eval", str(tmp_path / "taken")],  # the default output DIR/eval.json cannot be written
    ]
    (tmp_path / "taken" / "eval.json").mkdir(parents=True)  # a directory where the file would go
    shutil.copy(text_dirs[0] / "manifest.json", tmp_path / "taken" / "manifest.json")
    for argv in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert sorted(os.listdir(tmp_path / "taken")) == ["eval.json", "manifest.json"]
    assert not os.listdir(tmp_path / "taken" / "eval.json")


def test_image_embedding_prefers_the_projection():
    """A CLIP vision tower with projection is evaluated on ``image_embeds``, not ``pooler_output``."""
    import numpy as np

    from elastic_export.measure.evaluation import _pool_image

    emb, pooled, tokens = np.ones((2, 4)), np.zeros((2, 8)), np.full((2, 5, 8), 3.0)
    assert _pool_image({"image_embeds": emb, "pooler_output": pooled, "last_hidden_state": tokens}) is emb
    assert _pool_image({"pooler_output": pooled, "last_hidden_state": tokens}) is pooled
    assert np.array_equal(_pool_image({"last_hidden_state": tokens}), np.full((2, 8), 3.0))
