"""The main job's check-and-twin stage (called by :mod:`elastic_export.pipeline`): every budget file
checked against the hard-masked torch model, its lower-precision twins, and the elastic graph."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from tqdm.auto import tqdm

from elastic_export.checks.in_run import check_elastic, check_outputs, masked_outputs, ort_run
from elastic_export.core import onnx_io
from elastic_export.core.manifest import BUDGET_INPUT, DENSE_FILE, ELASTIC_FILE, TWIN_FIELDS, Elastic
from elastic_export.data.calibration import Calibration
from elastic_export.models.encoder import Encoder
from elastic_export.passes import build_elastic_model, dense_counts
from elastic_export.precision import int8_qdq
from elastic_export.precision.fp16 import add_fp16
from elastic_export.precision.int8 import add_int8, parse_precisions  # noqa: F401 - parse_precisions: the stage's
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import BudgetPlan


def qdq_data(precisions: tuple[str, ...], calib: Calibration | None) -> int8_qdq.QdqData | None:
    """The int8-qdq calibration data (``calib`` less a held-out part); None unless int8-qdq is asked for."""
    if int8_qdq.PRECISION not in precisions or calib is None:
        return None
    return int8_qdq.split_heldout(calib.batches, calib.description)


def needs_calibration(precisions: tuple[str, ...]) -> bool:
    """Whether ``precisions`` need the ranking's calibration data (int8-qdq is calibrated on it)."""
    return int8_qdq.PRECISION in precisions


def reference_outputs(encoder: Encoder, plans: list[BudgetPlan], ranking: Ranking, feeds: dict) -> list[list[np.ndarray]]:
    """The hard-masked torch outputs of every budget on ``feeds``, once: the per-budget files and the
    elastic graph are both checked against them."""
    return [masked_outputs(encoder, plan, ranking, feeds) for plan in plans]


def _twins(name: str, fp16: dict, int8: dict, qdq: dict) -> dict:
    """The manifest fields (:data:`TWIN_FIELDS`: file, error) of the fp16, int8 and int8-qdq twins of the
    fp32 file ``name`` (None where absent)."""
    return dict(zip(TWIN_FIELDS, (v for d in (fp16, int8, qdq) for v in d.get(name, (None, None)))))


@dataclass
class Twins:
    """The lower-precision twins of the fp32 files written so far: fp32 file -> (twin file, the
    twin's check: fp16 relative error, int8 / int8-qdq min embedding cosine; None unchecked)."""

    precisions: tuple[str, ...]
    qdq: int8_qdq.QdqData | None
    feeds: dict[str, np.ndarray] | None  # the fp16 / int8 checks' inputs (None: no checks)
    check: bool  # check the int8-qdq twins (on the held-out calibration data)
    fp16: dict[str, tuple[str | None, float | None]] = field(default_factory=dict)
    int8: dict[str, tuple[str | None, float | None]] = field(default_factory=dict)
    int8q: dict[str, tuple[str | None, float | None]] = field(default_factory=dict)

    def add(self, directory: Path, name: str, model: onnx.ModelProto | None = None) -> None:
        """Write (and check) the twins of ``directory/name`` (``model``: that file, already loaded)."""
        if "fp16" in self.precisions:
            self.fp16[name] = add_fp16(model if model is not None else onnx.load(str(directory / name)),
                                       directory, name, self.feeds)
        if "int8" in self.precisions:
            self.int8[name] = add_int8(directory, name, self.feeds)
        if self.qdq is not None:
            self.int8q[name] = int8_qdq.add_qdq(directory, name, self.qdq, check=self.check)

    def fields(self, name: str) -> dict:
        """The manifest fields of the twins of ``name``."""
        return _twins(name, self.fp16, self.int8, self.int8q)

    def qdq_entry(self) -> dict | None:
        """The manifest's ``int8_qdq`` entry (None without int8-qdq twins)."""
        return int8_qdq.manifest_entry(self.qdq) if self.qdq is not None else None


def check_budgets(plans: list[BudgetPlan], names: list[str], directory: Path, feeds: dict,
                  refs: list[list[np.ndarray]] | None, twins: Twins, disable: bool) -> list[float | None]:
    """Check every budget file against its hard-masked torch outputs (``refs``; None: unchecked) and
    write its twins; the max abs errors, in plan order (``disable``: no progress bar)."""
    errors = []
    for i, (plan, name) in enumerate(zip(tqdm(plans, desc="verifying budgets", unit="budget", leave=False,
                                              disable=disable), names)):
        err = None
        if refs is not None:
            err = check_outputs(ort_run(directory / name, feeds), refs[i],
                                f"budget {plan.sparsity}: ONNX differs from the masked model")
        twins.add(directory, name)
        errors.append(err)
    return errors


def write_elastic(dense: onnx.ModelProto, plans: list[BudgetPlan], directory: Path, feeds: dict | None,
                  refs: list[list[np.ndarray]] | None, echo: Callable[[str], None] = print,
                  precision: str = "fp32") -> Elastic:
    """Write the elastic graph (``elastic.onnx``: weights once, ``budget_index`` selects the budget).

    Index b < len(plans) is ``plans[b]``; index len(plans) is the dense model (sparsity 0.0: every
    unit kept), so one graph serves the whole range.

    Args:
        dense: the dense rank-permuted export (saved as ``dense.onnx`` in ``directory``).
        plans: the budgets, in manifest order (budget index b = ``plans[b]``).
        directory: where to write ``elastic.onnx``.
        feeds: sample inputs; when given with ``refs``, every budget index is run in onnxruntime
            and compared with the hard-masked torch model, the dense index with ``dense.onnx``
            (max abs error must be ≤ 1e-4).
        refs: :func:`masked_outputs` of every plan on ``feeds``.
        precision: ``fp16`` also writes ``elastic.fp16.onnx`` (:func:`elastic_export.precision.fp16.to_fp16`),
            checked at every index against the fp32 elastic graph (relative error ≤ 1e-2).

    Returns:
        The manifest's ``elastic`` entry: {onnx, budget_input, budgets (sparsities in index order),
        dense_index, max_abs_error (over all indices, or None without ``feeds``), onnx_fp16,
        fp16_max_rel_error}.
    """
    t0 = time.time()
    full_heads, full_neurons = dense_counts(dense)
    model = build_elastic_model(dense, [p.heads_per_layer for p in plans] + [full_heads],
                                [p.neurons_per_layer for p in plans] + [full_neurons], budget_input=BUDGET_INPUT)
    onnx_io.save(model, directory / ELASTIC_FILE, onnx_io.external_like(directory / DENSE_FILE))
    worst = None
    if feeds is not None and refs is not None:
        worst = check_elastic(directory, feeds, refs + [ort_run(directory / DENSE_FILE, feeds)],
                               [f"budget {p.sparsity}" for p in plans] + [f"dense (index {len(plans)})"])
    size = sum(f.stat().st_size for f in onnx_io.files(directory / ELASTIC_FILE)) / 1e6
    echo(f"elastic graph {ELASTIC_FILE}: {len(plans)} budgets + dense, {size:.1f} MB, built in {time.time() - t0:.1f}s"
         + (f", max err {worst:.1e}" if worst is not None else ""))
    entry = Elastic(onnx=ELASTIC_FILE, budget_input=BUDGET_INPUT, budgets=[p.sparsity for p in plans],
                    dense_index=len(plans), max_abs_error=worst)
    if precision == "fp16":  # checked at every index against the fp32 elastic graph
        per_index = None if feeds is None else [
            {**{k: v.numpy() for k, v in feeds.items()}, BUDGET_INPUT: np.array([b], dtype=np.int64)}
            for b in range(len(plans) + 1)]
        entry.onnx_fp16, entry.fp16_max_rel_error = add_fp16(model, directory, ELASTIC_FILE, per_index)
    return entry
