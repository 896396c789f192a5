"""The deployment commands: ``build tensorrt`` / ``build triton`` (and the original ``build --target``),
which add engines or a Triton model repository to an artifact directory, and ``serve`` (a real Triton server)."""

from __future__ import annotations

from pathlib import Path

import click

from elastic_export.cli.options import apply_options, echo_err
from elastic_export.core.manifest import MANIFEST
from elastic_export.serving.api_guard import API_KEY_ENV, MAX_CONCURRENT, PAYLOAD_LIMIT
from elastic_export.serving.backends import TRITON_BUDGET_BACKENDS
from elastic_export.serving.openai_schema import MAX_INPUTS
from elastic_export.serving.policies import ROUTER_POLICIES

# --- build: `build tensorrt DIR`, `build triton DIR`, and the original `build --target T DIR` ----------
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
                 help="Triton: latency objective of the adaptive policy (ms) [default: 250]."),
    click.option("--slo-quantile", type=float, default=None,
                 help="Triton: the latency quantile the SLO bounds [default: 0.99, p99]."),
    click.option("--max-sparsity", type=float, default=None,
                 help="Triton: quality floor: the adaptive policy never serves a sparser budget [default: none]."),
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

    manifest = build_engines(directory, dense=not no_dense, echo=echo_err, **options)
    for entry in [manifest.dense, *manifest.budgets]:
        if entry.engine:
            click.echo(entry.engine)
    click.echo(f"wrote {Path(directory) / MANIFEST}")


def _build_triton(directory: str, precision: str, max_batch: int | None, no_dense: bool, triton_name: str,
                  triton_instances: int, triton_kind: str, triton_default_sparsity: float | None,
                  triton_queue_delay_us: int, triton_platform: str, policy: str | None = None,
                  slo_ms: float | None = None, slo_quantile: float | None = None, max_sparsity: float | None = None,
                  ort_threads: int = 0) -> None:
    """Write DIR/triton/ and print its models."""
    from elastic_export.targets.triton import build_repository

    manifest = build_repository(directory, name=triton_name, max_batch=max_batch, instances=triton_instances,
                                kind=triton_kind, default_sparsity=triton_default_sparsity,
                                queue_delay_us=triton_queue_delay_us, precision=precision, dense=not no_dense,
                                platform=triton_platform, policy=policy, slo_ms=slo_ms, slo_quantile=slo_quantile,
                                max_sparsity=max_sparsity, ort_threads=ort_threads, echo=echo_err)
    t = manifest.triton
    for m in t["models"]:
        click.echo(f"{t['dir']}/{m['name']} ({m['platform']}, sparsity {m['sparsity']:g})")
    how = f"default sparsity {t['default_sparsity']:g}" if t["policy"] == "fixed" else "load-adaptive"
    click.echo(f"{t['dir']}/{t['router']} (router, python backend, {how})")
    click.echo(f"wrote {Path(directory) / MANIFEST}")


@click.command("build")
@click.argument("directory", metavar="DIR")
@click.option("--target", type=click.Choice(["tensorrt", "triton"]), required=True,
              help="tensorrt: one engine per budget (+ dense.engine); triton: a Triton model repository.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help=_TRT_PRECISION.format(" (tensorrt only)"))
@apply_options(*_TRT_BATCH)
@click.option("--max-batch", type=int, default=128, show_default=True,
              help="Largest batch of the profile (triton: max_batch_size [default: 128, or the engines' maximum]).")
@apply_options(*_TRT_REST)
@click.option("--no-dense", is_flag=True, default=False, help="Do not build dense.engine (triton: do not serve the dense model).")
@apply_options(*_TRITON)
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


@click.group("build", cls=_BuildGroup)
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
@apply_options(*_TRT_BATCH)
@click.option("--max-batch", type=int, default=128, show_default=True, help="Largest batch of the profile.")
@apply_options(*_TRT_REST)
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
@apply_options(*_TRITON)
def build_triton_cmd(directory, **kw):
    """Write DIR/triton/, a Triton model repository: one model per budget (the ONNX, or the engine
    where the manifest lists one) and a router model that picks the budget per request; record it
    in DIR's manifest."""
    _build_triton(directory, **kw)


_EXPOSURE = (
    click.option("--api-key", envvar=API_KEY_ENV, show_envvar=True, default=None,
                 help="Every /v1 route and /metrics need 'Authorization: Bearer KEY'. Set it through the environment "
                      "variable or --api-key-file: on the command line it is readable in the process list until serve "
                      "overwrites it there."),
    click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
                 help="A file whose first line is the API key."),
    click.option("--allow-no-api-key", is_flag=True, default=False,
                 help="Serve a non-loopback --host without an API key (refused otherwise)."),
    click.option("--expose-triton", is_flag=True, default=False,
                 help="Bind Triton's HTTP, gRPC and metrics to --host too; every Triton API but inference, health, "
                      "metadata and model-config then needs serve's secret header."),
    click.option("--payload-limit", type=int, default=PAYLOAD_LIMIT, show_default=True,
                 help="Most bytes of a request body (checked while reading; 413 past it)."),
    click.option("--max-client-batch-size", type=int, default=MAX_INPUTS, show_default=True,
                 help="Most inputs in one request (413 past it)."),
    click.option("--max-concurrent-requests", type=int, default=MAX_CONCURRENT, show_default=True,
                 help="Most /v1 requests in flight (429 with Retry-After past it)."),
    click.option("--drain-timeout", type=float, default=30.0, show_default=True,
                 help="SIGTERM: seconds to answer the requests in flight (new ones: 503) and stop."),
)


def _exposure(ctx, api_key, api_key_file, allow_no_api_key, expose_triton, payload_limit, max_client_batch_size,
              max_concurrent_requests, drain_timeout):
    """serve's :class:`~elastic_export.serving.api_guard.Exposure` from its options; a key given on the command
    line is overwritten in the process list at once."""
    from elastic_export.core.errors import UserError
    from elastic_export.serving.api_guard import Exposure, Limits, hide_argument

    if api_key_file is not None:
        if api_key is not None:
            raise UserError(f"--api-key-file {api_key_file}: give the key one way, not with --api-key or {API_KEY_ENV} too")
        try:
            api_key = (Path(api_key_file).read_text().splitlines() or [""])[0].strip()
        except OSError as e:
            raise UserError(f"--api-key-file {api_key_file}: {e.strerror or e}") from None
    elif api_key is not None and ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE:
        if not hide_argument(api_key):
            echo_err(f"warning: --api-key stays readable in the process list here; use {API_KEY_ENV} or --api-key-file")
    limits = Limits(api_key=api_key, payload_limit=payload_limit, max_client_batch_size=max_client_batch_size,
                    max_concurrent_requests=max_concurrent_requests)
    return Exposure(limits, expose_triton=expose_triton, allow_no_api_key=allow_no_api_key, drain_timeout_s=drain_timeout)


@click.command("serve", short_help="Run a real Triton server on DIR's repository (built when missing).")
@click.argument("directory", metavar="DIR")
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port; gRPC on PORT+1, metrics on PORT+2.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the OpenAI API binds to; Triton's HTTP, gRPC and metrics stay on 127.0.0.1 unless "
                   "--expose-triton. Not loopback: an API key is required (docs/deploy.md).")
@click.option("--budget-backend", type=click.Choice(TRITON_BUDGET_BACKENDS), default=None,
              help="Backend of the budget models when (re)building the repository [default: python where the server "
                   "has no onnxruntime backend, as PyPI's nvidia-pytriton server has not, else auto].")
@click.option("--policy", type=click.Choice(ROUTER_POLICIES), default=None,
              help="How the router picks a budget for requests that name none [default: adaptive].")
@click.option("--slo-ms", type=float, default=None, help="Latency objective of the adaptive policy (ms).")
@click.option("--slo-quantile", type=float, default=None,
              help="The latency quantile the SLO is stated for, in (0, 1) [default: the router's, 0.99].")
@click.option("--max-sparsity", type=float, default=None,
              help="Quality floor: the adaptive policy never serves a budget sparser than this [default: none].")
@click.option("--allow-model-control", is_flag=True, default=False,
              help="Leave Triton's model-repository API (load / unload / index) open to every client, on HTTP and "
                   "gRPC [default: closed; serve alone holds its key].")
@click.option("--ready-timeout", type=float, default=300.0, show_default=True,
              help="Seconds to wait for every model to be READY.")
@apply_options(*_EXPOSURE)
@click.pass_context
def serve_cmd(ctx, directory, port, host, budget_backend, policy, slo_ms, slo_quantile, max_sparsity,
              allow_model_control, ready_timeout, **door):
    """Serve DIR with a real Triton Inference Server in the foreground: the budget models first, then
    the router once every one of them is READY; prints the endpoints when ready; reloads a model whose
    Python backend stub dies; Ctrl-C or SIGTERM stops it (no process left behind, the server never
    outlives serve). The server is the `serve` extra's (pip install -e ".[serve]")."""
    from elastic_export.targets.tritonserver import serve

    exposure = _exposure(ctx, **door)
    serve(directory, port=port, host=host, budget_backend=budget_backend, policy=policy, slo_ms=slo_ms,
          slo_quantile=slo_quantile, max_sparsity=max_sparsity, allow_model_control=allow_model_control,
          ready_timeout_s=ready_timeout, echo=click.echo, exposure=exposure)
    click.echo("stopped")
