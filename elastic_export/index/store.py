"""A built index, loaded: search it with query embeddings (any budget's: the corpus side is the
dense model's, never re-embedded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import Manifest


class DenseIndex:
    """The FAISS index of ``DIR/index/``, its ids and (loaded on first use) its documents' text."""

    def __init__(self, index: Any, ids: list[Any], docs_path: Path, entry: dict[str, Any]):
        self.index, self.ids, self.entry = index, ids, entry
        self._docs_path = docs_path
        self._texts: list[str] | None = None
        self.dims, self.count = int(entry["dims"]), int(entry["count"])

    @classmethod
    def load(cls, directory: str | Path) -> "DenseIndex | None":
        """The index the manifest's ``index`` entry names (None when there is none).

        Raises:
            UserError: its files are missing or do not match the entry.
        """
        manifest = Manifest.load(directory)
        if not manifest.index:
            return None
        files = index_files(manifest)
        return cls.open(files["file"], files["ids"], files["docs"], manifest.index)

    @classmethod
    def open(cls, index_path: Path, ids_path: Path, docs_path: Path, entry: dict[str, Any]) -> "DenseIndex":
        """The index in these files (FAISS index, ids, documents), checked against its manifest ``entry``
        (what a served copy of the files, e.g. the Triton search model's, opens).

        Raises:
            UserError: the files do not match the entry.
        """
        import faiss

        index = faiss.read_index(str(index_path))
        if entry.get("kind") == "hnsw":
            index.hnsw.efSearch = int(entry.get("ef_search", 128))
        ids = json.loads(Path(ids_path).read_text())
        if index.ntotal != len(ids) or len(ids) != entry["count"] or index.d != entry["dims"]:
            raise UserError(f"index: {index_path} holds {index.ntotal} vectors of {index.d} dims, its manifest "
                            f"entry {entry['count']} of {entry['dims']}; rebuild it")
        return cls(index, ids, Path(docs_path), entry)

    @property
    def texts(self) -> list[str]:
        """Every document's text, in index order."""
        if self._texts is None:
            with open(self._docs_path, encoding="utf-8") as f:
                self._texts = [json.loads(line)["text"] for line in f if line.strip()]
        return self._texts

    def search(self, queries: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, positions) of the ``top_k`` best documents of each query row (normalised here),
        best first; ``top_k`` is capped at the number of documents."""
        from elastic_export.index.build import normalize

        k = max(1, min(int(top_k), self.count))
        scores, positions = self.index.search(np.ascontiguousarray(normalize(queries)), k)
        return scores, positions

    def hits(self, scores: np.ndarray, positions: np.ndarray, with_text: bool) -> list[dict[str, Any]]:
        """One ``{ids, scores[, texts]}`` per query (positions FAISS left empty, -1, dropped)."""
        out = []
        for row_s, row_p in zip(scores, positions):
            keep = [(float(s), int(p)) for s, p in zip(row_s, row_p) if p >= 0]
            hit: dict[str, Any] = {"ids": [self.ids[p] for _, p in keep], "scores": [s for s, _ in keep]}
            if with_text:
                hit["texts"] = [self.texts[p] for _, p in keep]
            out.append(hit)
        return out


def index_files(manifest: Manifest) -> dict[str, Path]:
    """The files of the manifest's ``index`` entry (``file``, ``ids``, ``docs``), checked to exist and to be
    built with the directory's model, without reading them.

    Raises:
        UserError: no index entry, a file missing, or an index built with another model.
    """
    entry = manifest.index
    if not entry:
        raise UserError("no index: build one with `elastic-export index DIR CORPUS`")
    built_with = (entry.get("model") or {}).get("fingerprint")
    if built_with and manifest.model.fingerprint and built_with != manifest.model.fingerprint:
        raise UserError(f"index: built with model {built_with}, the directory holds {manifest.model.fingerprint}; "
                        f"rebuild it with `elastic-export index --overwrite`")
    files = {k: manifest.path(entry[k]) for k in ("file", "ids", "docs")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise UserError(f"index: {missing[0]} is missing; rebuild it with `elastic-export index --overwrite`")
    return files
