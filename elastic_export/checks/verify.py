"""``elastic-export verify DIR``: re-check every artifact of a directory against the hard-masked dense model.

For users' CI: after copying, converting or rebuilding an artifact directory, check that every file
still computes what the manifest says it does.

* **Reference.** The directory's own ``dense.onnx`` (rank-permuted, fp32) with the pruned units of a
  budget zeroed: every budget keeps a per-layer *prefix* of the units, so for each layer the rows
  (or columns) of the *consumer* weight (attention out-projection, MLP fc2 / down projection)
  beyond ``kept x unit width`` are set to 0, found through the unit map the dense export stored in
  the model (``elastic_export.units``). A zeroed consumer input row is exactly a unit whose output
  is multiplied by 0: the hard-masked dense model of DESIGN.md invariant 2, derived without the
  original weights or a hub, and run in onnxruntime (CPU).
* **What is checked** (each row of the report): the dense model (it loads and runs), every budget's
  fp32 ONNX (max abs error <= ``atol``, 1e-4), the fp16 files where the manifest lists them
  (relative error <= ``rtol_fp16``, 1e-2, see :func:`elastic_export.checks.compare.relative_error`), the int8
  files where it lists them, each against its own fp32 file (min embedding cosine >=
  :data:`elastic_export.checks.compare.INT8_MIN_COSINE`; the int8-qdq files likewise with
  :data:`elastic_export.checks.compare.QDQ_MIN_COSINE`, on these random inputs: verify has no calibration
  data), the single
  elastic graph when the manifest's ``elastic`` is not null (``budget_input``, an int64 index into
  the manifest's budgets, selects each budget in turn, and its ``dense_index`` the dense model,
  checked against dense.onnx; ``atol``), TensorRT engines where
  ``tensorrt`` and a CUDA device are available (``rtol_fp16``; otherwise reported as skipped with
  the reason), and optionally the torch hard-masked model
  (:func:`elastic_export.ranking.reference.hard_mask`) when the model can be loaded (``--model``, or the
  manifest's ``model.source`` when that loads offline and its fingerprint matches).
* **Inputs.** Built from the manifest: random token ids inside the model's vocabulary (read from the
  dense graph's embedding table, clear of the low special ids of real vocabularies), an attention
  mask with padding at the end of every row but the first, zero token types; standard-normal pixels
  at the exported resolution.

Every file is also loaded with ``onnx.checker``. A broken manifest or a missing / unloadable dense
model stops at once (:class:`UserError`); a missing or corrupt artifact is a row with status
``missing`` / ``corrupt``; numbers beyond the tolerance are a row with status ``MISMATCH``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import onnx
from onnx import numpy_helper

from elastic_export.checks.compare import (
    ATOL,
    FP16_RTOL,
    INT8_MIN_COSINE,
    QDQ_MIN_COSINE,
    compare_outputs,
    embedding,
    max_abs_error,
    min_cosine,
)
from elastic_export.checks.compare import fmt_error as _fmt
from elastic_export.core.errors import ERROR_CHARS, UserError, first_line
from elastic_export.core.manifest import MANIFEST, Budget, Elastic, Manifest, TensorSpec, resolve
from elastic_export.core.precisions import FILE_KEYS
from elastic_export.serving.backends import Backend, artifact_backends

OK, MISMATCH, MISSING, CORRUPT, SKIPPED = "ok", "MISMATCH", "missing", "corrupt", "skipped"


@dataclass
class Check:
    """One row of the report.

    Args:
        budget: ``dense`` or the budget's sparsity.
        artifact: the file (relative to the directory), ``[i]`` appended for an elastic-graph index.
        kind: ``fp32``, ``fp16``, ``int8``, ``int8-qdq``, ``elastic``, ``elastic fp16``, ``engine`` or ``torch``.
        reference: what it was compared with.
        max_abs: largest absolute difference over all outputs (None when not compared).
        rel: :func:`relative_error` (None when not compared).
        tol: the tolerance applied, e.g. ``abs 1e-04``.
        status: ok, MISMATCH, missing, corrupt or skipped.
        detail: the reason for anything but ok.
    """

    budget: str
    artifact: str
    kind: str
    reference: str
    max_abs: float | None = None
    rel: float | None = None
    tol: str = "-"
    status: str = OK
    detail: str = ""


@dataclass
class Report:
    """Every check of one directory."""

    directory: Path
    checks: list[Check] = field(default_factory=list)
    inputs: dict[str, tuple] = field(default_factory=dict)  # name -> shape of the sample inputs

    @property
    def problems(self) -> list[Check]:
        """Missing or corrupt files."""
        return [c for c in self.checks if c.status in (MISSING, CORRUPT)]

    @property
    def mismatches(self) -> list[Check]:
        return [c for c in self.checks if c.status == MISMATCH]

    @property
    def ok(self) -> bool:
        return not self.problems and not self.mismatches

    def table(self) -> str:
        """The report as an aligned text table."""
        head = ("budget", "artifact", "kind", "reference", "max abs", "rel", "tolerance", "status")
        rows = [head]
        for c in self.checks:
            status = c.status + (f" ({c.detail})" if c.detail else "")
            rows.append((c.budget, c.artifact, c.kind, c.reference, _fmt(c.max_abs), _fmt(c.rel), c.tol, status))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        return "\n".join("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)

    def summary(self) -> str:
        """One line: what failed, or that everything passed."""
        bad = self.problems or self.mismatches
        if not bad:
            skipped = sum(c.status == SKIPPED for c in self.checks)
            return (f"{self.directory}: all {len(self.checks) - skipped} checks passed"
                    + (f" ({skipped} skipped)" if skipped else ""))
        c = bad[0]
        more = f" (and {len(bad) - 1} more problem{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
        if c.status == MISSING:
            return f"{self.directory}: {c.detail}{more}"
        what = "is corrupt" if c.status == CORRUPT else f"differs from {c.reference}"
        return f"{self.directory}: {c.artifact} ({c.kind}) {what}: {c.detail}{more}"


# --- the reference -------------------------------------------------------------------------------
def masked_dense(dense: onnx.ModelProto, heads: list[int], neurons: list[int]) -> onnx.ModelProto:
    """The dense rank-permuted model with every unit beyond each layer's kept prefix zeroed.

    Args:
        dense: the dense ONNX with its unit map (not modified).
        heads: heads kept per layer (a prefix of the rank-permuted units).
        neurons: neurons kept per layer.

    Returns:
        A copy whose consumer weights (attention out-projection / MLP output projection) are zero on
        the input features of the pruned units: the hard-masked dense model.

    Raises:
        UserError: the unit map is missing or does not fit the counts.
    """
    from elastic_export.core.unit_map import get_units

    try:
        units = get_units(dense)
    except ValueError as e:
        raise UserError(f"corrupt elastic-export unit map in the dense model ({e})")
    if len(heads) != len(units) or len(neurons) != len(units):
        raise UserError(f"a budget lists {len(heads)} / {len(neurons)} layers but the dense model has {len(units)}")
    out = onnx.ModelProto()
    out.CopyFrom(dense)
    inits = {t.name: t for t in out.graph.initializer}
    for i, layer in enumerate(units):
        for kind, keep in (("heads", heads[i]), ("neurons", neurons[i])):
            try:
                group = layer[kind]
                count, width, consumer = int(group["count"]), int(group["width"]), group["consumer"]
                tensor, axis = inits[consumer["weight"]], int(consumer["axis"])
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"corrupt elastic-export unit map in the dense model (layer {i} {kind}: {e!r})")
            if not (isinstance(keep, int) and 0 <= keep <= count):
                raise UserError(f"a budget keeps {keep!r} {kind} in layer {i}, which has {count}")
            if keep == count:
                continue
            w = numpy_helper.to_array(tensor).copy()
            if w.ndim != 2 or w.shape[axis] != count * width:
                raise UserError(f"dense model: {consumer['weight']} has shape {w.shape}, "
                                f"not {count} x {width} units on axis {axis}")
            index = [slice(None)] * 2
            index[axis] = slice(keep * width, None)
            w[tuple(index)] = 0
            tensor.CopyFrom(numpy_helper.from_array(w, tensor.name))
    return out


# --- sample inputs -------------------------------------------------------------------------------
def _vocab_size(dense: onnx.ModelProto) -> int | None:
    """Rows of the embedding table that ``input_ids`` indexes (through Cast / Identity), if found."""
    inits = {t.name: t for t in dense.graph.initializer}
    ids = {"input_ids"}
    for n in dense.graph.node:
        if n.op_type in ("Cast", "Identity") and n.input and n.input[0] in ids:
            ids.update(n.output)
        if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] in ids and n.input[0] in inits:
            dims = list(inits[n.input[0]].dims)
            if len(dims) == 2:
                return int(dims[0])
    return None


def _image_size(spec: TensorSpec, manifest: Manifest) -> tuple[int, int]:
    shape = spec.shape or []
    if len(shape) == 4 and all(isinstance(d, int) and d > 0 for d in shape[2:]):
        return int(shape[2]), int(shape[3])
    size = (manifest.preprocess or {}).get("input_size")
    if isinstance(size, list) and len(size) == 3 and all(isinstance(d, int) for d in size):
        return int(size[1]), int(size[2])
    raise UserError(f"{MANIFEST}: cannot tell the image size of input {spec.name!r} (shape {shape})")


def sample_inputs(manifest: Manifest, dense: onnx.ModelProto, batch: int = 2, seq_len: int | None = None,
                  seed: int = 0) -> dict[str, np.ndarray]:
    """Sample feeds for the manifest's inputs.

    Args:
        manifest: the loaded manifest.
        dense: the dense model (for the vocabulary size).
        batch: batch size (>= 1).
        seq_len: text: tokens per row (default: 32, at most the manifest's ``tokens``).
        seed: random seed.

    Returns:
        name -> array, in the manifest's input order: token ids within the vocabulary, an
        attention mask padded at the end of every row after the first, zero token types, or
        standard-normal pixels.
    """
    if batch < 1:
        raise UserError(f"--batch must be a positive integer, got {batch}")
    tokens = manifest.tokens if isinstance(manifest.tokens, int) and manifest.tokens > 0 else 32
    seq = min(32, tokens) if seq_len is None else seq_len
    if seq < 1:
        raise UserError(f"--seq-len must be a positive integer, got {seq}")
    rng = np.random.default_rng(seed)
    vocab = _vocab_size(dense) or 100
    low = 1000 if vocab > 2000 else min(5, vocab - 1)  # clear of special tokens in real vocabularies
    feeds: dict[str, np.ndarray] = {}
    for spec in manifest.inputs:
        name, dtype = spec.name, spec.dtype
        if name == "pixel_values":
            h, w = _image_size(spec, manifest)
            feeds[name] = rng.standard_normal((batch, 3, h, w)).astype(np.float32)
        elif name == "input_ids":
            feeds[name] = rng.integers(low, vocab, (batch, seq), dtype=np.int64)
        elif name == "attention_mask":
            mask = np.ones((batch, seq), np.int64)
            for b in range(1, batch):
                mask[b, max(1, seq - (b * seq) // (2 * batch)):] = 0
            feeds[name] = mask
        elif dtype in ("int64", "int32"):
            feeds[name] = np.zeros((batch, seq), np.int64 if dtype == "int64" else np.int32)
        else:
            raise UserError(f"{MANIFEST}: input {name!r} ({dtype}) is not one the verifier can make samples for")
    return feeds


# --- running things ------------------------------------------------------------------------------
class _Failed(Exception):
    """A file that is missing or cannot be loaded / run: (status, reason)."""

    def __init__(self, status: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def _session(model: onnx.ModelProto | Path):
    """A CPU session of a file or a model in memory (:func:`elastic_export.targets.onnxruntime.cpu_session`,
    which takes a model over 2 GiB through a scratch file), logging errors only."""
    import onnxruntime as ort

    from elastic_export.targets.onnxruntime import cpu_session

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return cpu_session(model, options=opts)


def _load(path: Path | None, rel: str) -> Path:
    """``path`` checked to exist and pass ``onnx.checker``."""
    if path is None or not path.is_file():
        raise _Failed(MISSING, f"{rel} is listed in the manifest but missing")
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:  # checker raises ValidationError, protobuf DecodeError, OSError, ...
        raise _Failed(CORRUPT, f"onnx.checker: {first_line(e, limit=ERROR_CHARS)}")
    return path


def _open(d: Path, rel: str):
    """An onnxruntime session of the manifest file ``rel``, after :func:`_load`'s checks."""
    path = _load(resolve(d, rel), rel)
    try:
        return _session(path)
    except Exception as e:
        raise _Failed(CORRUPT, f"onnxruntime cannot load it: {first_line(e, limit=ERROR_CHARS)}")


def _run(sess, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    missing = [n for n in names if n not in feeds]
    if missing:
        raise _Failed(CORRUPT, f"needs input {missing[0]!r}, which the manifest does not list")
    have = [o.name for o in sess.get_outputs()]
    if [o for o in outputs if o not in have]:
        raise _Failed(CORRUPT, f"outputs {have} lack the manifest's {[o for o in outputs if o not in have]}")
    try:
        return sess.run(outputs, {n: feeds[n] for n in names})
    except Exception as e:  # onnxruntime raises its own exception types
        raise _Failed(CORRUPT, f"onnxruntime: {first_line(e, limit=ERROR_CHARS)}")


def _compare(check: Check, want: list[np.ndarray], got: list[np.ndarray], atol: float | None,
             rtol: float | None, valid: np.ndarray | None = None) -> Check:
    """Fill ``check`` with the errors of ``got`` against ``want`` and the verdict
    (:func:`elastic_export.checks.compare.compare_outputs`: the relative error, which ``rtol`` bounds, at
    real tokens only where ``valid`` is the attention mask)."""
    result = compare_outputs(got, want, atol, rtol, valid)
    check.max_abs, check.rel, check.tol = result.max_abs, result.rel, result.tol or check.tol
    if not result.ok:
        check.status, check.detail = MISMATCH, result.problem
    return check


def _guard(check: Check, fn: Callable[[], Check]) -> Check:
    try:
        return fn()
    except _Failed as e:
        check.status, check.detail = e.status, e.reason
        return check


# --- files a backend runs itself (TensorRT engines) -----------------------------------------------
def run_backend_file(backend: Backend, path: Path, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    """Run one file of ``backend``'s own kind once (:meth:`Backend.run_file`; e.g. an engine).

    Raises:
        _Failed: it does not load or lacks an output (CORRUPT), or the backend fails on it.
    """
    try:
        got = backend.run_file(path, feeds, outputs)
    except UserError as e:
        raise _Failed(CORRUPT, str(e))
    except Exception as e:  # the backend's own (TensorRT / CUDA) errors
        raise _Failed(CORRUPT, f"{backend.name}: {first_line(e, limit=ERROR_CHARS)}")
    return [np.asarray(a, dtype=np.float32) for a in got]


# --- torch ---------------------------------------------------------------------------------------
def _torch_reference(manifest: Manifest, directory: Path, model: str | None, tower: str | None, seq_len: int,
                     budgets: list[Budget]) -> tuple[Callable | None, str]:
    """(function budget-index-or-None -> outputs, description), or (None, why not)."""
    try:
        import torch
    except ImportError:
        if model is not None:
            raise UserError("--model needs torch (pip install torch); or pass --no-torch")
        return None, "torch is not installed here (the ONNX checks need no torch)"
    from elastic_export.models import hub
    from elastic_export.models.adapters import HEADS, NEURONS
    from elastic_export.models.loader import load_encoder
    from elastic_export.ranking.file import load_ranking
    from elastic_export.ranking.reference import hard_mask

    source = model if model is not None else manifest.model.source
    if not isinstance(source, str) or not source:
        return None, "the manifest names no model source"
    explicit = model is not None
    try:
        image = next((i for i in manifest.inputs if i.name == "pixel_values"), None)
        size = _image_size(image, manifest)[0] if image else None
        pinned = not explicit and manifest.model.revision is not None  # hub weights: the snapshot they came from
        revision = manifest.model.revision if pinned and hub.names_revision(source) else None
        enc = load_encoder(source, revision=revision, pretrained=pinned, seq_len=max(seq_len, 1),
                           image_size=size if image and not Path(source).is_dir() else None,
                           tower=tower or manifest.model.tower)
    except Exception as e:  # UserError, or whatever a broken model directory raises
        if explicit:
            raise UserError(f"--model {source}: cannot load it ({first_line(e, limit=ERROR_CHARS)})")
        return None, f"model.source {source!r} does not load here ({first_line(e, limit=ERROR_CHARS)}); pass --model"
    if enc.fingerprint() != manifest.model.fingerprint:
        msg = f"{source}: not the model these artifacts were made from (fingerprint differs)"
        if explicit:
            raise UserError(f"--model {msg}")
        return None, msg
    rk_path = resolve(directory, manifest.ranking.file)
    if rk_path is None or not rk_path.is_file():
        raise UserError(f"{directory}: the ranking file {manifest.ranking.file!r} is missing")
    ranking = load_ranking(rk_path)
    names = [s.name for s in enc.input_specs()]

    def run(index: int | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        blocks = enc.blocks()
        keep = {}
        for b in blocks:
            for kind, counts in ((HEADS, "heads_per_layer"), (NEURONS, "neurons_per_layer")):
                order = ranking.order(kind, b.index)
                keep[(b.index, kind)] = order if index is None else order[:getattr(budgets[index], counts)[b.index]]
        with torch.no_grad(), hard_mask(blocks, keep):
            out = enc.export_module()(*(torch.from_numpy(feeds[n]) for n in names))
        return [t.numpy() for t in out]

    return run, f"torch {Path(source).name or source}"


# --- the command ---------------------------------------------------------------------------------
def _check_budgets(manifest: Manifest, path: Path) -> list[Budget]:
    """The budgets, each with the kept counts verify masks by (:meth:`Manifest.load` has checked their
    types, sparsity and files; it allows the counts to be absent)."""
    budgets = manifest.budgets
    for i, b in enumerate(budgets):
        for key in ("heads_per_layer", "neurons_per_layer"):
            if getattr(b, key) is None:
                raise UserError(f"{path}: budget {i} has no valid {key!r} (a list of integers)")
    return budgets


def verify_dir(directory: str | Path, *, batch: int = 2, seq_len: int | None = None, seed: int = 0,
               model: str | None = None, tower: str | None = None, use_torch: bool = True, atol: float = ATOL,
               rtol_fp16: float = FP16_RTOL, echo: Callable[[str], None] = lambda s: None) -> Report:
    """Check every artifact of ``directory`` against the hard-masked dense model.

    Args:
        directory: an artifact directory (with ``manifest.json``).
        batch: sample batch size.
        seq_len: text: tokens per sample (default min(32, manifest tokens)).
        seed: seed of the sample inputs.
        model: the original model (path or timm name) for the torch check; None: the manifest's
            ``model.source`` when it loads offline and matches (otherwise that row is skipped).
        tower: the tower of a dual-encoder ``model`` (default: the manifest's ``model.tower``).
        use_torch: False skips the torch check.
        atol: fp32 tolerance (max abs error).
        rtol_fp16: fp16 / TensorRT tolerance (relative error).
        echo: progress messages.

    Returns:
        The report; :attr:`Report.ok` says whether everything passed.

    Raises:
        UserError: no such directory, a broken manifest, or a missing / unloadable dense model.
    """
    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{directory}: no such directory" if not d.exists() else f"{directory}: not a directory")
    manifest = Manifest.load(d)
    budgets = _check_budgets(manifest, d / MANIFEST)
    outputs = [o.name for o in manifest.outputs]
    report = Report(d)
    dense_rel, dense, dense_sess = _open_dense(d, manifest)
    feeds = sample_inputs(manifest, dense, batch=batch, seq_len=seq_len, seed=seed)
    report.inputs = {k: tuple(v.shape) for k, v in feeds.items()}
    try:
        dense_out = _run(dense_sess, feeds, outputs)
    except _Failed as e:
        raise UserError(f"{d}: the dense model {dense_rel} does not run ({e.reason})")
    report.checks.append(Check("dense", dense_rel, "fp32", "(reference)", detail=""))
    echo(f"reference: {dense_rel}, inputs {report.inputs}")
    refs = _masked_references(d, dense, budgets, feeds, outputs)
    _check_files(report, manifest, dense_rel, budgets, dense_out, refs, feeds, outputs, atol, rtol_fp16)
    echo(f"checked {len(budgets)} budgets")
    elastic = manifest.elastic
    if elastic is not None:
        _check_elastic(report, d, elastic, budgets, [*refs, dense_out], feeds, outputs, atol, rtol_fp16)
    labelled = [("dense", manifest.dense), *((f"{b.sparsity:.2f}", b) for b in budgets)]
    _check_engines(report, d, labelled, [dense_out, *refs], feeds, outputs, rtol_fp16)
    if use_torch:
        _check_torch(report, d, manifest, (model, tower), feeds, budgets, dense_out, refs, outputs, atol, seq_len)
    return report


def _open_dense(d: Path, manifest: Manifest) -> tuple[str, onnx.ModelProto, Any]:
    """The manifest's dense file: (its name, the model, an onnxruntime session of it).

    Raises:
        UserError: it is not listed, missing, corrupt or does not load: nothing can be checked.
    """
    dense_rel = manifest.dense.onnx
    if not isinstance(dense_rel, str):
        raise UserError(f"{d / MANIFEST}: 'dense' has no {FILE_KEYS['fp32']!r} file")
    try:
        dense_path = _load(resolve(d, dense_rel), dense_rel)
        return dense_rel, onnx.load(str(dense_path)), _session(dense_path)
    except _Failed as e:
        raise UserError(f"{d}: the dense model {dense_rel} is {e.status}: {e.reason}")
    except Exception as e:  # onnx / onnxruntime load errors
        raise UserError(f"{d}: the dense model {dense_rel} does not load ({first_line(e, limit=ERROR_CHARS)})")


def _masked_references(d: Path, dense: onnx.ModelProto, budgets: list[Budget], feeds: dict[str, np.ndarray],
                       outputs: list[str]) -> list[list[np.ndarray]]:
    """Each budget's reference outputs: its masked dense model's (:func:`masked_dense`).

    Raises:
        UserError: one of them does not run.
    """
    refs: list[list[np.ndarray]] = []
    for b in budgets:
        sess = _session(masked_dense(dense, b.heads_per_layer, b.neurons_per_layer))
        try:
            refs.append(_run(sess, feeds, outputs))
        except _Failed as e:
            raise UserError(f"{d}: the masked dense model of budget {b.sparsity} does not run ({e.reason})")
    return refs


def _check_files(report: Report, manifest: Manifest, dense_rel: str, budgets: list[Budget], dense_out: list, refs: list,
                 feeds: dict, outputs: list[str], atol: float, rtol_fp16: float) -> None:
    """One row per per-budget file and twin: fp32 and fp16 against the (masked) dense model, int8 and
    int8-qdq against their own fp32 file."""
    d = report.directory
    mask = feeds.get("attention_mask")

    def onnx_check(label: str, rel: Any, kind: str, want: list[np.ndarray], ref: str) -> None:
        check = Check(label, str(rel), kind, ref)

        def go() -> Check:
            if not isinstance(rel, str):
                raise _Failed(CORRUPT, f"manifest entry {rel!r} is not a file name")
            got = _run(_open(d, rel), feeds, outputs)
            return _compare(check, want, got, atol if kind == "fp32" else None, rtol_fp16, mask)

        report.checks.append(_guard(check, go))

    fp16_dense = manifest.dense.onnx_fp16
    if fp16_dense is not None:
        onnx_check("dense", fp16_dense, "fp16", dense_out, dense_rel)
    for b, ref in zip(budgets, refs):
        label = f"{b.sparsity:.2f}"
        onnx_check(label, b.onnx, "fp32", ref, "masked dense")
        if b.onnx_fp16 is not None:
            onnx_check(label, b.onnx_fp16, "fp16", ref, "masked dense")
    for label, entry in [("dense", manifest.dense), *((f"{b.sparsity:.2f}", b) for b in budgets)]:
        for kind, bound in (("int8", INT8_MIN_COSINE), ("int8-qdq", QDQ_MIN_COSINE)):
            if entry.file(kind) is not None:
                report.checks.append(_check_int8(d, label, entry.onnx, entry.file(kind), feeds, outputs, bound, kind))


def _check_int8(d: Path, label: str, fp32_rel: str, int8_rel: Any, feeds: dict, outputs: list[str],
                bound: float = INT8_MIN_COSINE, kind: str = "int8") -> Check:
    """One row: the int8 (or ``int8-qdq``, ``kind``) file against its own fp32 file, min embedding
    cosine >= ``bound`` (:func:`elastic_export.checks.compare.embedding`)."""
    check = Check(label, str(int8_rel), kind, fp32_rel, tol=f"cos >= {bound:g}")

    def go() -> Check:
        if not isinstance(int8_rel, str):
            raise _Failed(CORRUPT, f"manifest entry {int8_rel!r} is not a file name")
        want = _run(_open(d, fp32_rel), feeds, outputs)
        got = _run(_open(d, int8_rel), feeds, outputs)
        mask = feeds.get("attention_mask")
        check.max_abs = max_abs_error(want, got)
        cos = min_cosine(embedding(outputs, want, mask), embedding(outputs, got, mask))
        check.detail = f"min cosine {cos:.4f}"
        if not cos >= bound:
            check.status, check.detail = MISMATCH, f"min embedding cosine {cos:.4f} < {bound:g}"
        return check

    return _guard(check, go)


def _check_elastic(report: Report, d: Path, elastic: Elastic, budgets: list[Budget], refs: list, feeds: dict,
                   outputs: list[str], atol: float, rtol_fp16: float = FP16_RTOL) -> None:
    """One row per index of the elastic graph (and of its fp16 twin where the manifest lists one),
    selected by its ``budget_input``: every budget against its masked dense model (``refs[i]``)
    and, where the manifest lists a ``dense_index``, the dense model against dense.onnx
    (``refs[-1]``)."""
    index_name = elastic.budget_input
    files = [(FILE_KEYS["fp32"], elastic.onnx, "elastic", atol, None)]
    if elastic.onnx_fp16 is not None:
        files.append((FILE_KEYS["fp16"], elastic.onnx_fp16, "elastic fp16", None, rtol_fp16))
    for key, rel, kind, file_atol, file_rtol in files:
        base = Check("all", str(rel), kind, "masked dense")
        try:
            if not isinstance(rel, str) or not isinstance(index_name, str):
                raise _Failed(CORRUPT, f"manifest 'elastic' needs '{key}' and 'budget_input' strings")
            sess = _open(d, rel)
            spec = next((i for i in sess.get_inputs() if i.name == index_name), None)
            if spec is None:
                raise _Failed(CORRUPT, f"has no input {index_name!r} (the manifest's budget_input)")
            listed = elastic.budgets
            if listed is not None and listed != [b.sparsity for b in budgets]:
                raise _Failed(CORRUPT, f"its budgets {listed} are not the manifest's, in the manifest's order")
            try:
                indices = elastic.indices([b.sparsity for b in budgets])
            except UserError as e:
                raise _Failed(CORRUPT, str(e))
        except _Failed as e:
            base.status, base.detail = e.status, e.reason
            report.checks.append(base)
            continue
        shape = () if not spec.shape else (1,) * len(spec.shape)
        labels = [f"{b.sparsity:.2f}" for b in budgets] + ["dense"]
        for n, (_, i) in enumerate(indices):
            dense = n == len(budgets)
            check = Check(labels[n], f"{rel}[{i}]", kind, "dense" if dense else "masked dense")
            index = np.full(shape, i, np.int64)
            report.checks.append(_guard(check, lambda check=check, ref=refs[-1 if dense else n], index=index, sess=sess:
                                        _compare(check, ref, _run(sess, {**feeds, index_name: index}, outputs),
                                                 file_atol, file_rtol, feeds.get("attention_mask"))))


def _check_engines(report: Report, d: Path, budgets: list[tuple[str, Any]], refs: list, feeds: dict,
                   outputs: list[str], rtol: float) -> None:
    """One row per file of a backend's own kind the manifest lists (:func:`artifact_backends`: the
    TensorRT engines), skipped with the reason where that backend cannot run here.

    Args:
        budgets: (label, manifest entry) of the dense model and every budget, as ``refs``.
    """
    for entry in artifact_backends():
        backend, why = None, None
        for (label, b), ref in zip(budgets, refs):
            rel = getattr(b, entry.artifact, None) or b.extra.get(entry.artifact)  # a field, or one this version does not know
            if rel is None:
                continue
            check = Check(label, str(rel), entry.artifact, "dense" if label == "dense" else "masked dense",
                          tol=f"rel {rtol:.0e}")
            path = resolve(d, rel) if isinstance(rel, str) else None
            if path is None or not path.is_file():
                check.status, check.detail = MISSING, f"{rel} is listed in the manifest but missing"
                report.checks.append(check)
                continue
            backend = backend or entry.load()
            why = why or backend.unavailable()
            if why:
                check.status, check.detail = SKIPPED, why
                report.checks.append(check)
                continue
            report.checks.append(_guard(check, lambda check=check, path=path, ref=ref, be=backend: _compare(
                check, ref, run_backend_file(be, path, feeds, outputs), None, rtol, feeds.get("attention_mask"))))


def _check_torch(report: Report, d: Path, manifest: Manifest, model: tuple[str | None, str | None], feeds: dict,
                 budgets: list[Budget], dense_out: list, refs: list, outputs: list[str], atol: float,
                 seq_len: int | None) -> None:
    """Compare the reference (dense and every masked dense model) with the torch hard-masked model
    (``model``: the ``--model`` and ``--tower`` given, or Nones for the manifest's)."""
    seq = next((v.shape[1] for k, v in feeds.items() if k == "input_ids"), None)
    fn, what = _torch_reference(manifest, d, *model, seq or seq_len or 32, budgets)
    if fn is None:
        report.checks.append(Check("all", "-", "torch", "-", status=SKIPPED, detail=what))
        return
    entries = [("dense", None, dense_out, manifest.dense.onnx)]
    masked = f"{manifest.dense.onnx} (masked)"
    entries += [(f"{b.sparsity:.2f}", i, ref, masked) for i, (b, ref) in enumerate(zip(budgets, refs))]
    for label, index, want, name in entries:
        check = Check(label, name, "torch", what)
        got = fn(index, feeds)
        if len(got) != len(want):
            check.status, check.detail = MISMATCH, f"torch gives {len(got)} outputs, the ONNX {len(want)}"
            report.checks.append(check)
            continue
        report.checks.append(_compare(check, got, want, atol, None))
