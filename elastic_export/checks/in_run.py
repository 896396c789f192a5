"""The main job's in-run checks: every file it writes against the hard-masked torch model (the reference),
through the one comparison (:func:`elastic_export.checks.compare.compare_outputs`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from elastic_export.checks.compare import ATOL, compare_outputs
from elastic_export.core.manifest import BUDGET_INPUT, ELASTIC_FILE
from elastic_export.models.encoder import Encoder
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import BudgetPlan
from elastic_export.ranking.reference import hard_mask, ranked_keep
from elastic_export.targets.onnxruntime import cpu_session


def masked_outputs(encoder: Encoder, plan: BudgetPlan, ranking: Ranking, feeds: dict) -> list[np.ndarray]:
    """The hard-masked torch model's outputs for one budget: the reference every artifact meets."""
    with torch.no_grad(), hard_mask(encoder.blocks(), ranked_keep(plan, ranking)):
        return [t.numpy() for t in encoder.export_module()(*feeds.values())]


def check_outputs(got: list[np.ndarray], want: list[np.ndarray], what: str) -> float:
    """The max abs error of ``got`` against ``want`` (:func:`elastic_export.checks.compare.compare_outputs`;
    the float32 difference, as the manifest has always recorded it).

    Raises:
        RuntimeError: ``"{what} by {error}"`` above :data:`elastic_export.checks.compare.ATOL`.
    """
    result = compare_outputs(got, want, ATOL, dtype=np.float32)
    if not result.ok:
        raise RuntimeError(f"{what} by {result.max_abs:.2e}" if result.max_abs is not None else f"{what}: {result.problem}")
    return result.max_abs


def ort_run(path: Path, feeds: dict) -> list[np.ndarray]:
    """The outputs of the ONNX file ``path`` (onnxruntime CPU) on torch ``feeds``."""
    return cpu_session(path).run(None, {k: v.numpy() for k, v in feeds.items()})


def check_elastic(directory: Path, feeds: dict, wants: list[list[np.ndarray]], labels: list[str]) -> float:
    """Run ``elastic.onnx`` at every index b and compare with ``wants[b]``; the largest max abs error.

    Raises:
        RuntimeError: an index differs by more than 1e-4.
    """
    sess = cpu_session(directory / ELASTIC_FILE)
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    worst = 0.0
    for b, (want, label) in enumerate(zip(wants, labels)):
        got = sess.run(None, {**np_feeds, BUDGET_INPUT: np.array([b], dtype=np.int64)})
        worst = max(worst, check_outputs(got, want, f"elastic graph, {label}: differs from the reference"))
    return worst
