"""The artifact directory's ``manifest.json`` (DESIGN.md §4): build, write, load and check paths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx

from elastic_export.errors import UserError

FORMAT = "elastic-export/1"
MANIFEST = "manifest.json"

_DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.FLOAT16: "float16",
           onnx.TensorProto.INT32: "int32"}


def io_specs(values) -> list[dict[str, Any]]:
    """name / dtype / shape (symbolic dims as strings) of ONNX graph inputs or outputs."""
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]
        out.append({"name": v.name, "dtype": _DTYPES.get(t.elem_type, str(t.elem_type)), "shape": dims})
    return out


def resolve(directory: Path, rel: str | None) -> Path | None:
    """Path of a manifest entry; refuses absolute paths and paths that leave the directory."""
    if rel is None:
        return None
    if not isinstance(rel, str) or not rel or "\x00" in rel or Path(rel).is_absolute():
        raise UserError(f"{directory / MANIFEST}: path {rel!r} must be relative to the manifest")
    root = directory.resolve()
    p = (root / rel).resolve()
    if root != p and root not in p.parents:
        raise UserError(f"{directory / MANIFEST}: path {rel!r} leaves the artifact directory; refused")
    return p


def elastic_indices(elastic: dict, sparsities: list[float]) -> list[tuple[float, int]]:
    """(sparsity, ``budget_index``) of every budget the elastic graph selects, dense included.

    The manifest's ``elastic`` entry lists ``budgets``: the sparsities of indices 0, 1, ... in
    order (absent in hand-made manifests: the manifest's budgets, in order); ``dense_index``
    (written since the elastic graph serves the dense model too; absent in older directories,
    whose graph has no dense row) is the index of sparsity 0.0, after the budgets'.

    Args:
        elastic: the manifest's ``elastic`` entry.
        sparsities: the manifest's budget sparsities, in order (the default for ``budgets``).

    Raises:
        UserError: ``dense_index`` is not an integer index past the budgets'.
    """
    listed = elastic.get("budgets") or sparsities
    pairs = [(s, i) for i, s in enumerate(listed)]
    dense = elastic.get("dense_index")
    if dense is not None:
        if isinstance(dense, bool) or not isinstance(dense, int) or not dense >= len(listed):
            raise UserError(f"{MANIFEST}: elastic 'dense_index' {dense!r} must be an integer >= {len(listed)} "
                            f"(after the budgets' indices)")
        pairs.append((0.0, dense))
    return pairs


def write_manifest(directory: Path, manifest: dict) -> Path:
    """Write ``DIR/manifest.json`` atomically (a reader never sees half a manifest)."""
    from elastic_export.fileio import atomic_write

    path = Path(directory) / MANIFEST
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(manifest, indent=2) + "\n"))
    return path


def load_manifest(directory: str | Path) -> dict:
    """Read and check ``DIR/manifest.json``: format, required keys, every path inside DIR."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(f"{directory}: no {MANIFEST}; not an elastic-export artifact directory")
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise UserError(f"{path}: unreadable manifest ({e})")
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise UserError(f"{path}: format is not {FORMAT!r}")
    for key in ("model", "inputs", "outputs", "dense", "budgets", "ranking"):
        if key not in m:
            raise UserError(f"{path}: missing key {key!r}")
    if not isinstance(m["budgets"], list):
        raise UserError(f"{path}: 'budgets' must be a list")
    for key in ("model", "dense", "ranking"):
        if not isinstance(m[key], dict):
            raise UserError(f"{path}: {key!r} must be an object")
    for key in ("inputs", "outputs"):
        if not isinstance(m[key], list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in m[key]):
            raise UserError(f"{path}: {key!r} must be a list of {{name, dtype, shape}} objects")
    if not isinstance(m["dense"].get("onnx"), str):
        raise UserError(f"{path}: 'dense' needs its 'onnx' file")
    for key in ("onnx", "onnx_fp16", "onnx_int8", "onnx_int8_qdq", "onnx_optimized", "engine"):
        resolve(directory, m["dense"].get(key))
    resolve(directory, m["ranking"].get("file"))
    seen: set[float] = set()
    for b in m["budgets"]:
        if not isinstance(b, dict):
            raise UserError(f"{path}: every budget must be an object")
        s = b.get("sparsity")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
            raise UserError(f"{path}: budget sparsity {s!r} must be a number in [0, 1)")
        if round(s, 6) in seen:
            raise UserError(f"{path}: budget sparsity {s!r} is listed twice")
        seen.add(round(s, 6))
        if not isinstance(b.get("onnx"), str):
            raise UserError(f"{path}: budget {s!r} needs its 'onnx' file")
        for key in ("onnx", "onnx_fp16", "onnx_int8", "onnx_int8_qdq", "onnx_optimized", "engine"):
            resolve(directory, b.get(key))
        for key in ("heads_per_layer", "neurons_per_layer"):
            v = b.get(key)
            if v is not None and not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   and x >= 0 for x in v)):
                raise UserError(f"{path}: budget {s!r}: {key!r} must be a list of non-negative integers")
    for key, fields in (("elastic", ("onnx", "onnx_fp16")), ("triton", ("dir",)), ("sentence_transformers", ("dir",))):
        if m.get(key) is not None:
            if not isinstance(m[key], dict):
                raise UserError(f"{path}: {key!r} must be an object or null")
            for field in fields:
                resolve(directory, m[key].get(field))
    return m
