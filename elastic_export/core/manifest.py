"""The artifact directory's ``manifest.json`` (DESIGN.md §4), typed: :class:`Manifest` and its entries
(:class:`Dense`, :class:`Budget`, :class:`Elastic`, ...), one :meth:`Manifest.load` that checks it, one
:meth:`Manifest.to_json` that writes it, and the directory's file names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from elastic_export.core.errors import UserError
from elastic_export.core.precisions import ERROR_KEYS, FILE_KEYS, PRECISIONS

FORMAT = "elastic-export/1"
"""The manifest's ``format`` string (DESIGN.md §4)."""

# the artifact directory's contract file names, defined once
MANIFEST = "manifest.json"
DENSE_FILE = "dense.onnx"
ELASTIC_FILE = "elastic.onnx"
RANKING_FILE = "ranking.safetensors"
LATENCY_PROFILE = "latency_profile.json"
REPORT = "report.html"
BUDGET_INPUT = "budget_index"
"""The elastic graph's input that selects a budget."""
ONNX = FILE_KEYS["fp32"]
"""The field naming an entry's fp32 ONNX file (``dense``, every budget, ``elastic``)."""
OPTIMIZED_FIELD = "onnx_optimized"
"""The field of ``dense`` and of a budget naming its onnxruntime-optimised copy."""
ENGINE_FIELD = "engine"
"""The field of ``dense`` and of a budget naming its TensorRT engine."""
TWIN_FIELDS = tuple(k for p in ERROR_KEYS for k in (FILE_KEYS[p], ERROR_KEYS[p]))
"""The fields of ``dense`` and of a budget for its lower-precision twins and their measured errors
(``onnx_fp16``, ``fp16_max_rel_error``, ``onnx_int8``, ``int8_min_cosine``, ...)."""
FILE_FIELDS = (*FILE_KEYS.values(), OPTIMIZED_FIELD, ENGINE_FIELD)
"""The fields of ``dense`` and of a budget that name a file in the directory."""


def io_specs(values) -> list[dict[str, Any]]:
    """name / dtype / shape (symbolic dims as strings) of ONNX graph inputs or outputs."""
    import onnx

    dtypes = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.FLOAT16: "float16",
               onnx.TensorProto.INT32: "int32"}
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.dim_param else (d.dim_value if d.HasField("dim_value") else None) for d in t.shape.dim]
        out.append({"name": v.name, "dtype": dtypes.get(t.elem_type, str(t.elem_type)), "shape": dims})
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


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write ``DIR/manifest.json`` atomically (a reader never sees half a manifest)."""
    from elastic_export.core.fileio import atomic_write

    if not isinstance(manifest, Manifest):
        raise TypeError(f"write_manifest takes a Manifest (Manifest.from_dict converts a dict), not {type(manifest).__name__}")
    text = manifest.to_json()
    path = Path(directory) / MANIFEST
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path


def load_manifest(directory: str | Path) -> dict:
    """``DIR/manifest.json`` as a plain dict, checked by :meth:`Manifest.load` (for readers not yet
    on the typed manifest)."""
    return Manifest.load(directory).to_dict()


def _read_checked(directory: Path) -> dict:
    """Read and check ``DIR/manifest.json``: format, required keys, every path inside DIR."""
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
    if not isinstance(m["dense"].get(ONNX), str):
        raise UserError(f"{path}: 'dense' needs its {ONNX!r} file")
    for key in FILE_FIELDS:
        resolve(directory, m["dense"].get(key))
    resolve(directory, m["ranking"].get("file"))
    _check_budgets(directory, path, m["budgets"])
    for key, fields_ in (("elastic", (ONNX, FILE_KEYS["fp16"])), ("triton", ("dir",)), ("sentence_transformers", ("dir",)),
                         ("index", ("dir", "file", "ids", "docs"))):
        if m.get(key) is not None:
            if not isinstance(m[key], dict):
                raise UserError(f"{path}: {key!r} must be an object or null")
            for field_ in fields_:
                resolve(directory, m[key].get(field_))
    return m


def _check_budgets(directory: Path, path: Path, budgets: list) -> None:
    """Every budget: an object with a sparsity in [0, 1) listed once, its files inside DIR, counts."""
    seen: set[float] = set()
    for b in budgets:
        if not isinstance(b, dict):
            raise UserError(f"{path}: every budget must be an object")
        s = b.get("sparsity")
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1:
            raise UserError(f"{path}: budget sparsity {s!r} must be a number in [0, 1)")
        if round(s, 6) in seen:
            raise UserError(f"{path}: budget sparsity {s!r} is listed twice")
        seen.add(round(s, 6))
        if not isinstance(b.get(ONNX), str):
            raise UserError(f"{path}: budget {s!r} needs its {ONNX!r} file")
        for key in FILE_FIELDS:
            resolve(directory, b.get(key))
        for key in ("heads_per_layer", "neurons_per_layer"):
            v = b.get(key)
            if v is not None and not (isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   and x >= 0 for x in v)):
                raise UserError(f"{path}: budget {s!r}: {key!r} must be a list of non-negative integers")


# --- the typed manifest ---------------------------------------------------------------------------
def _plain(value: Any) -> Any:
    """JSON-ready copy: entries as dicts, lists and dicts copied."""
    if isinstance(value, Entry):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass(kw_only=True, eq=False)
class Entry:
    """One object of the manifest: typed fields plus ``extra`` (keys this version does not know,
    kept as they are). It remembers its key order, so ``to_dict`` writes a loaded entry back with
    the same keys in the same order; a field set later goes after them, as in a dict.

    Fields in ``OPTIONAL`` are left out of a new entry while they are None (they appear only when
    some step writes them: ``tower``, ``onnx_optimized``, ``quick_eval``, ``triton``, ...).

    Typed only: fields are attributes (no mapping access); a plain dict becomes an entry through
    :meth:`from_dict` (as :meth:`Manifest.load` reads the file). Two entries are equal when they write
    the same JSON.
    """

    OPTIONAL: ClassVar[frozenset[str]] = frozenset()
    ORDER: ClassVar[tuple[str, ...]] = ()
    """The written key order of a new entry, where it is not the fields' order (inherited fields
    come first in a dataclass); fields it leaves out follow."""
    NESTED: ClassVar[dict[str, type[Entry]]] = {}
    """field -> entry type of its value (a list of them for list fields)."""

    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        names = list(dict.fromkeys([*self.ORDER, *self._fields()]))
        object.__setattr__(self, "_order", [f for f in names if f not in self.OPTIONAL or getattr(self, f) is not None])

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        order = self.__dict__.get("_order")
        if order is not None and name in self._fields() and name not in order:
            order.append(name)

    @classmethod
    def _fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "extra")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Entry:
        """The entry for a JSON object (nested entries converted; unknown keys into ``extra``)."""
        names = set(cls._fields())
        kwargs = {k: cls._nested(k, v) for k, v in d.items() if k in names}
        entry = cls(**kwargs, extra={k: v for k, v in d.items() if k not in names})
        object.__setattr__(entry, "_order", list(d))
        return entry

    @classmethod
    def _nested(cls, key: str, value: Any) -> Any:
        kind = cls.NESTED.get(key)
        if kind is None or value is None:
            return value
        if isinstance(value, list):
            return [kind.from_dict(v) if isinstance(v, Mapping) else v for v in value]
        return kind.from_dict(value) if isinstance(value, Mapping) else value

    def to_dict(self) -> dict[str, Any]:
        """The JSON object, keys in their order (see the class docstring)."""
        names = set(self._fields())
        return {k: _plain(getattr(self, k) if k in names else self.extra[k]) for k in self._order}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Entry):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]


@dataclass(kw_only=True, eq=False)
class TensorSpec(Entry):
    """A graph input or output: name, dtype, shape (symbolic dims as strings)."""

    name: str = ""
    dtype: str | None = None
    shape: list[int | str | None] | None = None


@dataclass(kw_only=True, eq=False)
class ModelInfo(Entry):
    """Where the model came from: ``source`` (as given: a path, a hub id, a timm name), class, weights
    fingerprint, modality; for hub models the ``repo_id`` and the ``revision`` (commit) loaded."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"tower", "repo_id", "revision"})
    source: str | None = None
    architecture: str | None = None
    fingerprint: str | None = None
    modality: str | None = None
    tower: str | None = None
    repo_id: str | None = None
    revision: str | None = None


@dataclass(kw_only=True, eq=False)
class _Files(Entry):
    """A model's files: fp32 ``onnx`` and its twins per precision (:data:`FILE_KEYS`), with the
    measured error of each twin against it."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({OPTIMIZED_FIELD})
    onnx: str = ""
    onnx_fp16: str | None = None
    fp16_max_rel_error: float | None = None
    onnx_int8: str | None = None
    int8_min_cosine: float | None = None
    onnx_int8_qdq: str | None = None
    int8_qdq_min_cosine: float | None = None
    onnx_optimized: str | None = None

    def file(self, precision: str) -> str | None:
        """The file of ``precision`` (``fp32``, ``fp16``, ``int8``, ``int8-qdq``), or None."""
        return getattr(self, FILE_KEYS[precision])

    def precisions(self) -> list[str]:
        """The precisions this model has a file of, in :data:`PRECISIONS` order."""
        return [p for p in PRECISIONS if self.file(p)]


@dataclass(kw_only=True, eq=False)
class Dense(_Files):
    """The dense model: its files, GFLOPs and parameters (and TensorRT engine once built)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({OPTIMIZED_FIELD, ENGINE_FIELD})
    ORDER: ClassVar[tuple[str, ...]] = (ONNX, *TWIN_FIELDS, "gflops", "params")
    gflops: float | None = None
    params: int | None = None
    engine: str | None = None


@dataclass(kw_only=True, eq=False)
class Budget(_Files):
    """One budget: asked and achieved sparsity, cost, kept units per layer, files, engine, error."""

    ORDER: ClassVar[tuple[str, ...]] = ("sparsity", "achieved_sparsity", "gflops", "params", ONNX, ENGINE_FIELD,
                                        "heads_per_layer", "neurons_per_layer", "max_abs_error", *TWIN_FIELDS)
    sparsity: float = 0.0
    achieved_sparsity: float | None = None
    gflops: float | None = None
    params: int | None = None
    engine: str | None = None
    heads_per_layer: list[int] | None = None
    neurons_per_layer: list[int] | None = None
    max_abs_error: float | None = None


@dataclass(kw_only=True, eq=False)
class Elastic(Entry):
    """The elastic graph: its file(s), the budget input and the sparsity of each index."""

    onnx: str = ""
    budget_input: str = BUDGET_INPUT
    budgets: list[float] | None = None
    dense_index: int | None = None
    max_abs_error: float | None = None
    onnx_fp16: str | None = None
    fp16_max_rel_error: float | None = None

    def file(self, precision: str) -> str | None:
        """The elastic graph's file of ``precision`` (it has fp32 and fp16 ones only), or None."""
        return getattr(self, FILE_KEYS[precision], None) or None

    def indices(self, sparsities: list[float]) -> list[tuple[float, int]]:
        """(sparsity, index) of every budget the graph selects (:func:`elastic_indices`)."""
        return elastic_indices(self.to_dict(), sparsities)


@dataclass(kw_only=True, eq=False)
class RankingInfo(Entry):
    """The ranking file, the method that made it and how long it took."""

    file: str | None = None
    method: str | None = None
    seconds: float | None = None


@dataclass(kw_only=True, eq=False)
class Manifest(Entry):
    """``DIR/manifest.json`` (DESIGN.md §4), typed. ``load`` checks it; ``to_json`` writes it in the
    format it was read in (key order kept; entries added by later steps go after, as they always
    have). ``directory`` is where it was loaded from (not written)."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"int8_qdq", "sentence_transformers", "ort_optimize", "quick_eval",
                                                    "triton", "tensorrt", "index"})
    NESTED: ClassVar[dict[str, type[Entry]]] = {"model": ModelInfo, "inputs": TensorSpec, "outputs": TensorSpec,
                                                "dense": Dense, "budgets": Budget, "elastic": Elastic,
                                                "ranking": RankingInfo}
    format: str = FORMAT
    tool: str | None = None
    model: ModelInfo = field(default_factory=ModelInfo)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    tokens: int | None = None
    preprocess: dict[str, Any] | None = None
    prunable_gflops: float | None = None
    align: int | None = None
    precisions: list[str] | None = None
    dense: Dense = field(default_factory=Dense)
    budgets: list[Budget] = field(default_factory=list)
    elastic: Elastic | None = None
    int8_qdq: dict[str, Any] | None = None
    ranking: RankingInfo = field(default_factory=RankingInfo)
    sentence_transformers: dict[str, Any] | None = None
    ort_optimize: dict[str, Any] | None = None
    quick_eval: dict[str, Any] | None = None
    triton: dict[str, Any] | None = None
    tensorrt: dict[str, Any] | None = None
    index: dict[str, Any] | None = None
    """``elastic-export index``: the dense index of a corpus (``elastic_export.index.build``)."""

    @classmethod
    def load(cls, directory: str | Path) -> Manifest:
        """Read and check ``DIR/manifest.json`` (format, required keys, every path inside DIR).

        Raises:
            UserError: one line naming the file and what is wrong.
        """
        directory = Path(directory)
        manifest = cls.from_dict(_read_checked(directory))
        object.__setattr__(manifest, "directory", directory)
        return manifest

    def to_json(self) -> str:
        """The manifest file's text (2-space indent, trailing newline)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def write(self, directory: str | Path) -> Path:
        """Write ``DIR/manifest.json`` atomically."""
        return write_manifest(Path(directory), self)

    def path(self, rel: str | None) -> Path | None:
        """The file a manifest entry names, inside the loaded directory (:func:`resolve`)."""
        return resolve(self.__dict__["directory"], rel)

    @property
    def sparsities(self) -> list[float]:
        """Every budget's sparsity, in manifest order."""
        return [b.sparsity for b in self.budgets]

    def elastic_indices(self) -> list[tuple[float, int]]:
        """(sparsity, ``budget_index``) of every budget the elastic graph selects (none without one)."""
        return self.elastic.indices(self.sparsities) if self.elastic is not None else []

