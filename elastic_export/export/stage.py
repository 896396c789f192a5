"""The main job's export stage (called by :mod:`elastic_export.pipeline`): the ranking file, the dense
rank-permuted ONNX, and one sliced ONNX file per budget."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import onnx
from tqdm.auto import tqdm

from elastic_export.core import onnx_io
from elastic_export.core.budgets import budget_tag
from elastic_export.core.manifest import DENSE_FILE, RANKING_FILE
from elastic_export.export.dense import export_dense
from elastic_export.models.encoder import Encoder
from elastic_export.passes import BudgetSlicer
from elastic_export.ranking.file import Ranking, save_ranking
from elastic_export.ranking.plans import BudgetPlan


def export_ranked(encoder: Encoder, ranking: Ranking, directory: Path, external_data: bool | None,
                  echo: Callable[[str], None]) -> onnx.ModelProto:
    """Save the ranking and export the dense rank-permuted ONNX (``dense.onnx``) into ``directory``."""
    save_ranking(ranking, directory / RANKING_FILE)
    t0 = time.time()
    dense = export_dense(encoder, ranking, directory / DENSE_FILE, external_data)
    echo(f"exported dense ONNX in {time.time() - t0:.1f}s")
    return dense


def slice_budgets(dense: onnx.ModelProto, plans: list[BudgetPlan], directory: Path, full_check: bool,
                  echo: Callable[[str], None]) -> list[str]:
    """Write one ONNX file per budget into ``directory``; their names, in plan order.

    ``full_check``: run ``onnx.checker`` on every file (the main job skips it when ``--verify``
    loads and checks every file in onnxruntime; the passes still check each graph in memory).
    """
    t0 = time.time()
    names = []
    slicer = BudgetSlicer(dense, external=onnx_io.external_like(directory / DENSE_FILE))
    for plan in tqdm(plans, desc="slicing budgets", unit="budget", leave=False):
        names.append(f"budget_{budget_tag(plan.sparsity)}.onnx")
        slicer.save(plan.heads_per_layer, plan.neurons_per_layer, directory / names[-1], full_check=full_check)
    del slicer
    echo(f"sliced {len(plans)} budgets from the dense ONNX in {time.time() - t0:.1f}s")
    return names
