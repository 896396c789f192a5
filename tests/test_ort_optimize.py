"""onnxruntime's transformer optimizer on sliced graphs: which fusions fire, and exactness.

Real ONNX exports, real onnxruntime sessions: a tiny BERT (eager attention, as the loader loads
Hugging Face models) sliced to a different head count in every layer (one layer with no heads,
one with no neurons), the real all-MiniLM-L6-v2 at a 50 % budget, a tiny timm ViT, and an
artifact directory written by the pipeline.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import pytest
import torch
from _helpers import max_err, minilm_small_export, run_onnx

from elastic_export.core.errors import UserError
from elastic_export.export.dense import export_dense
from elastic_export.models.inventory import build_inventory
from elastic_export.models.loader import wrap_module
from elastic_export.passes import slice_model
from elastic_export.precision.ort_optimize import (
    MANIFEST_KEY,
    optimize_artifacts,
    optimize_onnx,
    optimized_name,
    sample_feeds,
    uniform_heads,
)
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import make_plans
from elastic_export.ranking.scoring import METHODS


def _tiny_bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                     intermediate_size=96, max_position_embeddings=40, attn_implementation="eager")
    torch.manual_seed(0)
    module = BertModel(cfg, add_pooling_layer=False)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return wrap_module(module.eval(), source="tiny:bert-eager", seq_len=16,
                       extras={"pooling": "mean", "normalize": True})


@pytest.fixture(scope="module")
def bert_graphs(tmp_path_factory):
    """(dense, sliced) ONNX paths of a tiny BERT; the sliced one keeps 4, 3, 1, 0 heads."""
    tmp = tmp_path_factory.mktemp("bert")
    enc = _tiny_bert()
    inv = build_inventory(enc)
    heads, neurons = METHODS["random"](enc, inv, seed=3)
    dense = export_dense(enc, Ranking(heads, neurons, {}), tmp / "dense.onnx")
    sliced = slice_model(dense, [4, 3, 1, 0], [96, 40, 0, 17])
    onnx.save(sliced, str(tmp / "budget.onnx"))
    return tmp / "dense.onnx", tmp / "budget.onnx"


def _ops(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def test_sliced_bert_fuses_attention_per_layer(bert_graphs):
    _, budget = bert_graphs
    assert uniform_heads(onnx.load(str(budget))) == (0, 0)  # layers differ: the optimizer reads the reshapes
    res = optimize_onnx(budget)
    assert res.path.endswith("budget.opt.onnx") and res.method == "transformers" and res.model_type == "bert"
    ops = _ops(res.path)
    # one fused Attention per layer that keeps heads (3 of 4), each with its own head count
    assert ops["Attention"] == 3
    heads = sorted(a.i for n in onnx.load(res.path).graph.node if n.op_type == "Attention"
                   for a in n.attribute if a.name == "num_heads")
    assert heads == [1, 3, 4]
    assert ops["SkipLayerNormalization"] >= 4
    assert ops["BiasGelu"] + ops["FastGelu"] + ops["Gelu"] == 3  # layer 2 keeps no neurons
    assert "MultiHeadAttention" not in ops and ops["Softmax"] == 0
    assert res.fused["Attention"] == 3 and res.max_abs_error <= 1e-4


def test_optimised_matches_with_any_padding(bert_graphs):
    _, budget = bert_graphs
    src = onnx.load(str(budget))
    out = optimize_onnx(budget, budget.with_name("padded.opt.onnx"), verify=False)
    feeds = sample_feeds(src, batch=4, seq_len=12, seed=5)
    feeds["attention_mask"][3] = [1, 0] * 6  # holes, besides the right- and left-padded rows
    torch_feeds = {k: torch.from_numpy(v) for k, v in feeds.items()}
    assert max_err(run_onnx(src, torch_feeds), run_onnx(onnx.load(out.path), torch_feeds)) <= 1e-4


def test_dense_needs_the_head_count(bert_graphs):
    """The dense export reshapes to [B, N, -1, d]: attention fuses only when the head count is given."""
    dense, _ = bert_graphs
    assert uniform_heads(onnx.load(str(dense))) == (4, 64)
    given = optimize_onnx(dense)
    detected = optimize_onnx(dense, dense.with_name("detect.opt.onnx"), detect_heads=True)
    assert given.fused.get("Attention") == 4
    assert detected.fused.get("Attention", 0) == 0
    assert given.max_abs_error <= 1e-4 and detected.max_abs_error <= 1e-4


def test_ort_fallback_method(bert_graphs):
    _, budget = bert_graphs
    res = optimize_onnx(budget, budget.with_name("ort.opt.onnx"), method="ort")
    assert res.method == "ort" and res.model_type is None and res.max_abs_error <= 1e-4
    assert "Attention" not in res.fused  # the session optimiser does not fuse this attention
    assert res.nodes_after < res.nodes_before


def test_refuses_bad_requests(bert_graphs, tmp_path):
    _, budget = bert_graphs
    with pytest.raises(UserError, match="choose from"):
        optimize_onnx(budget, method="tensorrt")
    with pytest.raises(UserError, match="overwrite its source"):
        optimize_onnx(budget, budget)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="not a readable ONNX"):
        optimize_onnx(bad)
    assert optimized_name("budget_s030.onnx") == "budget_s030.opt.onnx"


def test_minilm_budget_with_mixed_heads(minilm, minilm_small, tmp_path):
    """The real all-MiniLM-L6-v2 at 50 %, magnitude-ranked (the dense export: the session's ``minilm_small``)."""
    inv = build_inventory(minilm)
    ranking, dense = minilm_small_export(minilm, minilm_small)
    plan = make_plans(ranking, inv, [0.5])[0]
    assert len(set(plan.heads_per_layer)) > 1 and min(plan.heads_per_layer) > 0
    onnx.save(slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer), str(tmp_path / "budget_s050.onnx"))
    res = optimize_onnx(tmp_path / "budget_s050.onnx")
    assert res.fused["Attention"] == 6
    assert res.fused["SkipLayerNormalization"] == 12
    assert res.fused["EmbedLayerNormalization"] == 1
    assert res.fused.get("BiasGelu", 0) + res.fused.get("FastGelu", 0) == 6
    assert res.max_abs_error <= 1e-4
    got = sorted(a.i for n in onnx.load(res.path).graph.node if n.op_type == "Attention"
                 for a in n.attribute if a.name == "num_heads")
    assert got == sorted(plan.heads_per_layer)


def test_timm_vit_is_optimised_and_exact(tmp_path):
    import timm

    torch.manual_seed(0)
    module = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=0).eval()
    enc = wrap_module(module, source="timm:vit_tiny_patch16_224")
    inv = build_inventory(enc)
    heads, neurons = METHODS["magnitude"](enc, inv)
    ranking = Ranking(heads, neurons, {})
    plan = make_plans(ranking, inv, [0.4])[0]
    dense = export_dense(enc, ranking, tmp_path / "dense.onnx")
    onnx.save(slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer), str(tmp_path / "b.onnx"))
    res = optimize_onnx(tmp_path / "b.onnx")
    assert res.method == "transformers" and res.model_type == "vit"
    assert res.fused.get("SkipLayerNormalization", 0) > 0
    assert res.max_abs_error <= 1e-4
    feeds = {k: torch.from_numpy(v) for k, v in sample_feeds(onnx.load(str(tmp_path / "b.onnx")), batch=2).items()}
    assert max_err(run_onnx(onnx.load(str(tmp_path / "b.onnx")), feeds), run_onnx(onnx.load(res.path), feeds)) <= 1e-4


def test_optimize_artifacts_updates_manifest(tmp_path):
    from elastic_export.core.manifest import load_manifest, resolve
    from elastic_export.pipeline import Options, run

    out = tmp_path / "vit"
    run(Options(model="vit_tiny_patch16_224", pretrained=False, image_size=32, budgets=(0.3, 0.6),
                method="magnitude", out=str(out), verify=False, quick_eval=False, report=False),  # not read here
        echo=lambda s: None)
    lines: list[str] = []
    results = optimize_artifacts(out, update_manifest=True, echo=lines.append)
    assert sorted(results) == ["budget_s030.onnx", "budget_s060.onnx", "dense.onnx"] and len(lines) == 3
    m = load_manifest(out)
    assert m["dense"][MANIFEST_KEY] == "dense.opt.onnx"
    for b in m["budgets"]:
        path = resolve(out, b[MANIFEST_KEY])
        assert path.is_file() and path.name == optimized_name(b["onnx"])
    recorded = json.loads((out / "manifest.json").read_text())["ort_optimize"]["models"]
    assert recorded["dense.onnx"]["method"] == "transformers" and recorded["dense.onnx"]["onnx"] == "dense.opt.onnx"
    assert all(r.max_abs_error <= 1e-4 for r in results.values())
    assert np.isfinite([r.max_abs_error for r in results.values()]).all()


def test_cli_ort_optimize_writes_checked_copies(tmp_path):
    """``--ort-optimize`` adds an optimised copy of the dense model and of every budget, listed in
    the manifest, each matching its source."""
    from conftest import tiny_encoder

    from elastic_export.cli.main import main
    from elastic_export.core.manifest import load_manifest

    model = tmp_path / "tiny-bert"
    tiny_encoder("hf-bert").module.save_pretrained(model)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(model), "--budgets", "0.3,0.6", "--seq-len", "16", "--method", "magnitude",
              "--no-elastic-graph", "--no-quick-eval", "--no-report", "--ort-optimize", "--out", str(out)])
    assert exit_.value.code == 0
    m = load_manifest(out)
    ids = torch.tensor([[5, 17, 300, 9, 2, 0], [7, 8, 9, 0, 0, 0]])
    feeds = {"input_ids": ids, "attention_mask": (ids > 0).long(), "token_type_ids": torch.zeros_like(ids)}
    for entry in [m["dense"], *m["budgets"]]:
        assert entry[MANIFEST_KEY] == optimized_name(entry["onnx"])
        assert max_err(run_onnx(onnx.load(str(out / entry[MANIFEST_KEY])), feeds),
                       run_onnx(onnx.load(str(out / entry["onnx"])), feeds)) <= 1e-4
    assert set(m["ort_optimize"]["models"]) == {e["onnx"] for e in [m["dense"], *m["budgets"]]}
