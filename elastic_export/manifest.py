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
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
        raise UserError(f"{directory / MANIFEST}: path {rel!r} must be relative to the manifest")
    root = directory.resolve()
    p = (root / rel).resolve()
    if root != p and root not in p.parents:
        raise UserError(f"{directory / MANIFEST}: path {rel!r} leaves the artifact directory; refused")
    return p


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
    except (OSError, ValueError) as e:
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
    resolve(directory, m["dense"].get("onnx"))
    resolve(directory, m["dense"].get("onnx_fp16"))
    resolve(directory, m["dense"].get("onnx_optimized"))
    resolve(directory, m["ranking"].get("file"))
    for b in m["budgets"]:
        if not isinstance(b, dict):
            raise UserError(f"{path}: every budget must be an object")
        resolve(directory, b.get("onnx"))
        resolve(directory, b.get("onnx_fp16"))
        resolve(directory, b.get("onnx_optimized"))
        resolve(directory, b.get("engine"))
    if m.get("elastic"):
        if not isinstance(m["elastic"], dict):
            raise UserError(f"{path}: 'elastic' must be an object or null")
        resolve(directory, m["elastic"].get("onnx"))
    return m
