"""Output comparisons: the one place that says whether an ONNX file computes what it should.

* :func:`compare_outputs` compares a model's outputs with reference outputs: max abs error (the
  fp32 bound, :data:`ATOL`) or relative error (the fp16 / TensorRT bound); a :class:`Comparison`
  with the numbers and a one-line description of what is wrong. The main job checks every file it
  writes with it (:mod:`elastic_export.pipeline`) and ``elastic-export verify`` every file of a
  directory (:mod:`elastic_export.checks.verify`).
* :func:`twin_scores` runs a lower-precision twin (fp16, int8, int8-qdq) next to its fp32 file on
  sets of feeds and scores each set (relative error, embedding cosine): the twins' in-run checks.

Like optimum's ``validate_model_outputs``: the numbers are always computed, the verdict is one
comparison against one tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

ATOL = 1e-4  # fp32: max abs error on the final output against the hard-masked dense model
FP16_RTOL = 1e-2  # fp16: relative error on the final output against its fp32 file
INT8_MIN_COSINE = 0.95  # int8 (dynamic): smallest embedding cosine against its fp32 file
QDQ_MIN_COSINE = 0.95  # int8-qdq (static): the same bound
EMBEDDING_OUTPUTS = ("sentence_embedding", "image_embeds", "pooler_output")


def fmt_error(x: float | None) -> str:
    """An error for a table or a message: ``-`` (not compared), ``inf`` (not finite) or ``1.2e-05``."""
    return "-" if x is None else ("inf" if not math.isfinite(x) else f"{x:.1e}")


def relative_error(want: Sequence[np.ndarray], got: Sequence[np.ndarray], valid: np.ndarray | None = None) -> float:
    """Largest, over the outputs, of ``max |got - want| / max |want|``: the error relative to each
    output's scale (an element-wise ratio would explode on values near zero).

    Args:
        want: reference outputs (fp32).
        got: outputs to check, same order.
        valid: the ``attention_mask`` (batch, sequence) of the inputs, or None. Per-token outputs
            (leading dims batch, sequence) are then compared at real tokens only: a padding
            position's state is undefined (a left-padded causal row attends to no real key, and
            fp32 and fp16 masks round such rows differently), and no pooled output reads it.
    """
    if len(want) != len(got):
        raise ValueError(f"{len(got)} outputs, expected {len(want)}")
    worst = 0.0
    keep = None if valid is None else np.asarray(valid) != 0
    for a, b in zip(want, got):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a64.shape != b64.shape:
            return float("inf")
        if keep is not None and a64.shape[:2] == keep.shape:
            a64, b64 = a64[keep], b64[keep]
        scale = max(float(np.abs(a64).max(initial=0.0)), 1e-12)
        diff = np.abs(a64 - b64)
        if not np.all(np.isfinite(diff)):
            return float("inf")
        worst = max(worst, float(diff.max(initial=0.0)) / scale)
    return worst


def max_abs_error(want: Sequence[np.ndarray], got: Sequence[np.ndarray], dtype: Any = np.float64) -> float:
    """Largest ``|got - want|`` over every element of every output, the difference taken in ``dtype``.

    ``inf`` where the outputs differ in number or shape, or a difference is not finite (NaN is never
    within a tolerance).
    """
    if len(want) != len(got):
        return math.inf
    worst = 0.0
    for a, b in zip(want, got):
        if np.shape(a) != np.shape(b):
            return math.inf
        d = np.abs(np.asarray(a, dtype) - np.asarray(b, dtype))
        if not np.all(np.isfinite(d)):
            return math.inf
        worst = max(worst, float(d.max(initial=0.0)))
    return worst


@dataclass
class Comparison:
    """What :func:`compare_outputs` found.

    Args:
        max_abs: :func:`max_abs_error` (None where the outputs could not be compared).
        rel: :func:`relative_error` (None likewise).
        tol: the tolerance applied, e.g. ``abs 1e-04`` / ``rel 1e-02`` (None when not compared).
        problem: one line saying what is beyond the tolerance; empty when the outputs match.
    """

    max_abs: float | None = None
    rel: float | None = None
    tol: str | None = None
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


def compare_outputs(got: Sequence[np.ndarray], want: Sequence[np.ndarray], atol: float | None = ATOL,
                    rtol: float | None = None, valid: np.ndarray | None = None, dtype: Any = np.float64) -> Comparison:
    """Compare a model's outputs ``got`` with the reference ``want`` (same order).

    Args:
        got: the outputs to check.
        want: the reference outputs.
        atol: bound on the max abs error; None: ``rtol`` bounds the relative error instead.
        rtol: bound on the relative error (used when ``atol`` is None).
        valid: the inputs' ``attention_mask``: the relative error is then taken at real tokens only.
        dtype: the type the differences are taken in (:func:`max_abs_error`).

    Returns:
        The errors and the verdict (:attr:`Comparison.ok`, :attr:`Comparison.problem`).
    """
    if len(got) != len(want):
        return Comparison(problem=f"{len(got)} outputs, expected {len(want)}")
    shapes = [(np.shape(a), np.shape(b)) for a, b in zip(want, got) if np.shape(a) != np.shape(b)]
    if shapes:
        return Comparison(problem=f"output shape {shapes[0][1]}, expected {shapes[0][0]}")
    out = Comparison(max_abs_error(want, got, dtype), relative_error(want, got, valid))
    if atol is not None:
        out.tol = f"abs {atol:.0e}"
        if not out.max_abs <= atol:
            out.problem = f"max abs error {fmt_error(out.max_abs)} > {atol:g}"
    else:
        out.tol = f"rel {rtol:.0e}"
        if not out.rel <= rtol:
            out.problem = f"relative error {fmt_error(out.rel)} > {rtol:g}"
    return out


def twin_scores(directory: str | Path, fp32_name: str, name: str, feeds: Sequence[dict[str, np.ndarray]],
                score: Callable[[Any, Any, dict[str, np.ndarray]], float]) -> Iterator[float]:
    """``score(fp32 session, twin session, feeds)`` for each set of ``feeds``, lazily (a caller may stop
    at the first that fails): the twin ``directory/name`` against its fp32 file ``directory/fp32_name``,
    both in onnxruntime (CPU)."""
    from elastic_export.targets.onnxruntime import cpu_session

    ref, twin = (cpu_session(Path(directory) / f) for f in (fp32_name, name))
    for f in feeds:
        yield score(ref, twin, f)


def embedding(names: Sequence[str], outputs: Sequence[np.ndarray], mask: np.ndarray | None = None) -> np.ndarray:
    """The embedding among a model's outputs: ``sentence_embedding``, else ``image_embeds``, else
    ``pooler_output``, else the mean of ``last_hidden_state`` (weighted by ``mask`` when given),
    else the first output (flattened per row)."""
    out = dict(zip(names, outputs))
    for key in EMBEDDING_OUTPUTS:
        if key in out:
            return np.asarray(out[key], np.float64).reshape(len(out[key]), -1)
    hidden = np.asarray(out.get("last_hidden_state", outputs[0]), np.float64)
    if hidden.ndim == 3:
        w = np.ones(hidden.shape[:2]) if mask is None or np.shape(mask) != hidden.shape[:2] else np.asarray(mask, np.float64)
        return (hidden * w[..., None]).sum(1) / np.maximum(w.sum(1, keepdims=True), 1.0)
    return hidden.reshape(len(hidden), -1)


def min_cosine(want: np.ndarray, got: np.ndarray) -> float:
    """Smallest row-wise cosine between two (rows, dim) arrays."""
    a, b = np.asarray(want, np.float64), np.asarray(got, np.float64)
    num = (a * b).sum(1)
    den = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(np.min(num / den))
