"""The commands that check and measure an artifact directory: ``verify``, ``eval``, ``bench`` and ``report``."""

from __future__ import annotations

from pathlib import Path

import click

from elastic_export.checks.compare import ATOL, FP16_RTOL
from elastic_export.cli.options import echo_err
from elastic_export.core.errors import UserError
from elastic_export.serving.backends import DEFAULT_BACKEND, backend_help


@click.command("eval")
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
                       max_length=max_length, batch_size=batch_size, tokenizer=tokenizer, echo=echo_err,
                       precisions=None if precision == "all" else [p.strip() for p in precision.split(",")])
    click.echo(format_table(results))
    for path, own in outs.items():
        write_results(path, results, first=own)
        click.echo(f"wrote {path}")
    if plot:
        plot_results(results, plot)
        click.echo(f"wrote {plot}")


@click.command("verify")
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
                        use_torch=use_torch, atol=atol, rtol_fp16=rtol_fp16, echo=echo_err)
    click.echo(report.table())
    if report.problems:
        raise UserError(report.summary())
    if report.mismatches:
        raise CheckFailed(report.summary())
    click.echo(report.summary())


@click.command("bench")
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
    result, written = bench(directory, config, out=out, plot=plot, profile=profile, echo=echo_err)
    click.echo(format_table(result))
    for path in [written.json, *written.plots] + ([written.profile] if written.profile else []):
        click.echo(f"wrote {path}")

@click.command("report")
@click.argument("directory", metavar="DIR")
@click.option("--out", default=None, type=click.Path(), help="HTML file [default: DIR/report.html].")
def report_cmd(directory, out):
    """Write DIR/report.html: one self-contained page (inline PNGs, no network) with the budget table,
    quality vs GFLOPs of the eval results in DIR, where sparsity goes per block (every ranking file in
    DIR side by side), speed vs budget (DIR/bench.json) and the ranking's provenance."""
    from elastic_export.report.page import write_report

    click.echo(f"wrote {write_report(directory, out=out, echo=echo_err)}")
