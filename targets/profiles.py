"""Optimisation profiles: the min / opt / max shape of every model input, from a manifest.

One :class:`Profile` serves both TensorRT paths: ``build --target tensorrt`` sets it on the builder
(``IOptimizationProfile.set_shape``), and onnxruntime's TensorRT execution provider gets it as
``trt_profile_{min,opt,max}_shapes`` (:meth:`Profile.ort_tensorrt_options`). No TensorRT import here.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, Manifest

DEFAULT_MIN_BATCH, DEFAULT_OPT_BATCH, DEFAULT_MAX_BATCH = 1, 32, 128
TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Profile:
    """min / opt / max shape of every input of one optimisation profile."""

    shapes: dict[str, tuple[Shape, Shape, Shape]]

    def to_json(self) -> dict[str, dict[str, list[int]]]:
        return {k: {"min": list(a), "opt": list(b), "max": list(c)} for k, (a, b, c) in self.shapes.items()}

    def with_input(self, name: str, shape: Shape) -> "Profile":
        """This profile plus a fixed-shape input (e.g. the elastic graph's ``budget_index``, ``(1,)``)."""
        return Profile({**self.shapes, name: (tuple(shape), tuple(shape), tuple(shape))})

    def ort_tensorrt_options(self) -> dict[str, str]:
        """onnxruntime's TensorRT EP options for this profile (``trt_profile_{min,opt,max}_shapes``,
        ``name:1x128,name2:1x128``), so the EP builds one engine for the whole range instead of
        rebuilding whenever a larger shape arrives."""
        out = {}
        for i, which in enumerate(("min", "opt", "max")):
            out[f"trt_profile_{which}_shapes"] = ",".join(
                f"{name}:{'x'.join(str(v) for v in dims[i])}" for name, dims in self.shapes.items())
        return out


def _check_range(what: str, lo: int, mid: int, hi: int) -> None:
    for v in (lo, mid, hi):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UserError(f"{what}: min / opt / max must be positive integers, got {lo} / {mid} / {hi}")
    if not lo <= mid <= hi:
        raise UserError(f"{what}: need min <= opt <= max, got {lo} / {mid} / {hi}")


def compute_profile(manifest: Manifest, *, min_batch: int = DEFAULT_MIN_BATCH, opt_batch: int = DEFAULT_OPT_BATCH,
                    max_batch: int = DEFAULT_MAX_BATCH, min_tokens: int | None = None,
                    opt_tokens: int | None = None, max_tokens: int | None = None) -> Profile:
    """The optimisation profile for the manifest's inputs.

    Args:
        manifest: a loaded manifest (``inputs`` with symbolic dims, ``tokens``, ``preprocess``).
        min_batch: smallest batch the engine accepts.
        opt_batch: the batch TensorRT tunes its kernels for.
        max_batch: largest batch.
        min_tokens: text: fewest tokens per row (default 1).
        opt_tokens: text: tokens tuned for (default: the manifest's ``tokens``).
        max_tokens: text: most tokens per row (default: the manifest's ``tokens``).

    Returns:
        Axis 0 of every input is the batch; axis 1 of token inputs (``input_ids``, ``attention_mask``,
        ``token_type_ids``, or any 2-D integer input) is the token count; fixed dims stay; symbolic
        image sizes come from ``preprocess.input_size``.

    Raises:
        UserError: an inconsistent range or an input dim that cannot be resolved.
    """
    _check_range("batch", min_batch, opt_batch, max_batch)
    tokens = manifest.tokens if isinstance(manifest.tokens, int) and manifest.tokens > 0 else None
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
    for spec in manifest.inputs:
        name, dims = spec.name, list(spec.shape or [])
        if not dims:
            raise UserError(f"{MANIFEST}: input {name!r} has no shape")
        text = name in TEXT_INPUTS or (len(dims) == 2 and spec.dtype in ("int64", "int32"))
        lo, mid, hi = [min_batch], [opt_batch], [max_batch]
        for axis, d in enumerate(dims[1:], start=1):
            if isinstance(d, int) and d > 0:
                lo.append(d), mid.append(d), hi.append(d)
            elif text and axis == 1:
                mx = max_tokens if max_tokens is not None else tokens
                if mx is None:
                    raise UserError(f"{MANIFEST}: no 'tokens'; give the token range (--min/--opt/--max tokens)")
                op = opt_tokens if opt_tokens is not None else min(mx, tokens or mx)
                mn = min_tokens if min_tokens is not None else 1
                _check_range("tokens", mn, op, mx)
                lo.append(mn), mid.append(op), hi.append(mx)
            elif len(dims) == 4 and axis in (2, 3):
                size = (manifest.preprocess or {}).get("input_size")
                if not (isinstance(size, list) and len(size) == 3 and all(isinstance(v, int) for v in size)):
                    raise UserError(f"{MANIFEST}: input {name!r} has a symbolic image size and no preprocess.input_size")
                v = int(size[axis - 1])
                lo.append(v), mid.append(v), hi.append(v)
            else:
                raise UserError(f"{MANIFEST}: input {name!r} dim {axis} ({d!r}) cannot be given a profile range")
        shapes[name] = (tuple(lo), tuple(mid), tuple(hi))
    return Profile(shapes)
