"""The main job: model -> inventory -> ranking -> plans -> dense ONNX -> passes -> manifest.

Everything is written to a temporary directory next to ``--out`` and moved into place only when
complete, so an interrupted run never leaves a half-written artifact directory and never damages
the previous one.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from tqdm.auto import tqdm

from elastic_export import __version__
from elastic_export.checks.in_run import check_elastic, check_outputs, masked_outputs, ort_run
from elastic_export.core import onnx_io
from elastic_export.core.budgets import budget_tag
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.fileio import OutputLock, umask
from elastic_export.core.manifest import (
    BUDGET_INPUT,
    DENSE_FILE,
    ELASTIC_FILE,
    RANKING_FILE,
    TWIN_FIELDS,
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
from elastic_export.core.outdir import claim_out, commit_out, make_tmp, prepare_out
from elastic_export.export.dense import export_dense
from elastic_export.models import preprocess, text
from elastic_export.models.encoder import Encoder
from elastic_export.models.inventory import Inventory, build_inventory
from elastic_export.models.loader import load_encoder
from elastic_export.passes import BudgetSlicer, build_elastic_model, dense_counts
from elastic_export.precision import int8_qdq
from elastic_export.precision.fp16 import add_fp16
from elastic_export.precision.int8 import add_int8, parse_precisions
from elastic_export.precision.ort_optimize import EXTERNAL_REFUSAL, optimize_artifacts
from elastic_export.ranking.driver import check_device, load_calib, rank_or_reuse
from elastic_export.ranking.file import Ranking, save_ranking
from elastic_export.ranking.plans import BudgetPlan, check_align, make_plans
from elastic_export.ranking.soft_ranking import ElasticConfig
from elastic_export.serving import st_layout

LAYOUTS = ("artifacts", st_layout.LAYOUT)


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


def _twins(name: str, fp16: dict, int8: dict, qdq: dict) -> dict:
    """The manifest fields (:data:`TWIN_FIELDS`: file, error) of the fp16, int8 and int8-qdq twins of the
    fp32 file ``name`` (None where absent)."""
    return dict(zip(TWIN_FIELDS, (v for d in (fp16, int8, qdq) for v in d.get(name, (None, None)))))


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


def quick_eval_or_warn(directory: Path, manifest: Manifest, encoder: Encoder, opts: Options,
                       echo: Callable[[str], None]) -> Manifest:
    """Add the ``quick_eval`` entry (:mod:`elastic_export.measure.quick_eval`) to the manifest in ``directory``;
    a failure only warns (the entry is then null): the measurements never cost the artifacts."""
    from elastic_export.measure.quick_eval import run_quick_eval

    try:
        entry = run_quick_eval(directory, manifest, encoder, opts.calib, opts.calib_size, opts.seed, echo)
    except Exception as e:  # noqa: BLE001 - a view of the artifacts, not one of them
        echo(f"warning: quick eval skipped ({type(e).__name__}: {first_line(e)})")
        entry = None
    manifest.quick_eval = entry
    write_manifest(directory, manifest)
    return manifest


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
    precisions = parse_precisions(opts.precision)
    encoder, inventory = _load(opts, echo)
    calib = qdq = None  # int8-qdq: calibrated on the ranking's calibration data, less a held-out part
    if int8_qdq.PRECISION in precisions:
        calib = load_calib(encoder, opts)
        qdq = int8_qdq.split_heldout(calib.batches, calib.description)
    ranking, rank_seconds = rank_or_reuse(encoder, inventory, opts, calib, echo)
    plans = make_plans(ranking, inventory, list(opts.budgets), align=opts.align)
    tmp = make_tmp(lock, out, opts.overwrite, echo)
    try:
        os.chmod(tmp, 0o777 & ~umask())
        dense = _export(encoder, ranking, tmp, opts, echo)
        feeds = encoder.sample_inputs(batch=2, seed=opts.seed + 1)
        twins = _Twins(precisions, qdq, {k: v.numpy() for k, v in feeds.items()} if opts.verify else None, opts.verify)
        twins.add(tmp, DENSE_FILE, dense)
        names = _slice(dense, plans, tmp, opts, echo)
        # the hard-masked torch outputs of every budget, once: the per-budget files and the
        # elastic graph are both checked against them
        refs = [masked_outputs(encoder, plan, ranking, feeds) for plan in plans] if opts.verify else None
        errors = _check_budgets(plans, names, tmp, feeds, refs, twins, disable=not (opts.verify or len(precisions) > 1))
        elastic = None
        if opts.elastic_graph:
            elastic = write_elastic(dense, plans, tmp, feeds if opts.verify else None, refs, echo,
                                    precision="fp16" if "fp16" in precisions else "fp32")
        manifest = _manifest(encoder, inventory, dense, tmp, opts, precisions, twins,
                             list(zip(plans, names, errors)), elastic, ranking, rank_seconds)
        manifest = _finish(tmp, out, manifest, encoder, opts, echo)
        commit_out(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _load(opts: Options, echo: Callable[[str], None]) -> tuple[Encoder, Inventory]:
    """Load the model and count its units, refusing now what would fail after the (long) ranking."""
    echo(f"loading {opts.model or 'all-MiniLM-L6-v2 (embedded default)'}")
    encoder = load_encoder(opts.model, revision=opts.revision, pretrained=opts.pretrained, seq_len=opts.seq_len,
                           image_size=opts.image_size, trust_remote_code=opts.trust_remote_code, tower=opts.tower)
    inventory = build_inventory(encoder)
    if encoder.revision:
        echo(f"{encoder.repo_id}: hub commit {encoder.revision}")
    echo(f"{encoder.architecture}: {len(inventory.layers)} blocks, N={inventory.tokens} tokens, "
         f"{inventory.total_flops / 1e9:.3f} GFLOPs ({inventory.prunable_flops / 1e9:.3f} prunable), "
         f"{inventory.total_params / 1e6:.2f}M params")
    check_align(inventory, opts.align)  # fail before the (long) ranking, not after it
    if opts.ort_optimize and onnx_io.needs_external(inventory.total_params * 4, opts.external_data):
        raise UserError(EXTERNAL_REFUSAL.format(src=DENSE_FILE))
    check_layout(opts.layout, encoder)  # fail before the (long) ranking, not after it
    return encoder, inventory


def _export(encoder: Encoder, ranking: Ranking, tmp: Path, opts: Options, echo: Callable[[str], None]) -> onnx.ModelProto:
    """Save the ranking and export the dense rank-permuted ONNX (``dense.onnx``)."""
    save_ranking(ranking, tmp / RANKING_FILE)
    t0 = time.time()
    dense = export_dense(encoder, ranking, tmp / DENSE_FILE, opts.external_data)
    echo(f"exported dense ONNX in {time.time() - t0:.1f}s")
    return dense


def _slice(dense: onnx.ModelProto, plans: list[BudgetPlan], tmp: Path, opts: Options,
           echo: Callable[[str], None]) -> list[str]:
    """Write one ONNX file per budget; their names, in plan order."""
    t0 = time.time()
    names = []
    slicer = BudgetSlicer(dense, external=onnx_io.external_like(tmp / DENSE_FILE))
    for plan in tqdm(plans, desc="slicing budgets", unit="budget", leave=False):
        names.append(f"budget_{budget_tag(plan.sparsity)}.onnx")
        # with --verify, onnxruntime loads and checks every file below, so the passes skip
        # onnx.checker (they still check the graph in memory after each pass)
        slicer.save(plan.heads_per_layer, plan.neurons_per_layer, tmp / names[-1], full_check=not opts.verify)
    del slicer
    echo(f"sliced {len(plans)} budgets from the dense ONNX in {time.time() - t0:.1f}s")
    return names


@dataclass
class _Twins:
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


def _check_budgets(plans: list[BudgetPlan], names: list[str], tmp: Path, feeds: dict,
                   refs: list[list[np.ndarray]] | None, twins: _Twins, disable: bool) -> list[float | None]:
    """Check every budget file against its hard-masked torch outputs (``refs``; None: unchecked) and
    write its twins; the max abs errors, in plan order."""
    errors = []
    for i, (plan, name) in enumerate(zip(tqdm(plans, desc="verifying budgets", unit="budget", leave=False,
                                              disable=disable), names)):
        err = None
        if refs is not None:
            err = check_outputs(ort_run(tmp / name, feeds), refs[i],
                                f"budget {plan.sparsity}: ONNX differs from the masked model")
        twins.add(tmp, name)
        errors.append(err)
    return errors


def _manifest(encoder: Encoder, inventory: Inventory, dense: onnx.ModelProto, tmp: Path, opts: Options,
              precisions: tuple[str, ...], twins: _Twins, rows: list[tuple[BudgetPlan, str, float | None]],
              elastic: Elastic | None, ranking: Ranking, rank_seconds: float | None) -> Manifest:
    """The manifest of the artifact set in ``tmp`` (``rows``: each budget's plan, file and max abs error)."""
    outputs = io_specs(onnx.shape_inference.infer_shapes(onnx_io.weightless(dense)).graph.output)
    return Manifest(
        tool=f"elastic-export {__version__}",
        model=ModelInfo(source=encoder.source, architecture=encoder.architecture, fingerprint=encoder.fingerprint(),
                        modality=encoder.modality, tower=encoder.tower or None, repo_id=encoder.repo_id,
                        revision=encoder.revision),
        inputs=[TensorSpec(**s) for s in io_specs(dense.graph.input)],
        outputs=[TensorSpec(**s) for s in outputs],
        tokens=inventory.tokens,
        preprocess=preprocess.artifact_entry(encoder.data_config, tmp) or text.artifact_entry(encoder, tmp),
        prunable_gflops=inventory.prunable_flops / 1e9,
        align=opts.align,
        precisions=list(precisions),
        dense=Dense(onnx=DENSE_FILE, **twins.fields(DENSE_FILE), gflops=inventory.total_flops / 1e9,
                    params=inventory.total_params),
        budgets=[Budget(sparsity=p.sparsity, achieved_sparsity=round(p.achieved_sparsity, 6), gflops=p.gflops,
                        params=p.params, onnx=name, engine=None, heads_per_layer=p.heads_per_layer,
                        neurons_per_layer=p.neurons_per_layer, max_abs_error=err, **twins.fields(name))
                 for p, name, err in rows],
        elastic=elastic,
        int8_qdq=int8_qdq.manifest_entry(twins.qdq) if twins.qdq is not None else None,
        ranking=RankingInfo(file=RANKING_FILE, method=ranking.meta.get("method"), seconds=rank_seconds),
    )


def _finish(tmp: Path, out: Path, manifest: Manifest, encoder: Encoder, opts: Options,
            echo: Callable[[str], None]) -> Manifest:
    """Write the manifest and what is derived from the artifacts (sentence-transformers layout,
    onnxruntime-optimised copies, quick eval, report); the final manifest."""
    if opts.layout == st_layout.LAYOUT:
        manifest.sentence_transformers = write_st_layout(tmp, out, manifest, echo)
    write_manifest(tmp, manifest)
    if opts.ort_optimize:
        optimize_artifacts(tmp, update_manifest=True, echo=echo)
        manifest = Manifest.load(tmp)
    if opts.quick_eval:
        manifest = quick_eval_or_warn(tmp, manifest, encoder, opts, echo)
    if opts.report:
        write_report_or_warn(tmp, out, echo)
    return manifest
