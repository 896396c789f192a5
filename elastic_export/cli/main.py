"""``elastic-export``: the command line (click).

``elastic-export [OPTIONS]`` runs the whole pipeline; subcommands run single stages.
Exit codes: 0 success, 2 bad input (one line on stderr, no traceback), 130 interrupted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from elastic_export.checks.compare import ATOL, FP16_RTOL
from elastic_export.core.budgets import parse_budgets
from elastic_export.core.errors import UserError
from elastic_export.ranking import methods
from elastic_export.ranking.options import ElasticConfig, targets_spec
from elastic_export.serving.backends import DEFAULT_BACKEND, TRITON_BUDGET_BACKENDS, backend_help
from elastic_export.serving.policies import ROUTER_POLICIES

if TYPE_CHECKING:
    from elastic_export.core.manifest import Manifest

DEFAULT_BUDGETS = "0.1..0.6"
_ELASTIC = ElasticConfig()


def _echo(msg: str) -> None:
    click.echo(msg, err=True)


# --- option groups shared by several commands (Polygraphy-style argument groups) ---------------
def model_options(fn):
    """--model, --revision, --pretrained/--no-pretrained, --seq-len, --image-size, --trust-remote-code, --tower."""
    opts = [
        click.option("--model", "model", default=None, metavar="PATH|HUB_ID|TIMM_NAME",
                     help="A local model directory, a Hugging Face hub id ORG/NAME[@REVISION] (from the hub or its "
                          "cache; HF_HUB_OFFLINE, HF_HUB_CACHE and HF_TOKEN apply), a timm name or hf-hub:ORG/NAME "
                          "(default: the embedded all-MiniLM-L6-v2)."),
        click.option("--revision", default=None, metavar="REV",
                     help="Hub ids: the branch, tag or commit to load (the manifest records the commit)."),
        click.option("--pretrained/--no-pretrained", default=True, show_default=True,
                     help="timm names: load pretrained weights (from the hub or its cache) or use random initialisation."),
        click.option("--seq-len", type=int, default=None,
                     help="Text: nominal token count N for FLOPs [default: 128, or the model's positions if fewer]."),
        click.option("--image-size", type=int, default=None, help="timm names: input resolution."),
        click.option("--trust-remote-code", is_flag=True, default=False,
                     help="Allow model code shipped inside a Hugging Face directory (off by default)."),
        click.option("--tower", type=click.Choice(["text", "vision"]), default=None,
                     help="Dual-encoder directories (CLIPModel, SiglipModel): export this tower "
                          "(CLIP: with its projection)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _check_method(ctx, param, value: str) -> str:
    """--method: a registered name (checked while parsing, without importing the method or torch)."""
    return methods.get(value).name


def ranking_options(fn):
    """--method, --calib, --calib-size, --seed, --device."""
    opts = [
        click.option("--method", default="elastic", show_default=True, callback=_check_method,
                     help=f"Ranking method: {', '.join(methods.names())}."),
        click.option("--calib", default=None, metavar="PATH",
                     help="Calibration data: .txt / .jsonl (text) or an image directory (default: built in)."),
        click.option("--calib-size", type=int, default=256, show_default=True, help="Calibration samples."),
        click.option("--batch-size", type=int, default=8, show_default=True, help="Calibration batch size."),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--device", default="cpu", show_default=True, help="Device for ranking: cpu or cuda."),
        click.option("--steps", type=int, default=_ELASTIC.steps, show_default=True,
                     help="elastic: gradient steps on the scores."),
        click.option("--lr", type=float, default=_ELASTIC.lr, show_default=True, help="elastic: learning rate."),
        click.option("--temperature", type=float, default=_ELASTIC.temperature, show_default=True,
                     help="elastic: soft-mask temperature (in score standard deviations)."),
        click.option("--targets", default=targets_spec(_ELASTIC.targets), show_default=True,
                     help="elastic: sparsity targets optimised jointly (same syntax as --budgets); the main "
                          "job extends them at their step up to its largest --budgets."),
        click.option("--targets-per-step", type=int, default=_ELASTIC.targets_per_step, show_default=True,
                     help="elastic: targets evaluated per step (rotating)."),
        click.option("--loss", type=click.Choice(["auto", "cosine", "kl", "ce"]), default=_ELASTIC.loss, show_default=True,
                     help="elastic: loss (auto: cross-entropy with labelled calibration images for classifiers, "
                          "else KL to the dense logits, else embedding cosine)."),
        click.option("--relational-weight", type=float, default=_ELASTIC.relational_weight, show_default=True,
                     help="elastic: weight of the similarity-structure term (retrieval against a dense index)."),
        click.option("--token-weight", type=float, default=_ELASTIC.token_weight, show_default=True,
                     help="elastic: weight of a token-level feature term (0: off)."),
        click.option("--resume", is_flag=True, default=False,
                     help="elastic: continue an interrupted ranking from its last checkpoint (says from which "
                          "step, or that there is none)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def export_options(fn):
    """--budgets, --out, --ranking, --align, --overwrite, --verify/--no-verify, --elastic-graph, --precision,
    --ort-optimize, --report/--no-report, --quick-eval/--no-quick-eval, --external-data, --layout."""
    opts = [
        click.option("--budgets", default=DEFAULT_BUDGETS, show_default=True,
                     help="Sparsities: 0.1..0.6 (step 0.1), 0.1..0.6:0.05 or 0.1,0.25,0.5."),
        click.option("--out", default="elastic-out", show_default=True, type=click.Path(), help="Artifact directory."),
        click.option("--ranking", default=None, metavar="FILE", help="Reuse a ranking file instead of ranking again."),
        click.option("--align", type=int, default=1, show_default=True,
                     help="Round per-layer neuron counts to multiples of K."),
        click.option("--overwrite", is_flag=True, default=False,
                     help="Replace an --out directory that holds other files."),
        click.option("--verify/--no-verify", default=True, show_default=True,
                     help="Check every budget's ONNX against the hard-masked torch model."),
        click.option("--elastic-graph/--no-elastic-graph", default=True, show_default=True,
                     help="Also write elastic.onnx: one graph, weights once, its int64 budget_index input "
                          "(shape [1]) selects the budget by position in the manifest's budgets."),
        click.option("--precision", default="fp32", show_default=True, metavar="LIST",
                     help="Comma list of fp32, fp16, int8, int8-qdq (e.g. fp32,int8); the fp32 files are always written. "
                          "fp16: also an fp16 ONNX (fp32 norms, softmax and pooling; fp32 I/O) of the dense model, "
                          "every budget and the elastic graph. int8: also a CPU int8 ONNX (onnxruntime dynamic "
                          "quantization of the MatMul weights) of the dense model and every budget, each checked "
                          "against its fp32 file (embedding cosine >= 0.95). int8-qdq: also an int8 ONNX with explicit Q/DQ "
                          "nodes (static quantization calibrated on the calibration data, for TensorRT; the CPU EP "
                          "runs it too) of the dense model and every budget, each checked against its fp32 file "
                          "on held-out calibration samples."),
        click.option("--ort-optimize", is_flag=True, default=False,
                     help="Also write onnxruntime-optimised copies (dense.opt.onnx, budget_*.opt.onnx: fused "
                          "attention / SkipLayerNorm / Gelu where the patterns match), each checked against "
                          "its source. For the CUDA provider; on CPU the plain files are as fast."),
        click.option("--report/--no-report", default=True, show_default=True,
                     help="Also write DIR/report.html (see `elastic-export report`); a failure to render only warns."),
        click.option("--external-data", "external_data", flag_value=True, default=None,
                     help="Keep every ONNX file's weights in NAME.onnx.data beside it (ONNX external data). "
                          "Automatic for models whose weights pass protobuf's 2 GiB (about 530M fp32 parameters)."),
        click.option("--quick-eval/--no-quick-eval", "quick_eval", default=True, show_default=True,
                     help="Also measure every (budget, precision): fidelity (and text recall@10) on held-out "
                          "calibration-source samples the ranking did not see, and CPU latency at batch 1 and 8 "
                          "(a few runs); recorded in the manifest's quick_eval entry, DIR/latency_profile.json "
                          "(with quality figures and the frontier) and the report."),
        click.option("--layout", type=click.Choice(["artifacts", "sentence-transformers"]), default="artifacts",
                     show_default=True,
                     help="sentence-transformers (text encoders): also DIR/sentence-transformers/, one folder per "
                          "budget and precision that SentenceTransformer(folder, backend=\"onnx\") loads as it is "
                          "(see `elastic-export export-st`)."),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


def _elastic_config(kw: dict) -> ElasticConfig:
    """Pop the elastic-ranking options out of ``kw`` into an :class:`ElasticConfig`."""
    for name in ("steps", "targets_per_step", "calib_size", "batch_size"):
        if kw.get(name) is not None and kw[name] < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {kw[name]}")
    for name in ("lr", "temperature"):
        if not kw[name] > 0:
            raise UserError(f"--{name} must be positive, got {kw[name]}")
    targets = tuple(t for t in parse_budgets(kw.pop("targets")) if t > 0)
    if not targets:
        raise UserError("--targets: give at least one sparsity above 0")
    for name in ("token_weight", "relational_weight"):
        if kw[name] < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative, got {kw[name]}")
    return ElasticConfig(targets=targets, steps=kw.pop("steps"), lr=kw.pop("lr"),
                         temperature=kw.pop("temperature"), targets_per_step=kw.pop("targets_per_step"),
                         loss=kw.pop("loss"), token_weight=kw.pop("token_weight"),
                         relational_weight=kw.pop("relational_weight"))


def _run_main_job(**kw) -> None:
    from elastic_export.pipeline import Options, run

    budgets = parse_budgets(kw.pop("budgets"))
    elastic = _elastic_config(kw)
    opts = Options(budgets=tuple(budgets), elastic=elastic, **kw)
    manifest = run(opts, echo=_echo)
    _print_budget_table(manifest, Path(opts.out))
    if opts.report and (Path(opts.out) / "report.html").is_file():
        click.echo(f"wrote {Path(opts.out) / 'report.html'}")


def _budget_rows(manifest: Manifest) -> list[str]:
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


def _print_budget_table(manifest: Manifest, out: Path) -> None:
    from elastic_export.core.manifest import MANIFEST
    from elastic_export.core.precisions import ERROR_KEYS

    for line in _budget_rows(manifest):
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


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@model_options
@ranking_options
@export_options
@click.version_option(package_name="elastic-export")
@click.pass_context
def cli(ctx, **kw):
    """Make a transformer encoder elastic: rank every MLP neuron and attention head on one FLOP
    scale, then write one sliced ONNX model per compute budget.

    Without a subcommand, runs the whole pipeline on --model (default: all-MiniLM-L6-v2).
    """
    if ctx.invoked_subcommand is None:
        _run_main_job(**kw)


@cli.command("run")
@model_options
@ranking_options
@export_options
def run_cmd(**kw):
    """Run the whole pipeline (same as no subcommand)."""
    _run_main_job(**kw)


@cli.command("export")
@model_options
@ranking_options
@export_options
def export_cmd(**kw):
    """Export the dense ONNX and one ONNX per budget (ranks first unless --ranking is given)."""
    _run_main_job(**kw)


@cli.command("inspect")
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


@cli.command("rank")
@model_options
@ranking_options
@click.option("--out", default="ranking.safetensors", show_default=True, type=click.Path(), help="Ranking file.")
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
    from elastic_export.pipeline import Options, rank_encoder
    from elastic_export.ranking import distributed as ddp
    from elastic_export.ranking.file import save_ranking

    if Path(out).is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name, e.g. {Path(out) / 'ranking.safetensors'}")
    elastic = _elastic_config(kw)
    model_kw = {k: kw.pop(k) for k in ("model", "revision", "pretrained", "seq_len", "image_size", "trust_remote_code",
                                          "tower")}
    with ddp.session(kw["device"]) as device:
        kw["device"] = device
        echo = _echo if ddp.is_main() else (lambda msg: None)
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


@cli.command("eval")
@click.argument("dirs", nargs=-1, required=True, metavar="DIR [DIR ...]")
@click.option("--pairs", default=None, metavar="FILE.jsonl",
              help="Retrieval pairs, one {\"query\": ..., \"doc\": ...} per line (default: held-out "
                   "standard-library docstrings). Text models.")
@click.option("--images", default=None, metavar="DIR",
              help="Labelled image folder (one sub-folder per class) for k-NN. Image models.")
@click.option("--max-pairs", type=int, default=None, help="Use at most N pairs (default set: 1000).")
@click.option("--split", type=float, default=None,
              help="k-NN: hold out this fraction of each class as queries (default: leave-one-out).")
@click.option("--max-length", type=int, default=128, show_default=True,
              help="Token cap (the manifest's token count when smaller).")
@click.option("--batch-size", type=int, default=64, show_default=True, help="Inputs per onnxruntime run.")
@click.option("--tokenizer", default=None, metavar="DIR", help="Tokenizer directory (default: the model source in the manifest).")
@click.option("--out", default=None, type=click.Path(),
              help="Write the results as JSON here [default: DIR/eval.json in every DIR, where report finds them].")
@click.option("--plot", default=None, type=click.Path(), help="Write a PNG of every metric vs GFLOPs.")
@click.option("--precision", default="all", show_default=True, metavar="LIST",
              help="all (every precision each DIR was exported with) or a comma list of fp32, fp16, int8, int8-qdq; "
                   "fidelity is always against the dense fp32 model.")
def eval_cmd(dirs, pairs, images, max_pairs, split, max_length, batch_size, tokenizer, out, plot, precision):
    """Evaluate the exported ONNX of the dense model and every budget of each artifact DIR:
    fidelity (cosine to the dense output), retrieval recall@1/@10 against a dense index and
    symmetric (text), k-NN accuracy (images). Without --out the results go to DIR/eval.json of every
    DIR (that DIR's result first), so `elastic-export report DIR` shows them."""
    from elastic_export.measure.evaluation import (
        check_output_path,
        default_outputs,
        evaluate,
        format_table,
        plot_results,
        write_results,
    )

    outs = {Path(out): None} if out else default_outputs(dirs)
    for path in outs:
        check_output_path(path, "--out" if out else "eval: the default output (choose another with --out FILE)")
    check_output_path(plot, "--plot")
    results = evaluate(list(dirs), pairs=pairs, images=images, max_pairs=max_pairs, split=split,
                       max_length=max_length, batch_size=batch_size, tokenizer=tokenizer, echo=_echo,
                       precisions=None if precision == "all" else [p.strip() for p in precision.split(",")])
    click.echo(format_table(results))
    for path, own in outs.items():
        write_results(path, results, first=own)
        click.echo(f"wrote {path}")
    if plot:
        plot_results(results, plot)
        click.echo(f"wrote {plot}")


@cli.command("verify")
@click.argument("directory", metavar="DIR")
@click.option("--batch", type=int, default=2, show_default=True, help="Sample inputs per run.")
@click.option("--seq-len", type=int, default=None,
              help="Text: tokens per sample (default: 32, at most the manifest's token count).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample inputs.")
@click.option("--model", default=None, metavar="PATH_OR_TIMM_NAME",
              help="Also compare with the torch hard-masked model (default: the manifest's model.source "
                   "when it loads offline and matches the fingerprint).")
@click.option("--tower", type=click.Choice(["text", "vision"]), default=None,
              help="With --model: the tower of a dual-encoder directory (default: the manifest's).")
@click.option("--torch/--no-torch", "use_torch", default=True, show_default=True,
              help="Compare with the torch hard-masked model where the model can be loaded.")
@click.option("--atol", type=float, default=ATOL, show_default=True, help="fp32 tolerance: max abs error.")
@click.option("--rtol-fp16", type=float, default=FP16_RTOL, show_default=True,
              help="fp16 / TensorRT tolerance: max abs error relative to each output's largest magnitude.")
def verify_cmd(directory, batch, seq_len, seed, model, tower, use_torch, atol, rtol_fp16):
    """Re-check every artifact of DIR (budget ONNX, fp16 files, the elastic graph, TensorRT engines)
    against the hard-masked dense model derived from DIR's own dense.onnx. Exit 0: all match;
    1: something differs; 2: a missing or corrupt file, or a broken manifest."""
    from elastic_export.checks.verify import verify_dir
    from elastic_export.core.errors import CheckFailed

    for name, value in (("--atol", atol), ("--rtol-fp16", rtol_fp16)):
        if not value > 0:
            raise UserError(f"{name} must be positive, got {value}")
    report = verify_dir(directory, batch=batch, seq_len=seq_len, seed=seed, model=model, tower=tower,
                        use_torch=use_torch, atol=atol, rtol_fp16=rtol_fp16, echo=_echo)
    click.echo(report.table())
    if report.problems:
        raise UserError(report.summary())
    if report.mismatches:
        raise CheckFailed(report.summary())
    click.echo(report.summary())



@cli.command("bench")
@click.argument("directory", metavar="DIR")
@click.option("--backend", default=DEFAULT_BACKEND, show_default=True, help=f"{backend_help()}.")
@click.option("--provider", default="cpu", show_default=True, help="onnxruntime execution provider: cpu, cuda or tensorrt.")
@click.option("--batches", default="1,32", show_default=True, help="Batch sizes, comma-separated.")
@click.option("--seq-len", type=int, default=None, help="Text: tokens per input [default: the manifest's token count].")
@click.option("--repeats", type=int, default=20, show_default=True, help="Timed runs (and timed switches) per budget and batch.")
@click.option("--warmup", type=int, default=3, show_default=True, help="Untimed runs per budget and batch first.")
@click.option("--threads", type=int, default=0, show_default=True, help="onnxruntime intra-op threads (0: its default).")
@click.option("--out", default=None, type=click.Path(), help="Results JSON [default: DIR/bench.json]; PNGs go next to it.")
@click.option("--plot/--no-plot", default=True, show_default=True,
              help="Write <stem>_throughput.png, <stem>_latency.png and <stem>_speedup.png next to the JSON.")
@click.option("--profile/--no-profile", default=True, show_default=True,
              help="Write DIR/latency_profile.json (p50/p90/p99 ms and throughput per batch and budget).")
@click.option("--precision", default="all", show_default=True, metavar="LIST",
              help="all (every precision DIR was exported with) or a comma list of fp32, fp16, int8 "
                   "(onnxruntime backend; fp16 is for GPU providers).")
def bench_cmd(directory, backend, provider, batches, seq_len, repeats, warmup, threads, out, plot, profile, precision):
    """Time the dense model and every budget of DIR at each batch size: throughput, latency
    p50/p90/p99 and the cost of switching budget; write JSON, plots and the latency profile."""
    from elastic_export.measure.bench import BenchConfig, bench, format_table, parse_batches

    config = BenchConfig(backend=backend, provider=provider, batches=parse_batches(batches), seq_len=seq_len,
                         repeats=repeats, warmup=warmup, threads=threads, precision=precision)
    result, written = bench(directory, config, out=out, plot=plot, profile=profile, echo=_echo)
    click.echo(format_table(result))
    for path in [written.json, *written.plots] + ([written.profile] if written.profile else []):
        click.echo(f"wrote {path}")

@cli.command("report")
@click.argument("directory", metavar="DIR")
@click.option("--out", default=None, type=click.Path(), help="HTML file [default: DIR/report.html].")
def report_cmd(directory, out):
    """Write DIR/report.html: one self-contained page (inline PNGs, no network) with the budget table,
    quality vs GFLOPs of the eval results in DIR, where sparsity goes per block (every ranking file in
    DIR side by side), speed vs budget (DIR/bench.json) and the ranking's provenance."""
    from elastic_export.report.page import write_report

    click.echo(f"wrote {write_report(directory, out=out, echo=_echo)}")


@cli.command("export-st")
@click.argument("directory", metavar="DIR")
@click.option("--out", required=True, type=click.Path(), help="New directory: one folder per budget and precision.")
@click.option("--budgets", default=None, help="Sparsities of DIR to write, e.g. 0.3,0.6 [default: all].")
@click.option("--precision", default=None, metavar="LIST",
              help="Comma list of fp32, fp16, int8 [default: every precision DIR was exported with].")
@click.option("--model", default=None, metavar="PATH",
              help="The model directory DIR was made from (tokenizer, config, pooling modules) [default: the "
                   "manifest's model.source].")
def export_st_cmd(directory, out, budgets, precision, model):
    """Write the budgets of a text encoder's artifact DIR as sentence-transformers folders (OUT/s030-fp32, ...):
    the source model's tokenizer, config and Transformer / Pooling / Normalize modules, with the budget's ONNX
    as onnx/model.onnx, so that SentenceTransformer(folder, backend="onnx").encode(texts) serves the budget."""
    from elastic_export.serving.st_layout import export_st

    export_st(directory, out, budgets=budgets, precisions=precision, model=model, echo=click.echo)


# --- build: `build tensorrt DIR`, `build triton DIR`, and the original `build --target T DIR` ----------
def _options(*opts):
    """Apply click options in the order given (the order --help lists them)."""
    def decorate(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return decorate


_TRT_BATCH = (
    click.option("--min-batch", type=int, default=1, show_default=True, help="Smallest batch of the profile."),
    click.option("--opt-batch", type=int, default=32, show_default=True, help="Batch TensorRT tunes kernels for."),
)
_TRT_REST = (
    click.option("--min-tokens", type=int, default=None, help="Text: fewest tokens [default: 1]."),
    click.option("--opt-tokens", type=int, default=None, help="Text: tokens tuned for [default: manifest tokens]."),
    click.option("--max-tokens", type=int, default=None, help="Text: most tokens [default: manifest tokens]."),
    click.option("--workspace-gb", type=float, default=4.0, show_default=True, help="Builder workspace limit (GiB)."),
    click.option("--timing-cache", default=None, type=click.Path(), metavar="PATH",
                 help="Timing cache shared by all builds [default: DIR/tensorrt.timing.cache]."),
    click.option("--opt-level", type=click.IntRange(0, 5), default=None,
                 help="TensorRT builder_optimization_level 0-5 [default: TensorRT's, 3]; lower builds faster."),
    click.option("--tf32/--no-tf32", default=False, show_default=True,
                 help="TensorRT: let fp32 layers use TF32 tensor cores (faster, ~1e-3 relative error)."),
    click.option("--fp32-norms/--no-fp32-norms", default=True, show_default=True,
                 help="TensorRT 10 fp16 (builder flag): keep norms, softmax and reductions in fp32."),
)
_TRITON = (
    click.option("--triton-name", default="elastic", show_default=True,
                 help="Triton: the router model's name; budget models are NAME_s010, ..."),
    click.option("--triton-instances", type=int, default=1, show_default=True,
                 help="Triton: instances of each model (per GPU on a GPU)."),
    click.option("--triton-kind", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
                 help="Triton: instance kind of the budget models (auto: KIND_AUTO, the GPUs where there are any)."),
    click.option("--triton-default-sparsity", type=float, default=None,
                 help="Triton: budget the router serves when a request names none [default: the densest served]."),
    click.option("--triton-queue-delay-us", type=int, default=100, show_default=True,
                 help="Triton: dynamic batcher max_queue_delay_microseconds."),
    click.option("--budget-backend", "--triton-platform", "triton_platform",
                 type=click.Choice(TRITON_BUDGET_BACKENDS), default="auto", show_default=True,
                 help="Triton: the budget models' backend. auto: an engine where the manifest lists one, else the ONNX "
                      "(onnxruntime backend); python: the ONNX run by onnxruntime in the Python backend (servers "
                      "without the onnxruntime backend, e.g. `serve`)."),
    click.option("--policy", type=click.Choice(ROUTER_POLICIES), default=None,
                 help="Triton: how the router picks a budget for requests that name none: adaptive (the load-adaptive "
                      "policy) or fixed (--triton-default-sparsity) [default: fixed when that is given, else adaptive]."),
    click.option("--slo-ms", type=float, default=None,
                 help="Triton: latency objective of the adaptive policy (ms)."),
    click.option("--ort-threads", type=int, default=0, show_default=True,
                 help="Triton: onnxruntime intra-op threads of python budget models (0: onnxruntime's default)."),
)
_TRT_PRECISION = ("fp16: BuilderFlag.FP16 where TensorRT has it (10), else a strongly typed network from the "
                  "directory's fp16 ONNX (11; export with --precision fp16). int8{}: the directory's Q/DQ ONNX "
                  "(export with --precision int8-qdq), with BuilderFlag.INT8 where TensorRT has it (10), else "
                  "strongly typed (11).")


def _build_tensorrt(directory: str, no_dense: bool, **options) -> None:
    """Build the engines of DIR (options: :class:`~elastic_export.targets.tensorrt.BuildConfig`'s fields)."""
    from elastic_export.targets.tensorrt import build_engines

    manifest = build_engines(directory, dense=not no_dense, echo=_echo, **options)
    for entry in [manifest.dense, *manifest.budgets]:
        if entry.engine:
            click.echo(entry.engine)
    click.echo(f"wrote {Path(directory) / 'manifest.json'}")


def _build_triton(directory: str, precision: str, max_batch: int | None, no_dense: bool, triton_name: str,
                  triton_instances: int, triton_kind: str, triton_default_sparsity: float | None,
                  triton_queue_delay_us: int, triton_platform: str, policy: str | None = None,
                  slo_ms: float | None = None, ort_threads: int = 0) -> None:
    """Write DIR/triton/ and print its models."""
    from elastic_export.targets.triton import build_repository

    manifest = build_repository(directory, name=triton_name, max_batch=max_batch, instances=triton_instances,
                                kind=triton_kind, default_sparsity=triton_default_sparsity,
                                queue_delay_us=triton_queue_delay_us, precision=precision, dense=not no_dense,
                                platform=triton_platform, policy=policy, slo_ms=slo_ms, ort_threads=ort_threads,
                                echo=_echo)
    t = manifest.triton
    for m in t["models"]:
        click.echo(f"{t['dir']}/{m['name']} ({m['platform']}, sparsity {m['sparsity']:g})")
    how = f"default sparsity {t['default_sparsity']:g}" if t["policy"] == "fixed" else "load-adaptive"
    click.echo(f"{t['dir']}/{t['router']} (router, python backend, {how})")
    click.echo(f"wrote {Path(directory) / 'manifest.json'}")


@click.command("build")
@click.argument("directory", metavar="DIR")
@click.option("--target", type=click.Choice(["tensorrt", "triton"]), required=True,
              help="tensorrt: one engine per budget (+ dense.engine); triton: a Triton model repository.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help=_TRT_PRECISION.format(" (tensorrt only)"))
@_options(*_TRT_BATCH)
@click.option("--max-batch", type=int, default=128, show_default=True,
              help="Largest batch of the profile (triton: max_batch_size [default: 128, or the engines' maximum]).")
@_options(*_TRT_REST)
@click.option("--no-dense", is_flag=True, default=False, help="Do not build dense.engine (triton: do not serve the dense model).")
@_options(*_TRITON)
@click.pass_context
def build_target_cmd(ctx, directory, target, **kw):
    """Add deployment artifacts to an artifact DIR and update its manifest."""
    sub = build_triton_cmd if target == "triton" else build_tensorrt_cmd
    if target == "triton" and ctx.get_parameter_source("max_batch") == click.core.ParameterSource.DEFAULT:
        kw["max_batch"] = None  # triton's own default: 128, or the engines' maximum
    (_build_triton if target == "triton" else _build_tensorrt)(
        directory, **{p.name: kw[p.name] for p in sub.params if p.name != "directory"})


class _BuildGroup(click.Group):
    """``build tensorrt DIR`` / ``build triton DIR``; any other ``build`` command line (every one with
    ``--target``, or none) is the original single command :data:`build_target_cmd`: its options, errors and
    exit codes are unchanged."""

    def make_context(self, info_name, args, parent=None, **extra):
        args = list(args)
        target_form = any(a == "--target" or a.startswith("--target=") for a in args)
        if target_form or not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            return build_target_cmd.make_context(info_name, args, parent=parent, **extra)
        return super().make_context(info_name, args, parent=parent, **extra)


@cli.group("build", cls=_BuildGroup)
def build_cmd():
    """Add deployment artifacts to an artifact DIR and update its manifest.

    `build tensorrt DIR`: one TensorRT engine per budget (+ dense.engine); `build triton DIR`: a Triton
    model repository. Each takes only its own options (`build tensorrt --help`). The single command
    `build --target tensorrt|triton DIR [OPTIONS]` still works, with the options of both
    (`build --target triton --help` lists them).
    """


@build_cmd.command("tensorrt", short_help="One TensorRT engine per budget (+ dense.engine); needs a CUDA GPU.")
@click.argument("directory", metavar="DIR")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help=_TRT_PRECISION.format(""))
@_options(*_TRT_BATCH)
@click.option("--max-batch", type=int, default=128, show_default=True, help="Largest batch of the profile.")
@_options(*_TRT_REST)
@click.option("--no-dense", is_flag=True, default=False, help="Do not build dense.engine.")
def build_tensorrt_cmd(directory, **kw):
    """Build one TensorRT engine per budget of DIR (and dense.engine) with a dynamic-batch profile and
    record them in its manifest. Needs TensorRT and a CUDA GPU; everything is checked before anything
    is written."""
    _build_tensorrt(directory, **kw)


@build_cmd.command("triton", short_help="A Triton model repository: one model per budget + a router.")
@click.argument("directory", metavar="DIR")
@click.option("--precision", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="fp16: serve the directory's fp16 ONNX files (export with --precision fp16).")
@click.option("--max-batch", type=int, default=None,
              help="max_batch_size of every model [default: 128, or the engines' maximum].")
@click.option("--no-dense", is_flag=True, default=False, help="Do not serve the dense model.")
@_options(*_TRITON)
def build_triton_cmd(directory, **kw):
    """Write DIR/triton/, a Triton model repository: one model per budget (the ONNX, or the engine
    where the manifest lists one) and a router model that picks the budget per request; record it
    in DIR's manifest."""
    _build_triton(directory, **kw)


@cli.command("serve", short_help="Run a real Triton server on DIR's repository (built when missing).")
@click.argument("directory", metavar="DIR")
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port; gRPC on PORT+1, metrics on PORT+2.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every endpoint binds to.")
@click.option("--budget-backend", type=click.Choice(TRITON_BUDGET_BACKENDS), default=None,
              help="Backend of the budget models when (re)building the repository [default: python where the server "
                   "has no onnxruntime backend, as PyPI's nvidia-pytriton server has not, else auto].")
@click.option("--policy", type=click.Choice(ROUTER_POLICIES), default=None,
              help="How the router picks a budget for requests that name none [default: adaptive].")
@click.option("--slo-ms", type=float, default=None, help="Latency objective of the adaptive policy (ms).")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for every model to be READY.")
def serve_cmd(directory, port, host, budget_backend, policy, slo_ms, ready_timeout):
    """Serve DIR with a real Triton Inference Server in the foreground: the budget models first, then
    the router once every one of them is READY; prints the endpoints when ready; Ctrl-C or SIGTERM
    stops it (no process left behind). The server is the `serve` extra's (pip install -e ".[serve]")."""
    from elastic_export.targets.tritonserver import serve

    serve(directory, port=port, host=host, budget_backend=budget_backend, policy=policy, slo_ms=slo_ms,
          ready_timeout_s=ready_timeout, echo=click.echo)
    click.echo("stopped")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps bad input to one line and exit code 2 (a failed check: exit 1)."""
    from elastic_export.core.errors import CheckFailed, Interrupted

    try:
        cli.main(args=argv, prog_name="elastic-export", standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except CheckFailed as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - click >= 8.2
        click.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(0)
    except click.UsageError as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt) as e:
        cause = e.__cause__ if isinstance(e, click.Abort) else e  # click wraps Ctrl-C in Abort
        click.echo("interrupted" + (f"; {cause}" if isinstance(cause, Interrupted) else ""), err=True)
        sys.exit(130)
    except click.ClickException as e:
        click.echo(f"error: {e.format_message()}", err=True)
        sys.exit(2)
    sys.exit(0)
