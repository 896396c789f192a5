"""The main job's finishing stage (called by :mod:`elastic_export.pipeline`): the early refusals of
what the finish would fail on, the manifest, and what derives from the written artifacts (the
sentence-transformers layout, onnxruntime-optimised copies, the quick eval, the report)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Protocol

import onnx

from elastic_export import __version__
from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.manifest import (
    DENSE_FILE,
    RANKING_FILE,
    Budget,
    Dense,
    Elastic,
    Manifest,
    ModelInfo,
    RankingInfo,
    TensorSpec,
    io_specs,
    write_manifest,
)
from elastic_export.models import preprocess, text
from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory
from elastic_export.precision.ort_optimize import EXTERNAL_REFUSAL, optimize_artifacts
from elastic_export.precision.stage import Twins
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import BudgetPlan
from elastic_export.serving import st_layout

LAYOUTS = ("artifacts", st_layout.LAYOUT)


class FinishOptions(Protocol):
    """The main job's options this stage reads (:class:`elastic_export.pipeline.Options` has them)."""

    layout: str
    ort_optimize: bool
    quick_eval: bool
    report: bool
    calib: str | None
    calib_size: int
    seed: int


def refuse_early(encoder: Encoder, inventory: Inventory, layout: str, ort_optimize: bool,
                 external_data: bool | None) -> None:
    """Refuse now, before the (long) ranking, what the finish would fail on: onnxruntime-optimised
    copies of weights in external data, an unknown or unservable ``--layout``."""
    if ort_optimize and onnx_io.needs_external(inventory.total_params * 4, external_data):
        raise UserError(EXTERNAL_REFUSAL.format(src=DENSE_FILE))
    check_layout(layout, encoder)


def check_layout(layout: str, encoder: Encoder) -> None:
    """Refuse an unknown ``--layout``, and ``sentence-transformers`` for a model it cannot serve."""
    if layout not in LAYOUTS:
        raise UserError(f"--layout {layout}: unknown; choose from {', '.join(LAYOUTS)}")
    if layout == st_layout.LAYOUT:
        manifest = Manifest(model=ModelInfo(source=encoder.source, revision=encoder.revision, modality=encoder.modality))
        st_layout.check_text(manifest, f"--model {encoder.source}")
        st_layout.st_modules(st_layout.source_dir(manifest), encoder.output_names())


def write_st_layout(tmp: Path, out: Path, manifest: Manifest, echo: Callable[[str], None]) -> dict:
    """Write ``tmp/sentence-transformers/``: a folder per budget and precision; returns its manifest entry."""
    folders = st_layout.write_layout(tmp, tmp / st_layout.LAYOUT, manifest=manifest)
    echo(f"sentence-transformers layout: {len(folders)} folders in {out / st_layout.LAYOUT}")
    return {"dir": st_layout.LAYOUT, "folders": [f.name for f in folders]}


def write_report_or_warn(directory: Path, out: Path, echo: Callable[[str], None]) -> None:
    """Render ``directory/report.html`` (shown as ``out``); a failure only warns: it never costs the artifacts."""
    try:
        from elastic_export.report.page import write_report

        write_report(directory, name=str(out))
    except Exception as e:  # noqa: BLE001 - the report is a view of the artifacts, not one of them
        echo(f"warning: report.html not written ({type(e).__name__}: {first_line(e)})")


def quick_eval_or_warn(directory: Path, manifest: Manifest, encoder: Encoder, opts: FinishOptions,
                       echo: Callable[[str], None], dense: onnx.ModelProto | None = None) -> Manifest:
    """Add the ``quick_eval`` entry (:mod:`elastic_export.measure.quick_eval`) to the manifest in ``directory``;
    a failure only warns (the entry is then null): the measurements never cost the artifacts. ``dense``:
    the dense model in memory, when the caller has it (else read from its file)."""
    from elastic_export.measure.quick_eval import run_quick_eval

    try:
        entry = run_quick_eval(directory, manifest, encoder, opts.calib, opts.calib_size, opts.seed, echo, dense)
    except Exception as e:  # noqa: BLE001 - a view of the artifacts, not one of them
        echo(f"warning: quick eval skipped ({type(e).__name__}: {first_line(e)})")
        entry = None
    manifest.quick_eval = entry
    write_manifest(directory, manifest)
    return manifest


def build_manifest(encoder: Encoder, inventory: Inventory, dense: onnx.ModelProto, directory: Path, align: int,
                   twins: Twins, rows: list[tuple[BudgetPlan, str, float | None]], elastic: Elastic | None,
                   ranking: Ranking, rank_seconds: float | None) -> Manifest:
    """The manifest of the artifact set in ``directory`` (``rows``: each budget's plan, file and max abs error)."""
    outputs = io_specs(onnx.shape_inference.infer_shapes(onnx_io.weightless(dense)).graph.output)
    return Manifest(
        tool=f"elastic-export {__version__}",
        model=ModelInfo(source=encoder.source, architecture=encoder.architecture, fingerprint=encoder.fingerprint(),
                        modality=encoder.modality, tower=encoder.tower or None, repo_id=encoder.repo_id,
                        revision=encoder.revision),
        inputs=[TensorSpec(**s) for s in io_specs(dense.graph.input)],
        outputs=[TensorSpec(**s) for s in outputs],
        tokens=inventory.tokens,
        preprocess=preprocess.artifact_entry(encoder.data_config, directory) or text.artifact_entry(encoder, directory),
        prunable_gflops=inventory.prunable_flops / 1e9,
        align=align,
        precisions=list(twins.precisions),
        dense=Dense(onnx=DENSE_FILE, **twins.fields(DENSE_FILE), gflops=inventory.total_flops / 1e9,
                    params=inventory.total_params),
        budgets=[Budget(sparsity=p.sparsity, achieved_sparsity=round(p.achieved_sparsity, 6), gflops=p.gflops,
                        params=p.params, onnx=name, engine=None, heads_per_layer=p.heads_per_layer,
                        neurons_per_layer=p.neurons_per_layer, max_abs_error=err, **twins.fields(name))
                 for p, name, err in rows],
        elastic=elastic,
        int8_qdq=twins.qdq_entry(),
        ranking=RankingInfo(file=RANKING_FILE, method=ranking.meta.get("method"), seconds=rank_seconds),
    )


def finish(tmp: Path, out: Path, manifest: Manifest, encoder: Encoder, opts: FinishOptions,
           echo: Callable[[str], None], dense: onnx.ModelProto | None = None) -> Manifest:
    """Write the manifest into ``tmp`` (shown as ``out``) and what is derived from the artifacts
    (sentence-transformers layout, onnxruntime-optimised copies, quick eval, report); the final manifest.
    ``dense``: the dense model in memory (the quick eval reads its vocabulary)."""
    if opts.layout == st_layout.LAYOUT:
        manifest.sentence_transformers = write_st_layout(tmp, out, manifest, echo)
    write_manifest(tmp, manifest)
    if opts.ort_optimize:
        optimize_artifacts(tmp, update_manifest=True, echo=echo)
        manifest = Manifest.load(tmp)
    if opts.quick_eval:
        manifest = quick_eval_or_warn(tmp, manifest, encoder, opts, echo, dense)
    if opts.report:
        write_report_or_warn(tmp, out, echo)
    return manifest
