"""The main job (``elastic-export`` with no subcommand, ``run``, ``export``: its budget table) and the
commands of its stages run alone: ``inspect`` (the model's units and costs) and ``rank`` (the ranking file)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from elastic_export.cli.options import echo_err, elastic_config, export_options, model_options, ranking_options
from elastic_export.core.budgets import parse_budgets
from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, RANKING_FILE, REPORT

if TYPE_CHECKING:
    from elastic_export.core.manifest import Manifest


def run_main_job(**kw) -> None:
    """The main job on the parsed options (:func:`elastic_export.pipeline.run`), then its budget table.
    The options are checked before the pipeline (torch, transformers) is imported: bad ones are
    refused in well under a second."""
    budgets = parse_budgets(kw.pop("budgets"))
    elastic = elastic_config(kw)
    from elastic_export.pipeline import Options, run

    opts = Options(budgets=tuple(budgets), elastic=elastic, **kw)
    manifest = run(opts, echo=echo_err)
    print_budget_table(manifest, Path(opts.out))
    if opts.report and (Path(opts.out) / REPORT).is_file():
        click.echo(f"wrote {Path(opts.out) / REPORT}")


def budget_rows(manifest: Manifest) -> list[str]:
    """The budget table's lines: one row per budget (and precision, where the quick eval measured
    several), with the quick eval's quality and p50 latency where it ran, and its legend."""
    from elastic_export.measure.quick_eval import table_columns

    qe = table_columns(manifest)
    head, cells, legend = qe if qe is not None else ([], {}, [])
    precisions = list(dict.fromkeys(p for _, p in cells)) or ["fp32"]
    many = len(precisions) > 1
    rows = [["budget"] + (["precision"] if many else []) + ["achieved", "GFLOPs", "params", "max err", "file"] + head]
    d = manifest.dense
    entries = [("dense", "0.0000", d, None, 0.0)] + [(f"{b.sparsity:.2f}", f"{b.achieved_sparsity:.4f}", b,
                                                      b.max_abs_error, b.sparsity) for b in manifest.budgets]
    for prec in precisions:
        for name, achieved, e, err, s in entries:
            err = "-" if err is None or prec != "fp32" else f"{err:.1e}"
            rows.append([name] + ([prec] if many else []) + [achieved, f"{e.gflops:.3f}", f"{e.params / 1e6:.2f}M", err,
                        str(e.file(prec) or "-")] + cells.get((round(float(s), 6), prec), ["-"] * len(head)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows] + legend


def print_budget_table(manifest: Manifest, out: Path) -> None:
    """The main job's summary on stdout: :func:`budget_rows`, the elastic graph, each twin precision's worst error."""
    from elastic_export.core.precisions import ERROR_KEYS

    for line in budget_rows(manifest):
        click.echo(line)
    e = manifest.elastic
    if e:
        err = "" if e.max_abs_error is None else f", max err {e.max_abs_error:.1e}"
        dense = "" if e.dense_index is None else f"; {e.dense_index} = dense"
        click.echo(f"elastic graph: {e.onnx} (input {e.budget_input} = index into the budgets above{dense}{err})")
    files = [manifest.dense, *manifest.budgets]
    for prec, worst_of, what in (("fp16", max, "max relative error vs fp32 {:.1e}"),
                                 ("int8", min, "min embedding cosine vs fp32 {:.4f}"),
                                 ("int8-qdq", min, "min embedding cosine vs fp32 on held-out calibration samples {:.4f}")):
        if prec in (manifest.precisions or []):
            errs = [getattr(x, ERROR_KEYS[prec]) for x in files if getattr(x, ERROR_KEYS[prec]) is not None]
            worst = ", " + what.format(worst_of(errs)) if errs else ""
            click.echo(f"{prec}: {len(files)} files (*.{prec}.onnx){worst}")
    click.echo(f"wrote {out / MANIFEST}")


@click.command("run")
@model_options
@ranking_options
@export_options
def run_cmd(**kw):
    """Run the whole pipeline (same as no subcommand)."""
    run_main_job(**kw)


@click.command("export")
@model_options
@ranking_options
@export_options
def export_cmd(**kw):
    """Export the dense ONNX and one ONNX per budget (ranks first unless --ranking is given)."""
    run_main_job(**kw)


@click.command("inspect")
@model_options
def inspect_cmd(model, revision, pretrained, seq_len, image_size, trust_remote_code, tower):
    """Print per-layer neurons, heads, unit costs, GFLOPs and parameters."""
    from elastic_export.models.inventory import build_inventory
    from elastic_export.models.loader import load_encoder

    enc = load_encoder(model, revision=revision, pretrained=pretrained, seq_len=seq_len, image_size=image_size,
                       trust_remote_code=trust_remote_code, tower=tower)
    inv = build_inventory(enc)
    click.echo(f"model: {enc.source}  ({enc.architecture}, {enc.modality})")
    click.echo(f"tokens N={inv.tokens}  width D={inv.width}")
    head = ("layer", "heads", "head_dim", "neurons", "MLP", "head FLOPs", "neuron FLOPs", "layer GFLOPs")
    rows = [head] + [
        (str(L.index), str(L.heads), str(L.head_dim), str(L.neurons), "gated" if L.swiglu else "plain",
         f"{L.head_cost:,}", f"{L.neuron_cost:,}", f"{L.flops / 1e9:.4f}")
        for L in inv.layers
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        click.echo("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    shared = [L for L in inv.layers if L.kv_heads]
    if shared:
        click.echo(f"grouped-query attention: {shared[0].kv_heads} key/value heads per layer, {shared[0].kv_cost:,} FLOPs "
                   "each while any query head reading it is kept (head FLOPs above include an even share)")
    click.echo(f"prunable GFLOPs: {inv.prunable_flops / 1e9:.4f}")
    click.echo(f"total GFLOPs:    {inv.total_flops / 1e9:.4f}")
    click.echo(f"params:          {inv.total_params:,}")


@click.command("rank")
@model_options
@ranking_options
@click.option("--out", default=RANKING_FILE, show_default=True, type=click.Path(), help="Ranking file.")
@click.option("--weights-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="Frozen weights while ranking (scores, masks and losses stay fp32); bf16 halves the memory "
                   "of large models.")
@click.option("--checkpoint-activations", is_flag=True, default=False,
              help="Recompute each block's activations in the backward pass (activation checkpointing): "
                   "less memory for about one more forward pass per step.")
def rank_cmd(out, weights_dtype, checkpoint_activations, **kw):
    """Rank every unit and write the ranking file.

    Under `torchrun --nproc-per-node N -m elastic_export rank ...` every calibration batch is split
    across the N processes (gloo on CPU, NCCL with --device cuda) and the result equals the
    one-process ranking; rank 0 writes the file.
    """
    from elastic_export.models.inventory import build_inventory
    from elastic_export.models.loader import load_encoder
    from elastic_export.pipeline import Options
    from elastic_export.ranking import distributed as ddp
    from elastic_export.ranking.driver import rank_encoder
    from elastic_export.ranking.file import save_ranking

    if Path(out).is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name, e.g. {Path(out) / RANKING_FILE}")
    elastic = elastic_config(kw)
    model_kw = {k: kw.pop(k) for k in ("model", "revision", "pretrained", "seq_len", "image_size", "trust_remote_code",
                                          "tower")}
    with ddp.session(kw["device"]) as device:
        kw["device"] = device
        echo = echo_err if ddp.is_main() else (lambda msg: None)
        enc = load_encoder(model_kw.pop("model"), **model_kw)
        inv = build_inventory(enc)
        fingerprint = enc.fingerprint() if weights_dtype != "fp32" else None  # of the fp32 weights
        ddp.cast_weights(enc.module, weights_dtype)
        opts = Options(elastic=elastic, checkpoint=str(out) + ".checkpoint", **kw)
        with ddp.checkpointed(enc.blocks(), checkpoint_activations):
            ranking = rank_encoder(enc, inv, opts, echo)
        if fingerprint is not None:
            ranking.meta["fingerprint"] = fingerprint
            ranking.meta["hyperparameters"]["weights_dtype"] = weights_dtype
        if ddp.is_main():
            save_ranking(ranking, out)
            click.echo(f"wrote {out}")
