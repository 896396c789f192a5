"""The ranking file: per-layer neuron and head scores (safetensors) plus JSON metadata.

Layout: tensors ``layers.{i}.heads`` and ``layers.{i}.neurons`` (float32, higher = more
important, one scale for both kinds), and one metadata entry ``elastic_export`` holding a JSON
object: ``version``, ``fingerprint``, ``method``, ``tokens``, ``units`` (per layer: counts and unit
costs; grouped-query layers also ``kv_heads``, ``kv_cost``, ``kv_index``), ``hyperparameters``,
``calibration``. No timestamps: the same inputs give the same bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from elastic_export.core.errors import UserError, first_line
from elastic_export.core.fileio import atomic_write
from elastic_export.core.unit_map import HEADS, NEURONS

if TYPE_CHECKING:
    from elastic_export.models.inventory import Inventory

RANKING_VERSION = 1
META_KEY = "elastic_export"


@dataclass
class Ranking:
    """Scores of every unit. ``heads[i]`` / ``neurons[i]``: scores of layer i's units."""

    heads: list[np.ndarray]
    neurons: list[np.ndarray]
    meta: dict = field(default_factory=dict)

    def scores(self, kind: str, layer: int) -> np.ndarray:
        return (self.heads if kind == HEADS else self.neurons)[layer]

    def order(self, kind: str, layer: int) -> np.ndarray:
        """Unit indices of one layer, most important first (ties: lower index first)."""
        s = self.scores(kind, layer)
        return np.lexsort((np.arange(len(s)), -s.astype(np.float64)))

    @property
    def num_layers(self) -> int:
        return len(self.heads)

    def check_matches(self, inventory: Inventory, fingerprint: str | None, where: str) -> None:
        """Refuse a ranking made for another model (fingerprint or unit counts differ)."""
        fp = self.meta.get("fingerprint")
        if fingerprint is not None and fp is not None and fp != fingerprint:
            raise UserError(f"{where}: this ranking was made for another model (fingerprint mismatch); rank again")
        if self.num_layers != len(inventory.layers) or any(
            len(self.heads[i]) != L.heads or len(self.neurons[i]) != L.neurons
            for i, L in enumerate(inventory.layers)
        ):
            raise UserError(f"{where}: unit counts differ from the model's; this ranking is for another model")
        if self.meta.get("tokens", inventory.tokens) != inventory.tokens:
            raise UserError(
                f"{where}: ranked at N={self.meta.get('tokens')} tokens but the model now has N={inventory.tokens};"
                " use the same --seq-len / --image-size or rank again"
            )


def make_meta(inventory: Inventory, fingerprint: str, method: str, hyper: dict, calib: dict) -> dict:
    from elastic_export import __version__

    return {
        "version": RANKING_VERSION,
        "tool": f"elastic-export {__version__}",
        "fingerprint": fingerprint,
        "method": method,
        "tokens": inventory.tokens,
        "units": [
            {"heads": L.heads, "neurons": L.neurons, "head_cost": L.head_cost, "neuron_cost": L.neuron_cost,
             **({"kv_heads": L.kv_heads, "kv_cost": L.kv_cost, "kv_index": list(L.kv_index)} if L.kv_heads else {})}
            for L in inventory.layers
        ],
        "hyperparameters": hyper,
        "calibration": calib,
    }


def save_ranking(ranking: Ranking, path: str | Path) -> None:
    """Write atomically (temp file, then rename)."""
    from safetensors.numpy import save_file

    tensors = {}
    for i in range(ranking.num_layers):
        tensors[f"layers.{i}.heads"] = np.ascontiguousarray(ranking.heads[i], dtype=np.float32)
        tensors[f"layers.{i}.neurons"] = np.ascontiguousarray(ranking.neurons[i], dtype=np.float32)
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a directory; give a file name for the ranking (e.g. {path / 'ranking.safetensors'})")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{path}: cannot create its directory ({e.strerror or e})")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"{path}: {path.parent} is not writable")
    atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={META_KEY: json.dumps(ranking.meta, sort_keys=True)}))


def load_ranking(path: str | Path) -> Ranking:
    """Read a ranking file; any damage gives a one-line :class:`UserError`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise UserError(f"--ranking {path}: no such file")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta_raw = (f.metadata() or {}).get(META_KEY)
            keys = set(f.keys())
            tensors = {k: f.get_tensor(k) for k in keys}
    except Exception as e:
        raise UserError(f"--ranking {path}: not a readable ranking file ({first_line(e)})")
    if meta_raw is None:
        raise UserError(f"--ranking {path}: no elastic-export metadata; not a ranking file")
    try:
        meta = json.loads(meta_raw)
        if not isinstance(meta, dict):
            raise ValueError("metadata is not an object")
    except ValueError as e:
        raise UserError(f"--ranking {path}: corrupt metadata ({e})")
    if meta.get("version") != RANKING_VERSION:
        raise UserError(f"--ranking {path}: ranking file version {meta.get('version')!r} is not supported")
    tokens = meta.get("tokens")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise UserError(f"--ranking {path}: corrupt metadata (tokens must be a positive integer)")
    if meta.get("fingerprint") is not None and not isinstance(meta["fingerprint"], str):
        raise UserError(f"--ranking {path}: corrupt metadata (fingerprint must be a string)")
    n = 0
    while f"layers.{n}.heads" in keys:
        n += 1
    expected = {f"layers.{i}.{k}" for i in range(n) for k in (HEADS, NEURONS)}
    if n == 0 or keys != expected:
        raise UserError(f"--ranking {path}: tensors are missing or unexpected; not a ranking file")
    heads, neurons = [], []
    for i in range(n):
        for kind, dst in ((HEADS, heads), (NEURONS, neurons)):
            t = tensors[f"layers.{i}.{kind}"]
            if t.ndim != 1 or t.dtype != np.float32 or not np.all(np.isfinite(t)):
                raise UserError(f"--ranking {path}: layers.{i}.{kind} is not a finite float32 vector")
            dst.append(t)
    return Ranking(heads, neurons, meta)
