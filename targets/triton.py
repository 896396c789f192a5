"""A Triton Inference Server model repository from an artifact directory.

``build_repository(DIR)`` writes ``DIR/triton/``:

* one model per budget (and the dense model), named ``<name>_s010`` ... from the budget tag, each
  ``<model>/1/model.onnx`` (platform ``onnxruntime_onnx``) or ``<model>/1/model.plan``
  (``tensorrt_plan``, where the manifest lists an engine) plus a ``config.pbtxt``: the manifest's
  inputs / outputs with the batch dim stripped (``max_batch_size`` > 0), dynamic batching and an
  instance group. Model files are hard links to the directory's files where the filesystem allows,
  copies otherwise;
* with an index in the directory (``elastic-export index``), a search model ``<name>_search`` (Python
  backend, :mod:`elastic_export.targets.triton_search` copied verbatim as its ``model.py``, hard links of
  the index's files in ``1/index/``, the tokenizer in ``1/tokenizer/``): query text in, the dense index's
  top-k ids and scores out, each query encoded by the router (BLS, so search is load like any other);
* an indexing lane ``<name>_index``: the dense model once more, a model of its own, so that documents
  (always embedded dense) never wait in the queries' dense queue; a ``python`` one runs its compute at
  niceness :data:`INDEX_NICE`, so that it takes the cores only while the query models leave them idle;
* a router model ``<name>`` (Python backend, business-logic scripting): the same inputs plus an
  optional ``sparsity`` input (or a ``sparsity`` request parameter); its ``model.py`` is the module
  :mod:`elastic_export.targets.triton_router`, copied verbatim, next to verbatim copies of the
  serving modules it is glue over (:func:`router_modules`: a Triton without this package loads them
  from there), which forwards each request to the budget model
  :func:`~elastic_export.serving.router_budgets.choose_budget` picks and answers with that model's
  outputs (plus ``served_sparsity`` on request). No sparsity asked for: the configured default budget.
  The budget table and the default are ``parameters`` of the router's ``config.pbtxt``, read by the
  router at load time.

``elastic.onnx`` is not served: its ``budget_index`` input has no batch dim, so Triton's dynamic
batcher cannot batch it; the per-budget models batch, and the router picks among them.

The repository is written to a temporary directory next to it and moved into place only when
complete (a previous ``triton/`` is replaced), then recorded in the manifest (``triton`` entry,
written atomically). Imports neither torch nor Triton: the configs are written as text and parse
with Triton's own ``ModelConfig`` protobuf schema (``tritonclient``, the ``triton`` extra).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

from elastic_export.core.budgets import budget_tag
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.fileio import existing_dir, umask
from elastic_export.core.manifest import LATENCY_PROFILE, MANIFEST, Manifest, resolve, write_manifest
from elastic_export.index import search as search_model
from elastic_export.serving import router_budgets
from elastic_export.serving import router_config as router_cfg  # router_config() writes its text
from elastic_export.serving.backends import TRITON_BUDGET_BACKENDS
from elastic_export.serving.policies import ROUTER_POLICIES
from elastic_export.targets import triton_onnx_model as ort_model
from elastic_export.targets import triton_router as router

TRITON_DIR = "triton"
DEFAULT_NAME = "elastic"
DEFAULT_MAX_BATCH = 128
DEFAULT_INSTANCES = 1
DEFAULT_QUEUE_DELAY_US = 100
QUEUE_BATCHES = 4  # a budget model's queue holds at most this many max-size batches of requests
QUEUE_TIMEOUT_MS = 30e3  # without an SLO, a request waits at most twice this in a budget model's queue
READY_TIMEOUT_S = 300  # how long the router waits, at load, for its budget models to be READY
INLINE_MAX_BYTES = 2 << 30  # the router holds its own copy of every budget for inline runs up to this many bytes
KINDS = {"auto": "KIND_AUTO", "cpu": "KIND_CPU", "gpu": "KIND_GPU"}
PLATFORMS = TRITON_BUDGET_BACKENDS
POLICIES = ROUTER_POLICIES
assert router_cfg.POLICIES == POLICIES, "serving/router_config.py spells the policies as serving/policies.py does"
ORT_MODEL_FILE = "triton_onnx_model.py"  # the python-backend budget model, copied verbatim as its model.py
SPARSITY_INPUT = router_cfg.SPARSITY_INPUT
SERVED_OUTPUT = router_cfg.SERVED_OUTPUT
ROUTER_FILE = "triton_router.py"  # this package's router module, copied verbatim as the router's model.py
ROUTER_HEADER = '"""elastic-export router'  # how that file starts: marks a triton/ this tool wrote
SEARCH_FILE = "triton_search.py"  # the search model, copied verbatim as its model.py
SEARCH_SUFFIX = "_search"  # the search model is <name>_search
INDEX_SUFFIX = "_index"  # the indexing lane (the dense model for documents) is <name>_index
INDEX_NICE = 19  # its compute's niceness: the lowest priority, it yields the cores to every query
_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
          "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL", "float64": "TYPE_FP64"}
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class ServedModel:
    """One budget model of the repository.

    Args:
        name: Triton model name (``<name>_s010``).
        sparsity: the budget's sparsity (0.0: the dense model).
        platform: ``onnxruntime_onnx``, ``tensorrt_plan`` or ``python`` (the ONNX run by
            :mod:`elastic_export.targets.triton_onnx_model` in the Python backend).
        source: the file served, relative to the artifact directory.
    """

    name: str
    sparsity: float
    platform: str
    source: str

    @property
    def filename(self) -> str:
        return "model.plan" if self.platform == "tensorrt_plan" else "model.onnx"


# --- config text ----------------------------------------------------------------------------------
def triton_dims(shape: Sequence[Any], what: str) -> list[int]:
    """Triton ``dims`` of a manifest shape: the batch dim (first) dropped, symbolic dims as -1.

    Raises:
        UserError: no dims, or a first dim that is a fixed number (not batchable).
    """
    dims = list(shape or [])
    if not dims or isinstance(dims[0], int):
        raise UserError(f"{MANIFEST}: {what} shape {dims} has no symbolic batch dim; Triton's batching needs one")
    return [d if isinstance(d, int) and not isinstance(d, bool) and d > 0 else -1 for d in dims[1:]]


def triton_type(dtype: str, what: str) -> str:
    """Triton data type (``TYPE_FP32`` ...) of a manifest dtype (``float32`` ...)."""
    if dtype not in _TYPES:
        raise UserError(f"{MANIFEST}: {what} dtype {dtype!r} has no Triton type")
    return _TYPES[dtype]


def _tensor(name: str, dtype: str, dims: Sequence[int], optional: bool = False) -> str:
    return (f'  {{\n    name: "{name}"\n    data_type: {dtype}\n    dims: {list(dims)}\n'
            + ("    optional: true\n" if optional else "") + "  }")


def _tensors(key: str, specs: Sequence[dict], extra: Sequence[str] = (), batch_dim: bool = False,
             optional: bool = False) -> str:
    """``input [...]`` / ``output [...]`` of manifest specs (dims without the batch dim, or with it kept
    as ``-1`` for a model that does not batch), then the ``extra`` entries."""
    items = []
    for spec in specs:
        what = f"{key} {spec['name']!r}"
        dims = ([-1] if batch_dim else []) + triton_dims(spec.get("shape"), what)
        items.append(_tensor(spec["name"], triton_type(spec.get("dtype"), what), dims, optional))
    return f"{key} [\n" + ",\n".join(items + list(extra)) + "\n]\n"


def _parameters(values: dict[str, str]) -> str:
    items = [f'  {{\n    key: "{k}"\n    value {{ string_value: {_quote(v)} }}\n  }}' for k, v in values.items()]
    return "parameters [\n" + ",\n".join(items) + "\n]\n"


def _instances(kind: str, count: int) -> str:
    return f"instance_group [\n  {{\n    kind: {kind}\n    count: {count}\n  }}\n]\n"


def _quote(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid protobuf text-format string literal


BUDGET_NICE = 5  # a python budget model's compute yields the cores to the request path (triton_onnx_model)


def _session_parameters(ort_threads: int, warmup_tokens: int, nice: int = BUDGET_NICE) -> dict[str, str]:
    """The onnxruntime session parameters (:func:`elastic_export.targets.triton_onnx_model.open_session`)
    of a python budget model and of the router's inline sessions: threads, no spinning, warm-up length, and
    the niceness of their compute (:data:`BUDGET_NICE`; the indexing lane's :data:`INDEX_NICE`)."""
    return {ort_model.THREADS_PARAMETER: str(ort_threads), ort_model.WARMUP_PARAMETER: str(warmup_tokens),
            ort_model.SPIN_PARAMETER: "0", ort_model.NICE_PARAMETER: str(nice)}


def queue_policy(max_batch: int, slo_ms: float | None) -> str:
    """The dynamic batcher's queue policy of a budget model: at most ``QUEUE_BATCHES x max_batch`` requests
    wait, and one that waited longer than twice the SLO (:data:`QUEUE_TIMEOUT_MS` without one) is rejected
    (the router answers it as an overload, HTTP 503): a queue never holds work that is already late.

    Not for ``python`` budget models: in Triton 2.51 a Python-backend model with any
    ``default_queue_policy`` (even ``max_queue_size`` alone) leaves a request that arrived while it was
    executing in the queue, its instance idle, until the next request arrives (server traces: idle waits up
    to 156 ms at 30 % load; dense p99 215 ms with the policy, 75 ms without). There the router's admission
    bounds what reaches them."""
    timeout_us = int(2 * (slo_ms or QUEUE_TIMEOUT_MS) * 1e3)
    return (f"  default_queue_policy {{\n    timeout_action: REJECT\n    default_timeout_microseconds: {timeout_us}\n"
            f"    allow_timeout_override: true\n    max_queue_size: {QUEUE_BATCHES * max_batch}\n  }}\n")


def model_config(model: ServedModel, inputs: Sequence[dict], outputs: Sequence[dict], *, max_batch: int,
                 kind: str, instances: int, queue_delay_us: int, ort_threads: int = 0, warmup_tokens: int = 16,
                 slo_ms: float | None = None, nice: int = BUDGET_NICE) -> str:
    """``config.pbtxt`` of one budget model (or of the indexing lane: ``nice`` :data:`INDEX_NICE`).

    Args:
        model: the model.
        inputs: manifest input specs (name, dtype, shape with a symbolic batch dim).
        outputs: manifest output specs.
        max_batch: ``max_batch_size``.
        kind: ``KIND_AUTO`` / ``KIND_CPU`` / ``KIND_GPU``.
        instances: instances per device.
        queue_delay_us: the dynamic batcher's ``max_queue_delay_microseconds``.
        ort_threads: onnxruntime intra-op threads of a ``python`` budget model (0: its default).
        warmup_tokens: free dims of a ``python`` budget model's warm-up runs at load.
        slo_ms: the router's SLO (the queue policy's timeout, :func:`queue_policy`).
        nice: the niceness of a ``python`` model's compute.
    """
    runs = 'backend: "python"' if model.platform == "python" else f'platform: "{model.platform}"'
    params = {"sparsity": repr(model.sparsity)}
    if model.platform == "python":
        params.update(_session_parameters(ort_threads, warmup_tokens, nice))
    return (f'name: "{model.name}"\n{runs}\nmax_batch_size: {max_batch}\n'
            + _tensors("input", inputs) + _tensors("output", outputs)
            + f"dynamic_batching {{\n  max_queue_delay_microseconds: {queue_delay_us}\n"
            + ("" if model.platform == "python" else queue_policy(max_batch, slo_ms)) + "}\n"
            + _instances(kind, instances) + _parameters(params))


@dataclass(frozen=True)
class RouterSettings:
    """How the router picks a budget (its ``config.pbtxt`` parameters).

    Args:
        default: the sparsity served when a request names none (``policy: fixed``).
        policy: ``adaptive`` (the load-adaptive policy) or ``fixed`` (always ``default``).
        slo_ms: the latency objective the adaptive policy steps down for (None: none).
        precision: the precision the budget models serve (reported as ``served_precision``).
        text: declare the ``text`` input (BYTES; the router tokenizes it).
        inline: the router runs a request on the budget's ONNX file itself when it has nothing else in
            flight (written for ``python`` budget models: their Python has onnxruntime).
        slo_quantile: the latency quantile the SLO bounds (None: the router's default, p99).
        max_sparsity: the adaptive policy never serves a budget sparser than this (None: no floor).
    """

    default: float
    policy: str = "adaptive"
    slo_ms: float | None = None
    precision: str = "fp32"
    text: bool = False
    inline: bool = False
    slo_quantile: float | None = None
    max_sparsity: float | None = None


def router_config(name: str, models: Sequence[ServedModel], settings: RouterSettings, inputs: Sequence[dict],
                  outputs: Sequence[dict], ort_threads: int = 0, warmup_tokens: int = 16, max_batch: int = 128) -> str:
    """``config.pbtxt`` of the router (Python backend, ``max_batch_size: 0``: it forwards, the budget
    models batch). Inputs: the model's (optional where ``text`` may replace them), ``sparsity`` (FP32
    ``[-1, 1]``: one value for every row or one per row) and ``text`` (BYTES ``[-1]``) when asked;
    outputs: the model's plus ``served_sparsity`` (FP64 ``[-1, 1]``) and ``served_precision`` (BYTES).
    Its ``parameters`` carry the budget table (``budget_models``: JSON ``[[sparsity, model name], ...]``),
    ``default_sparsity``, ``policy``, ``slo_ms``, ``precision`` and, with ``settings.inline``, ``inline``
    (with the inline sessions' ``intra_op_threads``, ``allow_spinning``, ``warmup_tokens`` and ``nice``): editing
    them changes the routing without touching ``model.py``."""
    table = json.dumps([[m.sparsity, m.name] for m in models])
    own_in = [_tensor(SPARSITY_INPUT, "TYPE_FP32", [-1, 1], optional=True)]
    if settings.text:
        own_in.append(_tensor(router_cfg.TEXT_INPUT, "TYPE_STRING", [-1], optional=True))
    own_out = [_tensor(SERVED_OUTPUT, "TYPE_FP64", [-1, 1]), _tensor(router_cfg.PRECISION_OUTPUT, "TYPE_STRING", [-1, 1])]
    params = {router_cfg.MODELS_PARAMETER: table, router_cfg.DEFAULT_PARAMETER: repr(settings.default),
              router_cfg.POLICY_PARAMETER: settings.policy, router_cfg.PRECISION_PARAMETER: settings.precision,
              router_cfg.READY_TIMEOUT_PARAMETER: repr(float(READY_TIMEOUT_S)),
              router_cfg.MAX_ROWS_PARAMETER: str(max_batch), router_cfg.TOKENS_PARAMETER: str(warmup_tokens)}
    for key, value in ((router_cfg.SLO_PARAMETER, settings.slo_ms), (router_cfg.QUANTILE_PARAMETER, settings.slo_quantile),
                       (router_cfg.MAX_SPARSITY_PARAMETER, settings.max_sparsity)):
        if value is not None:
            params[key] = repr(float(value))
    if settings.inline:
        params.update({router_cfg.INLINE_PARAMETER: "1", **_session_parameters(ort_threads, warmup_tokens)})
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            + _tensors("input", inputs, own_in, batch_dim=True, optional=settings.text)
            + _tensors("output", outputs, own_out, batch_dim=True)
            + _instances("KIND_CPU", 1) + _parameters(params))


@dataclass(frozen=True)
class SearchPlan:
    """The search model of a repository: its name, the manifest's ``index`` entry, the index's files by
    key (``file``, ``ids``, ``docs``) and its settings (the router, the embedding output, the inputs)."""

    name: str
    entry: dict
    files: dict[str, Path]
    settings: search_model.SearchSettings

    @property
    def count(self) -> int:
        return int(self.entry["count"])


def search_config(plan: SearchPlan) -> str:
    """``config.pbtxt`` of the search model (Python backend, ``max_batch_size: 0``: each request goes to the
    router as it is). Inputs ``text`` (BYTES ``[-1]``), optional ``top_k`` (INT32 ``[1]``) and ``sparsity``
    (FP32 ``[-1, 1]``); outputs ``ids`` (BYTES), ``scores`` (FP32), ``texts`` (BYTES; ``[-1, -1]``: rows x
    top_k) and ``served_sparsity`` (FP64 ``[-1, 1]``, as the router's)."""
    m = search_model
    inputs = [_tensor(m.TEXT_INPUT, "TYPE_STRING", [-1]), _tensor(m.TOP_K_INPUT, "TYPE_INT32", [1], optional=True),
              _tensor(m.SPARSITY_INPUT, "TYPE_FP32", [-1, 1], optional=True)]
    outputs = [_tensor(m.IDS_OUTPUT, "TYPE_STRING", [-1, -1]), _tensor(m.SCORES_OUTPUT, "TYPE_FP32", [-1, -1]),
               _tensor(m.SERVED_OUTPUT, "TYPE_FP64", [-1, 1]), _tensor(m.TEXTS_OUTPUT, "TYPE_STRING", [-1, -1])]
    return (f'name: "{plan.name}"\nbackend: "python"\nmax_batch_size: 0\n'
            + "input [\n" + ",\n".join(inputs) + "\n]\n" + "output [\n" + ",\n".join(outputs) + "\n]\n"
            + _instances("KIND_CPU", 1) + _parameters(plan.settings.parameters()))


def plan_search(manifest: Manifest, name: str, tokenizer: Path | None, outputs: Sequence[dict], max_batch: int,
                sparsities: Sequence[float], echo: Callable[[str], None]) -> SearchPlan | None:
    """The search model to serve: None without an index (or a tokenizer), or with one whose files are
    missing or built with another model (said with one line: the rest is served without search)."""
    if not manifest.index or tokenizer is None:
        return None
    from elastic_export.index.store import index_files

    try:
        files = index_files(manifest)
    except UserError as e:
        echo(f"no search model: {e}")
        return None
    names = [o["name"] for o in outputs]
    output = next((n for n in ("sentence_embedding", "last_hidden_state") if n in names), None)
    if output is None:
        echo("no search model: the model has no sentence_embedding or last_hidden_state output")
        return None
    settings = search_model.SearchSettings(name, output, tuple(v.name for v in manifest.inputs), max_batch,
                                           ready_timeout_s=float(READY_TIMEOUT_S), sparsities=tuple(sparsities))
    return SearchPlan(f"{name}{SEARCH_SUFFIX}", dict(manifest.index), files, settings)


def _package_source(filename: str) -> str:
    return (resources.files(__package__) / filename).read_text()


def router_source() -> str:
    """The router's ``model.py``: the text of :mod:`elastic_export.targets.triton_router`, verbatim."""
    return _package_source(ROUTER_FILE)


def router_modules() -> dict[str, str]:
    """The serving modules the router is glue over (:data:`~elastic_export.targets.triton_router.SERVING_MODULES`),
    by file name, each the text of the package's own file: copied next to its ``model.py``, so that a Triton
    whose Python lacks this package loads the router from its own folder."""
    return serving_sources(router.SERVING_MODULES)


def stale_model_files(repository: Path, entry: dict) -> list[str]:
    """The Python files of a built repository (``entry``: the manifest's ``triton`` entry) that are not this
    package's current text: the router's ``model.py`` and serving modules, each Python budget model's. A
    repository built by another version of elastic-export runs its own ``model.py`` over this version's
    serving modules, which need not agree: it is built anew."""
    want: dict[Path, str] = {}
    if entry.get("router"):
        version = repository / entry["router"] / "1"
        want[version / "model.py"] = router_source()
        want.update({version / f: t for f, t in router_modules().items()})
    budget_files = {"model.py": _package_source(ORT_MODEL_FILE), **serving_sources(ort_model.SERVING_MODULES)}
    for m in entry.get("models", []) + ([entry["index"]] if isinstance(entry.get("index"), dict) else []):
        if m.get("platform") == "python":
            want.update({repository / m["name"] / "1" / f: t for f, t in budget_files.items()})
    if isinstance(entry.get("search"), dict) and entry["search"].get("name"):
        want[repository / entry["search"]["name"] / "1" / "model.py"] = _package_source(SEARCH_FILE)
    return sorted(str(p.relative_to(repository)) for p, text in want.items()
                  if not p.is_file() or p.read_text() != text)


def serving_sources(modules: Sequence[str]) -> dict[str, str]:
    """``{file name: text}`` of these :mod:`elastic_export.serving` modules, the package's own files."""
    serving = resources.files("elastic_export.serving")
    return {f"{m}.py": (serving / f"{m}.py").read_text() for m in modules}


# --- what to serve --------------------------------------------------------------------------------
def index_model(models: Sequence[ServedModel], name: str) -> ServedModel | None:
    """The indexing lane: the dense model served once more as ``<name>_index`` (None without a dense model)."""
    dense = [m for m in models if m.sparsity == 0.0]
    return None if not dense else ServedModel(f"{name}{INDEX_SUFFIX}", 0.0, dense[0].platform, dense[0].source)


def _check_name(name: str) -> None:
    if not name or not set(name) <= _NAME_CHARS or name.startswith("."):
        raise UserError(f"--triton-name {name!r}: use letters, digits, '_', '-' and '.' (not first)")


def plan_models(directory: Path, manifest: Manifest, *, name: str = DEFAULT_NAME, precision: str = "fp32",
                dense: bool = True, platform: str = "auto") -> list[ServedModel]:
    """The budget models to serve, sources checked to exist, densest first.

    Args:
        directory: the artifact directory.
        manifest: its loaded manifest.
        name: model name prefix (budget models are ``<name>_<tag>``; the router is ``<name>``).
        precision: ``fp32`` (the ``onnx`` files) or ``fp16`` (``onnx_fp16``; ONNX only).
        dense: also serve the dense model (sparsity 0.0).
        platform: ``auto`` (an engine where the manifest lists one, else the ONNX), ``onnxruntime``
            (always the ONNX), ``python`` (the ONNX in the Python backend, run by onnxruntime),
            ``tensorrt`` (engines only; every served model needs one).

    Raises:
        UserError: a bad option or a missing file.
    """
    _check_name(name)
    if precision not in ("fp32", "fp16"):
        raise UserError(f"--precision {precision}: choose fp32 or fp16")
    if platform not in PLATFORMS:
        raise UserError(f"--budget-backend {platform}: choose {', '.join(PLATFORMS)}")
    entries = ([(0.0, manifest.dense)] if dense else []) + [(float(b.sparsity), b) for b in manifest.budgets]
    if not entries:
        raise UserError(f"{directory}: the manifest lists no budgets to serve")
    models = []
    for sparsity, entry in entries:
        label = "dense model" if entry is manifest.dense else f"budget {sparsity:g}"
        engine = entry.engine if platform in ("auto", "tensorrt") else None
        if platform == "tensorrt" and not engine:
            raise UserError(f"--budget-backend tensorrt: the {label} has no engine; run "
                            f"`elastic-export build --target tensorrt {directory}` first")
        if engine:
            kind, rel = "tensorrt_plan", engine
        else:
            rel = entry.file(precision)
            kind = "python" if platform == "python" else "onnxruntime_onnx"
            if not rel:
                raise UserError(f"--precision {precision}: the {label} has no "
                                f"{'fp16 ONNX (export with --precision fp16)' if precision == 'fp16' else 'ONNX'}")
        path = resolve(directory, rel)
        if path is None or not path.is_file():
            raise UserError(f"{directory}: {rel} (the {label}) is missing")
        if kind != "tensorrt_plan":
            _check_onnx(path, f"{rel} (the {label})")
        models.append(ServedModel(f"{name}_{budget_tag(sparsity)}", sparsity, kind, rel))
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise UserError(f"{directory}: two budgets share the tag of {names}")
    return sorted(models, key=lambda m: m.sparsity)


def _io(directory: Path, manifest: Manifest, models: Sequence[ServedModel]) -> tuple[list[dict], list[dict]]:
    """Inputs and outputs to declare: the manifest's, or the fp16 ONNX's own (its float types may differ)."""
    fp16 = [m for m in models if m.platform != "tensorrt_plan" and m.source.endswith(".fp16.onnx")]
    if not fp16:
        return [v.to_dict() for v in manifest.inputs], [v.to_dict() for v in manifest.outputs]
    import onnx

    from elastic_export.core.manifest import io_specs

    g = onnx.load(str(resolve(directory, fp16[0].source)), load_external_data=False).graph
    return io_specs(g.input), io_specs(g.output)


def _engine_max_batch(manifest: Manifest) -> int | None:
    """The largest batch every engine's profile accepts (from the manifest's ``tensorrt`` entry)."""
    try:
        profile = manifest.tensorrt["profiles"][0]
        return min(int(v["max"][0]) for v in profile.values())
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None


def _check_onnx(path: Path, what: str) -> None:
    """Refuse a truncated or corrupt ONNX file before Triton is handed it (``onnx.checker`` on the file)."""
    import onnx

    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # the checker raises ValidationError, or a parse error for truncated files
        raise UserError(f"{what} is not a valid ONNX model ({first_line(e)[:160]}); export it again")


# --- building -------------------------------------------------------------------------------------
def _data_files(model: Path) -> list[Path]:
    """The external data file of an ONNX file, if it has one (:func:`elastic_export.core.onnx_io.files`)."""
    from elastic_export.core import onnx_io

    return onnx_io.files(model)[1:]


def _place(src: Path, dst: Path) -> str:
    """Hard-link ``src`` to ``dst`` (same filesystem), else copy it; returns ``link`` or ``copy``."""
    try:
        os.link(src, dst)
        return "link"
    except OSError:
        shutil.copyfile(src, dst)
        return "copy"


def _check_replaceable(directory: Path, manifest: Manifest) -> None:
    """Refuse to replace a ``triton/`` this tool did not write (not recorded in the manifest, not empty)."""
    target = directory / TRITON_DIR
    if not target.exists() and not target.is_symlink():
        return
    if not target.is_dir() or target.is_symlink():
        raise UserError(f"{target}: exists and is not a directory; move it away first")
    ours = isinstance(manifest.triton, dict) and manifest.triton.get("dir") == TRITON_DIR
    ours = ours or any(p.read_text(errors="replace").startswith(ROUTER_HEADER) for p in target.glob("*/1/model.py"))
    if not ours and any(target.iterdir()):
        raise UserError(f"{target}: exists and was not written by elastic-export; move it away first")


def validate_config(text: str) -> Any:
    """Parse ``config.pbtxt`` text with Triton's own ``ModelConfig`` schema (``tritonclient``).

    Returns:
        The ``ModelConfig`` message.

    Raises:
        UserError: tritonclient is not installed, or the text does not parse.
    """
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError as e:
        raise UserError(f"validating Triton configs needs tritonclient (pip install -e \".[triton]\"): {e}") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise UserError(f"config does not parse with Triton's ModelConfig schema: {e}") from None


def _can_validate() -> bool:
    try:
        validate_config('name: "x"')
        return True
    except UserError:
        return False


def _check_options(kind: str, instances: Any, max_batch: Any, queue_delay_us: Any) -> None:
    """Refuse a bad ``--triton-kind``, instance count, ``--max-batch`` or queue delay."""
    if kind not in KINDS:
        raise UserError(f"--triton-kind {kind}: choose {', '.join(KINDS)}")
    for opt, v in (("--triton-instances", instances), ("--max-batch", max_batch)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise UserError(f"{opt} must be a positive integer, got {v}")
    if isinstance(queue_delay_us, bool) or not isinstance(queue_delay_us, int) or queue_delay_us < 0:
        raise UserError(f"--triton-queue-delay-us must be a non-negative integer, got {queue_delay_us}")


def _served_max_batch(manifest: Manifest, models: Sequence[ServedModel], kind: str, max_batch: int | None) -> int:
    """``max_batch_size``: the one asked for, else 128, at most what the served engines' profile accepts.

    Raises:
        UserError: engines asked to run on the CPU, or a ``--max-batch`` above the engines' maximum.
    """
    engines = [m for m in models if m.platform == "tensorrt_plan"]
    if engines and kind == "cpu":
        raise UserError("--triton-kind cpu: TensorRT engines run on the GPU only; use --triton-platform onnxruntime")
    limit = _engine_max_batch(manifest) if engines else None
    if max_batch is None:
        return min(DEFAULT_MAX_BATCH, limit) if limit else DEFAULT_MAX_BATCH
    if limit is not None and max_batch > limit:
        raise UserError(f"--max-batch {max_batch}: the engines accept at most batch {limit}")
    return max_batch


def _default_budget(models: Sequence[ServedModel], default_sparsity: float | None) -> float:
    """The sparsity the router serves when a request names none (mapped as a request is; default: the densest)."""
    sparsities = [m.sparsity for m in models]
    try:
        return router_budgets.choose_budget(default_sparsity if default_sparsity is not None else sparsities[0],
                                            sparsities, sparsities[0])
    except router_budgets.BudgetError as e:
        raise UserError(f"--triton-default-sparsity: {e}") from None


def _served_io(directory: Path, manifest: Manifest, models: Sequence[ServedModel]) -> tuple[list[dict], list[dict]]:
    """The inputs and outputs to declare (:func:`_io`), none of them named as the router's own tensors."""
    inputs, outputs = _io(directory, manifest, models)
    for spec in inputs + outputs:
        if spec["name"] in router_cfg.OWN_TENSORS:
            raise UserError(f"{MANIFEST}: the model has a tensor named {spec['name']!r}, which the router uses")
    return inputs, outputs


@dataclass(frozen=True)
class RepositoryPlan:
    """A repository checked before anything is written: the router's name, the budget models, the
    router's settings, the tensors declared and the serving options (see :func:`build_repository`)."""

    name: str
    models: list[ServedModel]
    router: RouterSettings
    inputs: list[dict]
    outputs: list[dict]
    max_batch: int
    kind: str
    instances: int
    queue_delay_us: int
    precision: str
    ort_threads: int = 0
    profile: Path | None = None  # the directory's latency profile, copied next to the router
    tokenizer: Path | None = None  # the folder whose tokenizer files serve the text input
    warmup_tokens: int = 16  # python budget models' warm-up length (the manifest's tokens)
    search: SearchPlan | None = None  # the search model, with an index
    index: ServedModel | None = None  # the indexing lane: the dense model for documents

    @property
    def default(self) -> float:
        return self.router.default

    def configs(self) -> dict[str, str]:
        """Every ``config.pbtxt`` text by model name (budget models, then the router), each parsed with
        Triton's own schema where ``tritonclient`` is installed."""
        configs = {m.name: model_config(m, self.inputs, self.outputs, max_batch=self.max_batch,
                                        kind="KIND_GPU" if m.platform == "tensorrt_plan" else KINDS[self.kind],
                                        instances=self.instances, queue_delay_us=self.queue_delay_us,
                                        ort_threads=self.ort_threads, warmup_tokens=self.warmup_tokens,
                                        slo_ms=self.router.slo_ms)
                   for m in self.models}
        if self.index is not None:
            configs[self.index.name] = model_config(
                self.index, self.inputs, self.outputs, max_batch=self.max_batch, kind=KINDS[self.kind],
                instances=1, queue_delay_us=self.queue_delay_us, ort_threads=self.ort_threads,
                warmup_tokens=self.warmup_tokens, nice=INDEX_NICE)
        configs[self.name] = router_config(self.name, self.models, self.router, self.inputs, self.outputs,
                                           ort_threads=self.ort_threads, warmup_tokens=self.warmup_tokens,
                                           max_batch=self.max_batch)
        if self.search is not None:
            configs[self.search.name] = search_config(self.search)
        if _can_validate():
            for model_name, text in configs.items():
                try:
                    validate_config(text)
                except UserError as e:  # a bug here, not bad input: say which model
                    raise UserError(f"{model_name}: {e}") from None
        return configs

    def entry(self) -> dict:
        """The manifest's ``triton`` entry."""
        return {
            "dir": TRITON_DIR,
            "router": self.name,
            "default_sparsity": self.default,
            "policy": self.router.policy,
            "slo_ms": self.router.slo_ms,
            "slo_quantile": self.router.slo_quantile,
            "max_sparsity": self.router.max_sparsity,
            "text_input": self.router.text,
            "models": [{"name": m.name, "sparsity": m.sparsity, "platform": m.platform,
                        "source": m.source, "file": f"{TRITON_DIR}/{m.name}/1/{m.filename}"} for m in self.models],
            "max_batch_size": self.max_batch,
            "instance_kind": self.kind,
            "instances": self.instances,
            "max_queue_delay_microseconds": self.queue_delay_us,
            "precision": self.precision,
            "index": None if self.index is None else {
                "name": self.index.name, "sparsity": self.index.sparsity, "platform": self.index.platform,
                "source": self.index.source, "file": f"{TRITON_DIR}/{self.index.name}/1/{self.index.filename}",
                "nice": INDEX_NICE if self.index.platform == "python" else None},
            "search": None if self.search is None else {"name": self.search.name, "count": self.search.count,
                                                        "index": self.search.entry},
        }


def _stage(directory: Path, staging: Path, plan: RepositoryPlan, configs: dict[str, str]) -> dict[str, str]:
    """Write the repository into ``staging``: model files (hard links or copies), the router's
    ``model.py`` and its serving modules, and every ``config.pbtxt``. Returns ``link`` or ``copy`` by budget model."""
    placed = {}
    for m in [*plan.models, *([plan.index] if plan.index is not None else [])]:
        version = staging / m.name / "1"
        version.mkdir(parents=True)
        src = resolve(directory, m.source)
        placed[m.name] = _place(src, version / m.filename)
        for data in _data_files(src):  # external data: read by the name the model file records
            _place(data, version / data.name)
        if m.platform == "python":
            (version / "model.py").write_text(_package_source(ORT_MODEL_FILE))
            for filename, text in serving_sources(ort_model.SERVING_MODULES).items():
                (version / filename).write_text(text)
    (staging / plan.name / "1").mkdir(parents=True)
    if plan.profile is not None:
        shutil.copyfile(plan.profile, staging / plan.name / "1" / router.PROFILE_FILE)
    if plan.tokenizer is not None:
        from elastic_export.models.text import copy_tokenizer

        copy_tokenizer(plan.tokenizer, staging / plan.name / "1" / router.TOKENIZER_DIR)
    (staging / plan.name / "1" / "model.py").write_text(router_source())
    for filename, text in router_modules().items():
        (staging / plan.name / "1" / filename).write_text(text)
    if plan.search is not None:
        _stage_search(staging, plan.search, plan.tokenizer)
    for model_name, text in configs.items():
        (staging / model_name / "config.pbtxt").write_text(text)
    return placed


def _stage_search(staging: Path, search: SearchPlan, tokenizer: Path) -> None:
    """The search model's version folder: hard links (or copies) of the index's files and its manifest
    entry in ``1/index/``, the tokenizer in ``1/tokenizer/``, ``model.py``."""
    from elastic_export.index import DOCS_FILE, IDS_FILE, INDEX_FILE
    from elastic_export.models.text import copy_tokenizer

    version = staging / search.name / "1"
    folder = version / search_model.INDEX_FOLDER
    folder.mkdir(parents=True)
    for key, filename in (("file", INDEX_FILE), ("ids", IDS_FILE), ("docs", DOCS_FILE)):
        _place(search.files[key], folder / filename)
    (folder / search_model.ENTRY_FILE).write_text(json.dumps(search.entry))
    copy_tokenizer(tokenizer, version / search_model.TOKENIZER_FOLDER)
    (version / "model.py").write_text(_package_source(SEARCH_FILE))


def write_repository(directory: Path, plan: RepositoryPlan, configs: dict[str, str]) -> dict[str, str]:
    """Write ``DIR/triton/`` next to it and move it into place (a previous one is replaced only then).

    Returns:
        ``link`` or ``copy`` by budget model (how its file was placed).
    """
    d = directory
    staging = Path(tempfile.mkdtemp(prefix=f".{TRITON_DIR}.", suffix=".partial", dir=d))
    old: Path | None = None
    try:
        placed = _stage(d, staging, plan, configs)
        os.chmod(staging, 0o777 & ~umask())
        target = d / TRITON_DIR
        if target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{TRITON_DIR}.", suffix=".old", dir=d))
            os.replace(target, old / TRITON_DIR)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if old is not None and (old / TRITON_DIR).exists() and not (d / TRITON_DIR).exists():
            os.replace(old / TRITON_DIR, d / TRITON_DIR)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return placed


def _inline(directory: Path, models: Sequence[ServedModel], echo: Callable[[str], None]) -> bool:
    """Whether the router runs idle requests itself: Python budget models (their Python has onnxruntime)
    whose files (external data included) come to at most :data:`INLINE_MAX_BYTES`: the router's sessions
    are one more copy of them in memory."""
    if not all(m.platform == "python" for m in models):
        return False
    files = [resolve(directory, m.source) for m in models]
    size = sum(f.stat().st_size for model in files for f in [model, *_data_files(model)])
    if size > INLINE_MAX_BYTES:
        echo(f"the router forwards every request: the budget models' {size / 2**30:.1f} GiB are more than it holds "
             f"a second copy of ({INLINE_MAX_BYTES / 2**30:g} GiB)")
        return False
    return True


def _tokenizer_folder(directory: Path, manifest: Manifest) -> Path | None:
    """Where the text input's tokenizer files are (:func:`elastic_export.models.text.tokenizer_folder`); None
    for a model without text inputs or without a ``tokenizer.json`` anywhere."""
    from elastic_export.models.text import tokenizer_folder

    if "input_ids" not in [v.name for v in manifest.inputs]:
        return None
    return tokenizer_folder(manifest, directory)


def _router_settings(models: Sequence[ServedModel], default_sparsity: float | None, policy: str | None,
                     slo_ms: float | None, precision: str, text: bool, inline: bool = False,
                     slo_quantile: float | None = None, max_sparsity: float | None = None) -> RouterSettings:
    """The router's settings: ``policy`` None means ``fixed`` when a default sparsity is given, else ``adaptive``."""
    policy = policy or ("fixed" if default_sparsity is not None else "adaptive")
    if policy not in POLICIES:
        raise UserError(f"--policy {policy}: choose {', '.join(POLICIES)}")
    if slo_ms is not None and (isinstance(slo_ms, bool) or not slo_ms > 0 or not math.isfinite(slo_ms)):
        raise UserError(f"--slo-ms must be a positive number of milliseconds, got {slo_ms}")
    if slo_quantile is not None and not (isinstance(slo_quantile, (int, float)) and 0 < slo_quantile < 1):
        raise UserError(f"--slo-quantile must be in (0, 1) (0.99: p99), got {slo_quantile}")
    sparsities = sorted(m.sparsity for m in models)
    if max_sparsity is not None and not (isinstance(max_sparsity, (int, float)) and max_sparsity >= sparsities[0]):
        raise UserError(f"--max-sparsity {max_sparsity} leaves no budget; served: {', '.join(f'{x:g}' for x in sparsities)}")
    return RouterSettings(_default_budget(models, default_sparsity), policy, slo_ms, precision, text, inline,
                          slo_quantile, max_sparsity)


def build_repository(directory: str | Path, *, name: str = DEFAULT_NAME, max_batch: int | None = None,
                     instances: int = DEFAULT_INSTANCES, kind: str = "auto", default_sparsity: float | None = None,
                     queue_delay_us: int = DEFAULT_QUEUE_DELAY_US, precision: str = "fp32", dense: bool = True,
                     platform: str = "auto", policy: str | None = None, slo_ms: float | None = None,
                     slo_quantile: float | None = None, max_sparsity: float | None = None,
                     ort_threads: int = 0, echo: Callable[[str], None] = lambda s: None) -> Manifest:
    """Write ``DIR/triton/`` (one model per budget + the router) and record it in the manifest.

    Args:
        directory: an artifact directory (with ``manifest.json``).
        name: the router's name and the budget models' prefix.
        max_batch: ``max_batch_size`` of every budget model (default: 128, or the engines' profile
            maximum when engines are served).
        instances: instances of each budget model (per GPU with ``KIND_GPU`` / ``KIND_AUTO`` on a GPU).
        kind: ``auto`` (Triton places each model on the GPUs where there are any, else the CPU),
            ``cpu`` or ``gpu``. Engines always run on the GPU; the router always on the CPU.
        default_sparsity: the budget the router serves when a request names none under ``policy:
            fixed`` (mapped as a request is); default: the densest served model.
        queue_delay_us: the dynamic batcher's ``max_queue_delay_microseconds``.
        precision: ``fp32`` or ``fp16`` (the directory's fp16 ONNX files).
        dense: also serve the dense model (as sparsity 0.0).
        platform: the budget models' backend: ``auto``, ``onnxruntime``, ``python`` or ``tensorrt``
            (see :func:`plan_models`).
        policy: ``adaptive`` or ``fixed`` (default: ``fixed`` when ``default_sparsity`` is given).
        slo_ms: the adaptive policy's latency objective (default: the router's, 250 ms).
        slo_quantile: the latency quantile the SLO bounds (default 0.99).
        max_sparsity: the adaptive policy's quality floor: it never serves a sparser budget.
        ort_threads: onnxruntime intra-op threads of ``python`` budget models (0: its default).
        echo: progress messages.

    Returns:
        The updated manifest (its ``triton`` entry: dir, models, router, default_sparsity, ...).

    Raises:
        UserError: bad directory / options / files; nothing is changed then.
    """
    d = existing_dir(directory)
    manifest = Manifest.load(d)
    _check_options(kind, instances, max_batch, queue_delay_us)
    if isinstance(ort_threads, bool) or not isinstance(ort_threads, int) or ort_threads < 0:
        raise UserError(f"--ort-threads must be a non-negative integer, got {ort_threads}")
    models = plan_models(d, manifest, name=name, precision=precision, dense=dense, platform=platform)
    max_batch = _served_max_batch(manifest, models, kind, max_batch)
    tokenizer = _tokenizer_folder(d, manifest)
    settings = _router_settings(models, default_sparsity, policy, slo_ms, precision, tokenizer is not None,
                                _inline(d, models, echo), slo_quantile, max_sparsity)
    _check_replaceable(d, manifest)
    inputs, outputs = _served_io(d, manifest, models)
    profile = d / LATENCY_PROFILE if (d / LATENCY_PROFILE).is_file() else None
    search = plan_search(manifest, name, tokenizer, outputs, max_batch, [m.sparsity for m in models], echo)
    plan = RepositoryPlan(name, models, settings, inputs, outputs, max_batch, kind, instances, queue_delay_us,
                          precision, ort_threads, profile, tokenizer, int(manifest.tokens or 16), search,
                          index_model(models, name))
    placed = write_repository(d, plan, plan.configs())
    links = sum(v == "link" for v in placed.values())
    found = f" + search {search.name!r} ({search.count} documents)" if search is not None else ""
    lane = f" + indexing lane {plan.index.name!r}" if plan.index is not None else ""
    echo(f"wrote {d / TRITON_DIR}: {len(models)} budget models{lane} ({links} hard links, {len(placed) - links} copies) "
         f"+ router {name!r} (policy {settings.policy}{', text input' if settings.text else ''}){found}")
    manifest.triton = plan.entry()
    write_manifest(d, manifest)
    return manifest
