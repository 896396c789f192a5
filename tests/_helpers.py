"""Shared test helpers: export a tiny encoder once, slice it, run it in onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import torch

from elastic_export.export import export_dense
from elastic_export.inventory import build_inventory
from elastic_export.plans import make_plans
from elastic_export.ranking import Ranking
from elastic_export.reference import hard_mask, ranked_keep
from elastic_export.scoring import METHODS


def ranking_with_empty_layers(enc, inv, seed=3):
    heads, neurons = METHODS["random"](enc, inv, seed=seed)
    heads[0][:] = -1.0
    neurons[-1][:] = -1.0
    return Ranking(heads, neurons, {})


def run_onnx(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.numpy() for k, v in feeds.items()})


def masked_torch(enc, plan, ranking, feeds) -> list[np.ndarray]:
    with torch.no_grad(), hard_mask(enc.blocks(), ranked_keep(plan, ranking)):
        return [t.numpy() for t in enc.export_module()(*feeds.values())]


def max_err(a: list, b: list) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


def prepared(enc, tmp_path, sparsities=(0.0, 0.25, 0.5, 0.9)):
    inv = build_inventory(enc)
    rk = ranking_with_empty_layers(enc, inv)
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    return inv, rk, dense, make_plans(rk, inv, list(sparsities))


def save_sentence_transformer(enc, path, pooling: dict) -> None:
    """A ``save_pretrained`` directory plus a sentence-transformers Transformer / Pooling (with the
    ``pooling`` config) / Normalize module list, as sentence-transformers saves a model."""
    import json

    enc.module.save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))


def link_copy(src, dst, ignore=("triton",)):
    """A copy of an artifact directory made of hard links (cheap), less the folders in ``ignore``.
    Files are shared with ``src``: replace them, never write into them."""
    import os
    import shutil

    shutil.copytree(src, dst, copy_function=os.link, ignore=shutil.ignore_patterns(*ignore))
    return dst
