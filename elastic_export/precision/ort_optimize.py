"""Optional onnxruntime-optimised copies of the exported graphs (``budget_sXXX.opt.onnx``).

Every budget graph is a plain ONNX graph (opset 17) that any runtime can read. onnxruntime runs it
faster when its operators are fused into onnxruntime's own contrib operators (``com.microsoft``
domain): ``Attention`` (q/k/v projections, scaled dot product, softmax, mask in one kernel),
``SkipLayerNormalization`` (residual add + bias + LayerNorm), ``BiasGelu`` / ``FastGelu`` and
``EmbedLayerNormalization``. Those fusions are done by onnxruntime's *transformer optimizer*
(``onnxruntime.transformers.optimizer.optimize_model``, pure Python, no session needed), not by
the session's own graph optimiser: at ``ORT_ENABLE_EXTENDED``/``ALL`` onnxruntime fuses Gelu,
BiasGelu, FusedMatMul and some SkipLayerNormalizations, but never the attention of these graphs.

Pruned graphs and the fusion:

* The transformer optimizer reads each layer's head count from the constant shape of the q
  Reshape (``[0, 0, k, d]``). The pass ``fix-head-reshapes`` writes exactly that, so attention is
  fused in *every* layer of a sliced BERT-family graph, each with its own head count (onnxruntime's
  ``Attention`` takes the pruned hidden size ``k·d`` from the weight shape; its warning "Input
  hidden size (k·d) is not same as weight matrix dimension of q,k,v (D)" is expected for pruned
  models and is silenced here).
* The *dense* export reshapes to ``[B, N, -1, d]`` (shape arithmetic, no head count), so the
  optimizer cannot detect the heads and fuses no attention there unless told: this module passes
  the head count from the unit map when every layer has the same one (dense, or a budget whose
  layers all keep the same number of heads), and 0 (= read it from the reshapes) otherwise.
* A layer that keeps 0 heads has no attention left to fuse; one that keeps 0 neurons has no Gelu.
* The optimizer's default mask format for ``bert`` (``MaskIndexEnd``: one end position per
  sequence) is only right for right-padded batches; this module uses the raw 2-D attention mask,
  which is exact for any mask (left padding, holes).
* Vision encoders get SkipLayerNormalization and BiasGelu fusions but no Attention (onnxruntime
  1.32): timm ViTs have one fused qkv MatMul + Split and export ``scaled_dot_product_attention``
  without a mask; Hugging Face ViT / DINOv2 (eager) scale the scores with a Mul and have no mask
  Add before the Softmax. Neither matches onnxruntime's attention patterns, dense or sliced.
  BERT, MiniLM and RoBERTa (eager, as the loader loads them) fuse in every layer.

Every optimised file is checked against its source graph in onnxruntime (max abs error, default
1e-4) before it is kept. The fallback (``method="ort"``) saves what an onnxruntime CPU session
produces at ``ORT_ENABLE_EXTENDED`` (``SessionOptions.optimized_model_filepath``); that file holds
CPU-EP specific fused nodes and is meant for the CPU execution provider.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import onnx

from elastic_export.core import onnx_io
from elastic_export.core.errors import UserError, first_line
from elastic_export.core.manifest import OPTIMIZED_FIELD

OPT_SUFFIX = ".opt.onnx"
EXTERNAL_REFUSAL = ("{src}: onnxruntime-optimised copies of models with external data (weights in a .onnx.data "
                    "file) are not supported yet; drop --ort-optimize")
MANIFEST_KEY = OPTIMIZED_FIELD  # the manifest field of each optimised copy
METHODS = ("auto", "transformers", "ort")
FUSED_OPS = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization",
             "BiasGelu", "FastGelu", "Gelu", "FusedMatMul", "LayerNormalization")
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class OptimizeResult:
    """What :func:`optimize_onnx` wrote.

    Args:
        path: the optimised ONNX file.
        method: ``transformers`` (onnxruntime transformer optimizer) or ``ort`` (session optimiser
            at ``ORT_ENABLE_EXTENDED``).
        model_type: optimizer model type used (``bert`` / ``vit``), or None for ``ort``.
        num_heads: head count passed to the optimizer (0 = detected per layer from the reshapes).
        fused: count of every fused / contrib operator in the result (see :data:`FUSED_OPS`).
        nodes_before: node count of the source graph.
        nodes_after: node count of the optimised graph.
        max_abs_error: largest difference to the source graph in onnxruntime, or None if not verified.
        notes: why a fallback was taken, and similar remarks.
    """

    path: str
    method: str
    model_type: str | None
    num_heads: int
    fused: dict[str, int]
    nodes_before: int
    nodes_after: int
    max_abs_error: float | None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        """The result as plain JSON (for a manifest or a report)."""
        return asdict(self)


def optimized_name(onnx_name: str) -> str:
    """``budget_s030.onnx`` -> ``budget_s030.opt.onnx``."""
    stem = onnx_name[: -len(".onnx")] if onnx_name.endswith(".onnx") else onnx_name
    return stem + OPT_SUFFIX


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the transformer optimizer's INFO/WARNING logging (restores the previous state)."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(previous)


def _op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _modality(model: onnx.ModelProto) -> str:
    names = {i.name for i in model.graph.input}
    if "input_ids" in names:
        return "text"
    if "pixel_values" in names:
        return "image"
    raise UserError(f"cannot tell the model type from the inputs {sorted(names)} (expected input_ids or pixel_values)")


def uniform_heads(model: onnx.ModelProto) -> tuple[int, int]:
    """(num_heads, hidden_size) to give the optimizer: the common head count of every layer that
    keeps heads, or (0, 0) when layers differ (the optimizer then reads each layer's reshapes).

    Args:
        model: an elastic-export ONNX model (dense or budget) with its unit map.
    """
    from elastic_export.core.unit_map import get_units

    try:
        units = get_units(model)
    except UserError:
        return 0, 0
    counts = {(L["heads"]["count"], L["heads"]["width"]) for L in units if L["heads"]["count"] > 0}
    if len(counts) != 1:
        return 0, 0
    k, d = counts.pop()
    return int(k), int(k * d)


def sample_feeds(model: onnx.ModelProto, batch: int = 3, seq_len: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for checking an optimised graph against its source.

    Text: token ids in [1, 100) (valid for every vocabulary), an attention mask whose rows are
    full, right-padded and left-padded (a fusion that assumes right padding shows up here),
    token types 0. Images: standard normal pixels at the graph's fixed size.

    Args:
        model: the source graph.
        batch: batch size (at least 3 for text, so that every mask kind is present).
        seq_len: length of a symbolic sequence axis.
        seed: random seed.
    """
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for inp in model.graph.input:
        t = inp.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if inp.name in _TEXT_INPUTS:
            shape = (batch, dims[1] or seq_len)
            if inp.name == "input_ids":
                v = rng.integers(1, 100, size=shape)
            elif inp.name == "attention_mask":
                v = np.ones(shape)
                n = shape[1]
                if batch > 1:
                    v[1, max(1, n * 2 // 3):] = 0
                if batch > 2:
                    v[2, : n // 4] = 0
            else:
                v = np.zeros(shape)
            feeds[inp.name] = v.astype(np.int64 if t.elem_type == onnx.TensorProto.INT64 else np.int32)
        else:
            shape = [batch if i == 0 else (d if d else seq_len) for i, d in enumerate(dims)]
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(path: str | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from elastic_export.targets.onnxruntime import cpu_session

    return cpu_session(path).run(None, feeds)  # every file takes the same feeds (_keep_interface)


def _max_error(src: str | Path, dst: str | Path, feeds: dict[str, np.ndarray]) -> float:
    """:func:`elastic_export.checks.compare.max_abs_error` of ``dst`` against ``src`` (inf where outputs differ in number)."""
    from elastic_export.checks.compare import max_abs_error

    return max_abs_error(_run(src, feeds), _run(dst, feeds))


def _transformers(src: Path, dst: Path, modality: str, num_heads: int,
                  hidden_size: int) -> tuple[str, onnx.ModelProto]:
    from onnxruntime.transformers.fusion_options import AttentionMaskFormat, FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model_type = "bert" if modality == "text" else "vit"
    options = FusionOptions(model_type)
    if modality == "text":
        # the default (MaskIndexEnd) is only right for right padding; the raw mask is exact always
        options.attention_mask_format = AttentionMaskFormat.AttentionMask
    with _quiet():
        # opt_level 0: only the Python fusions, no hardware-specific onnxruntime rewrites, so the
        # file stays valid for any execution provider that has the com.microsoft operators.
        opt = optimize_model(str(src), model_type=model_type, num_heads=num_heads, hidden_size=hidden_size,
                             optimization_options=options, opt_level=0)
        _keep_interface(opt.model, onnx.load(str(src), load_external_data=False))
        opt.save_model_to_file(str(dst), use_external_data_format=False)
    return model_type, opt.model


def _keep_interface(model: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Put back the graph inputs the optimizer pruned (e.g. ``attention_mask`` of a budget that
    keeps no head), in the source's order: every file of an artifact set takes the same feeds."""
    have = {i.name: i for i in model.graph.input}
    if [i.name for i in source.graph.input] == list(have):
        return
    wanted = [have.get(i.name, i) for i in source.graph.input] + [
        i for name, i in have.items() if name not in {j.name for j in source.graph.input}]
    copies = [onnx.ValueInfoProto.FromString(i.SerializeToString()) for i in wanted]
    del model.graph.input[:]
    model.graph.input.extend(copies)


def _ort_extended(src: Path, dst: Path) -> onnx.ModelProto:
    import onnxruntime as ort

    from elastic_export.targets.onnxruntime import cpu_session

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(dst)
    cpu_session(src, options=so)
    return onnx.load(str(dst), load_external_data=False)


def _optimize_with(method: str, src: Path, dst: Path, modality: str, heads: int,
                   hidden: int) -> tuple[str | None, onnx.ModelProto]:
    """Write ``src`` optimised by ``method`` (``transformers`` or ``ort``) to ``dst``: (model type, the result)."""
    if method == "transformers":
        return _transformers(src, dst, modality, heads, hidden)
    return None, _ort_extended(src, dst)


def _open_source(src: str | Path, dst: str | Path | None, method: str) -> tuple[Path, Path, onnx.ModelProto]:
    """(source, destination, the source's graph without its weights), refusing what cannot be optimised."""
    if method not in METHODS:
        raise UserError(f"optimize method {method!r}: choose from {', '.join(METHODS)}")
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_name(optimized_name(src.name))
    if dst.resolve() == src.resolve():
        raise UserError(f"{src}: the optimised model must not overwrite its source")
    if len(onnx_io.files(src)) > 1:
        raise UserError(EXTERNAL_REFUSAL.format(src=src.name))
    try:
        return src, dst, onnx.load(str(src), load_external_data=False)
    except Exception as e:  # protobuf / IO errors
        raise UserError(f"{src}: not a readable ONNX file ({first_line(e)})")


def optimize_onnx(src: str | Path, dst: str | Path | None = None, *, method: str = "auto",
                  detect_heads: bool = False, verify: bool = True, atol: float = 1e-4,
                  feeds: dict[str, np.ndarray] | None = None) -> OptimizeResult:
    """Write an onnxruntime-optimised copy of one exported graph and check it.

    Args:
        src: an elastic-export ONNX file (``dense.onnx`` or ``budget_sXXX.onnx``).
        dst: where to write it; default ``src`` with ``.opt.onnx``. Written atomically.
        method: ``transformers`` (onnxruntime transformer optimizer: Attention,
            SkipLayerNormalization, BiasGelu, EmbedLayerNormalization fusions; portable across
            execution providers that implement the com.microsoft operators), ``ort`` (what a CPU
            session saves at ``ORT_ENABLE_EXTENDED``), or ``auto``: ``transformers``, falling back
            to ``ort`` when it raises or does not match the source.
        detect_heads: give the optimizer no head count even where every layer has the same one
            (it then reads each layer's from its reshapes, which only a sliced graph has);
            default: the common head count from the unit map (see :func:`uniform_heads`).
        verify: compare the result with ``src`` in onnxruntime (CPU) and refuse it above ``atol``.
        atol: largest accepted max abs difference (fp32).
        feeds: inputs for the check; default :func:`sample_feeds`.

    Returns:
        What was written (method, fused operator counts, error).

    Raises:
        UserError: unknown method, unreadable source, or no method gives a graph within ``atol``.
    """
    from elastic_export.core.fileio import atomic_write

    src, dst, model = _open_source(src, dst, method)
    modality = _modality(model)
    heads, hidden = (0, 0) if detect_heads else uniform_heads(model)
    if feeds is None and verify:
        feeds = sample_feeds(model)
    before = len(model.graph.node)
    notes: list[str] = []
    order = {"auto": ("transformers", "ort"), "transformers": ("transformers",), "ort": ("ort",)}[method]
    found: list[OptimizeResult] = []

    def write(tmp: str) -> None:
        for m in order:
            try:
                model_type, out = _optimize_with(m, src, Path(tmp), modality, heads, hidden)
            except Exception as e:  # the optimizer raises many types on patterns it does not know
                notes.append(f"{m}: failed ({type(e).__name__}: {first_line(e)})")
                continue
            err = _max_error(src, tmp, feeds) if verify else None
            if err is not None and not err <= atol:
                notes.append(f"{m}: differs from the source by {err:.2e} (> {atol:g}); not used")
                continue
            counts = _op_counts(out)
            found.append(OptimizeResult(str(dst), m, model_type, heads if m == "transformers" else 0,
                                        {op: counts[op] for op in FUSED_OPS if counts.get(op)},
                                        before, len(out.graph.node), err, notes))
            return
        raise UserError(f"{src}: no onnxruntime optimisation gave a matching graph ({'; '.join(notes)})")

    atomic_write(dst, write)
    return found[0]


def optimize_artifacts(directory: str | Path, *, method: str = "auto", include_dense: bool = True,
                       verify: bool = True, atol: float = 1e-4, update_manifest: bool = False,
                       echo: Callable[[str], None] = print) -> dict[str, OptimizeResult]:
    """Optimise the dense model and every budget of an artifact directory.

    Writes ``dense.opt.onnx`` and ``budget_sXXX.opt.onnx`` next to the originals.

    Args:
        directory: an artifact directory (``manifest.json``).
        method: see :func:`optimize_onnx`.
        include_dense: also optimise ``dense.onnx``.
        verify: check every optimised graph against its source.
        atol: largest accepted max abs difference.
        update_manifest: add ``"onnx_optimized": "<file>"`` to the dense entry and to every budget
            entry of the manifest (and an ``ort_optimize`` entry with the method and fusions).
        echo: progress lines.

    Returns:
        ``{source onnx name: result}``.
    """
    from elastic_export.core.manifest import Manifest

    directory = Path(directory)
    manifest = Manifest.load(directory)
    entries = ([manifest.dense] if include_dense else []) + list(manifest.budgets)
    results: dict[str, OptimizeResult] = {}
    for entry in entries:
        src = manifest.path(entry.onnx)
        if src is None or not src.is_file():
            raise UserError(f"{directory}: {entry.onnx} is listed in the manifest but missing")
        name = optimized_name(entry.onnx)
        res = optimize_onnx(src, directory / name, method=method, verify=verify, atol=atol)
        results[entry.onnx] = res
        fused = ", ".join(f"{k} {v}" for k, v in res.fused.items())
        err = f", max abs error {res.max_abs_error:.1e}" if res.max_abs_error is not None else ""
        echo(f"{entry.onnx} -> {name} ({res.method}: {fused or 'nothing fused'}{err})")
        if update_manifest:
            entry.onnx_optimized = name
    if update_manifest:
        import onnxruntime

        manifest.ort_optimize = {
            "onnxruntime": onnxruntime.__version__,
            "models": {src: {"onnx": Path(r.path).name, "method": r.method, "model_type": r.model_type,
                             "fused": r.fused, "max_abs_error": r.max_abs_error} for src, r in results.items()},
        }
        manifest.write(directory)
    return results
