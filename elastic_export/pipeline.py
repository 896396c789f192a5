"""The main job: model -> inventory -> ranking -> plans -> dense ONNX -> passes -> manifest.

Everything is written to a temporary directory next to ``--out`` and moved into place only when
complete, so an interrupted run never leaves a half-written artifact directory and never damages
the previous one. This module only orchestrates: each stage is an entry point of its own stage
package (:mod:`elastic_export.models.stage`, :mod:`elastic_export.ranking.driver`,
:mod:`elastic_export.export.stage`, :mod:`elastic_export.precision.stage`, :mod:`elastic_export.report.stage`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from elastic_export.core.errors import UserError
from elastic_export.core.fileio import OutputLock, umask
from elastic_export.core.manifest import DENSE_FILE, Manifest
from elastic_export.core.outdir import claim_out, commit_out, make_tmp, prepare_out
from elastic_export.export import stage as export_stage
from elastic_export.models.stage import Encoder, Inventory, load_model
from elastic_export.passes import BudgetSlicer  # noqa: F401 - the slicer the export stage runs (tests patch it here)
from elastic_export.precision import stage as twin_stage
from elastic_export.precision.stage import write_elastic
from elastic_export.ranking.driver import check_device, load_calib, rank_or_reuse
from elastic_export.ranking.plans import check_align, make_plans
from elastic_export.ranking.soft_ranking import ElasticConfig
from elastic_export.report import stage as finish_stage
from elastic_export.report.stage import (  # noqa: F401 - public: the finishing steps on their own
    LAYOUTS,
    check_layout,
    quick_eval_or_warn,
    write_report_or_warn,
    write_st_layout,
)


@dataclass
class Options:
    """Everything the main job needs (the CLI's options)."""

    model: str | None = None
    budgets: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
    out: str = "elastic-out"
    method: str = "elastic"
    calib: str | None = None
    calib_size: int = 256
    batch_size: int = 8
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    resume: bool = False
    checkpoint: str | None = None
    ranking: str | None = None
    align: int = 1
    seq_len: int | None = None  # None: 128, or the model's position count if smaller
    image_size: int | None = None
    pretrained: bool = True
    device: str = "cpu"
    overwrite: bool = False
    seed: int = 0
    verify: bool = True
    trust_remote_code: bool = False
    revision: str | None = None  # hub ids: branch, tag or commit
    tower: str | None = None  # "text" / "vision": one tower of a dual-encoder directory (CLIP, SigLIP)
    precision: str = "fp32"  # comma list: fp16 / int8 also write a twin of every ONNX file (elastic_export.precision.fp16, .int8)
    elastic_graph: bool = True  # also one elastic ONNX whose budget_index input selects the budget
    ort_optimize: bool = False  # also onnxruntime-optimised copies (elastic_export.precision.ort_optimize)
    external_data: bool | None = None  # weights in NAME.onnx.data: True always, None above 2 GiB (onnx_io)
    report: bool = True  # also DIR/report.html (elastic_export.report.page); a failure to render only warns
    layout: str = "artifacts"  # "sentence-transformers": also DIR/sentence-transformers/ (elastic_export.serving.st_layout)
    quick_eval: bool = True  # quality and speed of every (budget, precision) (measure.quick_eval); a failure only warns


def run(opts: Options, echo: Callable[[str], None] = print) -> Manifest:
    """Run the whole pipeline; returns the manifest written to ``opts.out``.

    A second process given the same ``--out`` while this one runs is refused (:class:`OutputLock`).
    """
    if not opts.budgets:
        raise UserError("no budgets given")
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        raise UserError("the main job runs in one process; under torchrun run `-m elastic_export rank` "
                        "(distributed), then the main job with --ranking FILE")
    prepare_out(Path(opts.out), opts.overwrite)
    lock = OutputLock(opts.out)
    claim_out(lock, Path(opts.out), opts.overwrite, echo)  # here if --out's parent exists, else once it is made
    try:
        return _run(opts, lock, echo)
    finally:
        lock.release()


def _run(opts: Options, lock: OutputLock, echo: Callable[[str], None]) -> Manifest:
    """The stages of the main job, ``--out``'s lock taken: load, rank, then (in a temporary
    directory moved into place only when complete) export, slice, check, write the manifest, report."""
    out = Path(opts.out)
    check_device(opts.device)
    precisions = twin_stage.parse_precisions(opts.precision)
    encoder, inventory = _load(opts, echo)
    # int8-qdq: calibrated on the ranking's calibration data, less a held-out part
    calib = load_calib(encoder, opts) if twin_stage.needs_calibration(precisions) else None
    ranking, rank_seconds = rank_or_reuse(encoder, inventory, opts, calib, echo)
    plans = make_plans(ranking, inventory, list(opts.budgets), align=opts.align)
    tmp = make_tmp(lock, out, opts.overwrite, echo)
    try:
        os.chmod(tmp, 0o777 & ~umask())
        dense = export_stage.export_ranked(encoder, ranking, tmp, opts.external_data, echo)
        feeds = encoder.sample_inputs(batch=2, seed=opts.seed + 1)
        twins = twin_stage.Twins(precisions, twin_stage.qdq_data(precisions, calib),
                                 {k: v.numpy() for k, v in feeds.items()} if opts.verify else None, opts.verify)
        twins.add(tmp, DENSE_FILE, dense)
        # with --verify, onnxruntime loads and checks every budget file, so the slicing skips onnx.checker
        names = export_stage.slice_budgets(dense, plans, tmp, not opts.verify, echo)
        refs = twin_stage.reference_outputs(encoder, plans, ranking, feeds) if opts.verify else None
        errors = twin_stage.check_budgets(plans, names, tmp, feeds, refs, twins,
                                          disable=not (opts.verify or len(precisions) > 1))
        elastic = None
        if opts.elastic_graph:
            elastic = write_elastic(dense, plans, tmp, feeds if opts.verify else None, refs, echo,
                                    precision="fp16" if "fp16" in precisions else "fp32")
        manifest = finish_stage.build_manifest(encoder, inventory, dense, tmp, opts.align, twins,
                                               list(zip(plans, names, errors)), elastic, ranking, rank_seconds)
        manifest = finish_stage.finish(tmp, out, manifest, encoder, opts, echo, dense)
        commit_out(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _load(opts: Options, echo: Callable[[str], None]) -> tuple[Encoder, Inventory]:
    """Load the model and count its units, refusing now what would fail after the (long) ranking."""
    encoder, inventory = load_model(opts.model, echo, revision=opts.revision, pretrained=opts.pretrained,
                                    seq_len=opts.seq_len, image_size=opts.image_size,
                                    trust_remote_code=opts.trust_remote_code, tower=opts.tower)
    check_align(inventory, opts.align)
    finish_stage.refuse_early(encoder, inventory, opts.layout, opts.ort_optimize, opts.external_data)
    return encoder, inventory
