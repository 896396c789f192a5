"""Every registered architecture through the command line, as a user runs it: a tiny model saved
as a directory (``save_pretrained``, or timm's hub layout), then ``inspect``, the main job and
``verify`` through the console entry point (in process: the same ``main()`` the script runs); then
each family's edge configurations (:data:`EDGES`, one layer) through the main job and ``verify``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import save_tiny
from safetensors import safe_open

from elastic_export.cli.main import main
from elastic_export.core.manifest import MANIFEST
from elastic_export.models.adapters import ADAPTERS

CLASSES = sorted(ADAPTERS, key=lambda c: c.__name__)


# Edge configurations: the family's tiny model (``save_tiny``) with the config overrides named here
# (timm: model kwargs; Hugging Face: config attributes, ``pooler`` is ViTModel's add_pooling_layer).
# One layer applies to every family; each other case to the families whose config class has the
# option. Where none is listed: BERT, RoBERTa, XLM-R, DistilBERT, MPNet, CLIP, SigLIP text and Qwen2
# have no bias, token or pooler option (the BERT family's base is saved without its pooler already);
# ModernBERT, Qwen3 and Mistral are bias-free in the base; timm ViT / Eva have 0 registers in the base;
# HF ViT, DINOv2, DINOv3 and CLIP vision always have a class token.
ONE_LAYER = {"DistilBertModel": {"n_layers": 1}, "VisionTransformer": {"depth": 1}, "Eva": {"depth": 1}}
EDGES = {
    "VisionTransformer": {
        "no-class-token": {"class_token": False, "global_pool": "avg"},
        "no-bias": {"qkv_bias": False, "proj_bias": False},  # proj_bias: attention proj and MLP fc1 / fc2
        "no-pooler": {"global_pool": "", "num_classes": 0},  # pooler_output: the unpooled tokens
    },
    "Eva": {
        "no-class-token": {"class_token": False, "global_pool": "avg"},
        "no-bias": {"qkv_bias": False},  # no q_bias / k_bias / v_bias
        "no-pooler": {"global_pool": "", "num_classes": 0},
    },
    "ViTModel": {"no-pooler": {"pooler": False}, "no-bias": {"qkv_bias": False}},
    "Dinov2Model": {"no-bias": {"qkv_bias": False}},
    "DINOv3ViTModel": {
        "zero-registers": {"num_register_tokens": 0},  # the config class's default (the base has 2)
        "no-bias": {"query_bias": False, "key_bias": False, "value_bias": False, "proj_bias": False,
                    "mlp_bias": False},
    },
    "SiglipVisionModel": {"no-pooler": {"vision_use_head": False}},  # no attention-pooling head
    "LlamaModel": {"no-bias": {"attention_bias": False, "mlp_bias": False}},  # the base has both biases
}
# One layer: once per adapter (the first class by name; the block loop is the adapter's, and every
# class has its own base test above).
ONE_LAYER_CLASSES = [c for i, c in enumerate(CLASSES) if all(ADAPTERS[c] != ADAPTERS[d] for d in CLASSES[:i])]
EDGE_CASES = [(c, "one-layer", ONE_LAYER.get(c.__name__, {"num_hidden_layers": 1})) for c in ONE_LAYER_CLASSES] + [
    (c, case, overrides) for c in CLASSES for case, overrides in EDGES.get(c.__name__, {}).items()]


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out, err = capsys.readouterr()
    return e.value.code, out, err


def _main_job(tmp_path: Path, capsys, model_class: type) -> None:
    """The main job on ``tmp_path/model`` at budgets 0.3 and 0.6 (magnitude ranking, 8 calibration
    samples), then ``verify``: every file within 1e-4 of the hard-masked dense model."""
    rc, out, err = _run(["--model", "model", "--budgets", "0.3,0.6", "--method", "magnitude", "--calib-size", "8",
                         "--out", "out", "--no-report"], capsys)
    assert rc == 0, err[-2000:]
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["model"]["architecture"].split(":")[0] == model_class.__name__
    assert [b["sparsity"] for b in m["budgets"]] == [0.3, 0.6]
    assert all(b["max_abs_error"] <= 1e-4 for b in m["budgets"])
    assert m["elastic"] is not None and m["elastic"]["max_abs_error"] <= 1e-4
    assert "quick eval skipped" not in err  # the main job's quick eval runs on every family
    quality = [(r["sparsity"], r["precision"]) for r in m["quick_eval"]["records"] if r["batch"] is None]
    assert quality == [(0.0, "fp32"), (0.3, "fp32"), (0.6, "fp32")]

    rc, out, err = _run(["verify", "out"], capsys)
    assert rc == 0, (out + err)[-2000:]


@pytest.mark.parametrize("model_class", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_inspect_main_job_and_verify(model_class, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_tiny(model_class, tmp_path / "model")
    rc, out, err = _run(["inspect", "--model", "model"], capsys)
    assert rc == 0, err[-2000:]
    assert "GFLOPs" in out and model_class.__name__ in out
    _main_job(tmp_path, capsys, model_class)


def _saved_config(path: Path) -> dict:
    """The saved model's config: timm's ``model_args``, else the Hugging Face config."""
    cfg = json.loads((path / "config.json").read_text())
    return cfg.get("model_args", cfg)


@pytest.mark.parametrize("model_class,case,overrides", EDGE_CASES,
                         ids=[f"{c.__name__}-{case}" for c, case, _ in EDGE_CASES])
def test_edge_config_main_job_and_verify(model_class, case, overrides, tmp_path, capsys, monkeypatch):
    """An edge configuration (:data:`EDGES`, one layer) through the main job and ``verify``, checked
    as the base configuration is (``inspect`` is left to the base test)."""
    monkeypatch.chdir(tmp_path)
    save_tiny(model_class, tmp_path / "model", **overrides)
    cfg = _saved_config(tmp_path / "model")
    assert all(cfg.get(k) == v for k, v in overrides.items() if k != "pooler"), cfg  # the edge is in the saved model
    if "pooler" in overrides:
        with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
            assert not any(k.startswith("pooler.") for k in f.keys())
    _main_job(tmp_path, capsys, model_class)
