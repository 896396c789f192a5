"""Option groups shared by several commands (Polygraphy-style argument groups), and what they share:
``--model`` and friends (:func:`model_options`), the ranking's (:func:`ranking_options`, its defaults
read from :class:`elastic_export.ranking.options.ElasticConfig`), the main job's (:func:`export_options`)."""

from __future__ import annotations

import click

from elastic_export.core.budgets import parse_budgets
from elastic_export.core.errors import UserError
from elastic_export.ranking import methods
from elastic_export.ranking.options import ElasticConfig, targets_spec

DEFAULT_BUDGETS = "0.1..0.6"
_ELASTIC = ElasticConfig()


def echo_err(msg: str) -> None:
    """A progress or warning line, on stderr (stdout carries the results)."""
    click.echo(msg, err=True)


def apply_options(*opts):
    """Apply click options in the order given (the order --help lists them)."""
    def decorate(fn):
        for o in reversed(opts):
            fn = o(fn)
        return fn
    return decorate


MODEL_OPTIONS = (
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
)


def model_options(fn):
    """--model, --revision, --pretrained/--no-pretrained, --seq-len, --image-size, --trust-remote-code, --tower."""
    return apply_options(*MODEL_OPTIONS)(fn)


def _check_method(ctx, param, value: str) -> str:
    """--method: a registered name (checked while parsing, without importing the method or torch)."""
    return methods.get(value).name


RANKING_OPTIONS = (
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
    click.option("--fisher-projections", type=int, default=_ELASTIC.fisher_projections, show_default=True,
                 help="elastic: random projections of each calibration batch's embedding for the fisher "
                      "starting scores, one backward pass each (1: the ranking about a fifth faster on "
                      "all-mpnet-base-v2, recall@10 up to 0.007 lower on average)."),
    click.option("--ranking-compute", type=click.Choice(["auto", "fp32", "bf16"]), default=_ELASTIC.compute,
                 show_default=True,
                 help="elastic and fisher: the model's passes while ranking. bf16: matrix products in bfloat16 "
                      "(torch autocast; scores, masks and losses stay fp32), about twice as fast where the "
                      "hardware multiplies bf16 natively; auto: bf16 there (CPUs with AVX-512 BF16 or AMX, "
                      "GPUs with bf16), else fp32. The ranking file records which ran."),
    click.option("--resume", is_flag=True, default=False,
                 help="elastic: continue an interrupted ranking from its last checkpoint (says from which "
                      "step, or that there is none)."),
)


def ranking_options(fn):
    """--method, --calib, --calib-size, --seed, --device."""
    return apply_options(*RANKING_OPTIONS)(fn)


EXPORT_OPTIONS = (
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
)


def export_options(fn):
    """--budgets, --out, --ranking, --align, --overwrite, --verify/--no-verify, --elastic-graph, --precision,
    --ort-optimize, --report/--no-report, --quick-eval/--no-quick-eval, --external-data, --layout."""
    return apply_options(*EXPORT_OPTIONS)(fn)


def _given(*names: str) -> bool:
    """Whether any of these options was given on the command line (or its environment), not defaulted."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return any(ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT) for n in names)


def elastic_config(kw: dict) -> ElasticConfig:
    """Pop the elastic-ranking options out of ``kw`` into an :class:`ElasticConfig`."""
    for name in ("steps", "targets_per_step", "calib_size", "batch_size", "fisher_projections"):
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
    return ElasticConfig(targets=targets, keep_schedule=_given("steps", "targets_per_step", "lr"),
                         steps=kw.pop("steps"), lr=kw.pop("lr"),
                         temperature=kw.pop("temperature"), targets_per_step=kw.pop("targets_per_step"),
                         loss=kw.pop("loss"), token_weight=kw.pop("token_weight"),
                         relational_weight=kw.pop("relational_weight"),
                         fisher_projections=kw.pop("fisher_projections"), compute=kw.pop("ranking_compute"))
