"""A built index, loaded: search it with query embeddings (any budget's: the corpus side is the
dense model's, never re-embedded). :class:`LiveIndex` is what a server holds: one whole build at a
time, swapped for the next when ``index --overwrite`` renames a new ``DIR/index/`` into place."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import Manifest
from elastic_export.index import BUILD_FILE, DOCS_FILE, IDS_FILE, INDEX_DIR, INDEX_FILE


class DenseIndex:
    """One build of an index: its FAISS index, ids, documents' texts and entry, read together and never
    re-read (a rebuild is a new :class:`DenseIndex`)."""

    def __init__(self, index: Any, ids: list[Any], texts: list[str], entry: dict[str, Any], key: Any = None):
        if not index.ntotal == len(ids) == len(texts) == entry["count"] or index.d != entry["dims"]:
            raise UserError(f"index: {index.ntotal} vectors of {index.d} dims, {len(ids)} ids and {len(texts)} texts; "
                            f"its entry says {entry['count']} of {entry['dims']}; rebuild it")
        self.index, self.ids, self.texts, self.entry, self.key = index, ids, texts, entry, key
        self.dims, self.count = int(entry["dims"]), int(entry["count"])
        self.build = entry.get("build")

    @classmethod
    def load(cls, directory: str | Path) -> "DenseIndex | None":
        """The index the manifest's ``index`` entry names (None when there is none).

        Raises:
            UserError: its files are missing or do not match the entry.
        """
        manifest = Manifest.load(directory)
        if not manifest.index:
            return None
        index_files(manifest)
        return read_build(manifest.path(manifest.index["dir"]), manifest.index, manifest.model.fingerprint)

    @classmethod
    def open(cls, index_path: Path, ids_path: Path, docs_path: Path, entry: dict[str, Any]) -> "DenseIndex":
        """The index in these files (FAISS index, ids, documents), checked against its manifest ``entry``
        (what a served copy of the files, e.g. the Triton search model's, opens).

        Raises:
            UserError: the files do not match the entry or each other.
        """
        with open(index_path, "rb") as f, open(ids_path, "rb") as g, open(docs_path, "rb") as h:
            return cls.read(f, g, h, entry, str(index_path))

    @classmethod
    def read(cls, index_file: IO[bytes], ids_file: IO[bytes], docs_file: IO[bytes], entry: dict[str, Any],
             name: str, key: Any = None) -> "DenseIndex":
        """The index in these open files, the ids of ``docs.jsonl`` checked equal to ``ids.json``'s.

        Raises:
            UserError: a file unreadable, or the files not one build's.
        """
        import faiss

        try:
            index = faiss.deserialize_index(np.frombuffer(index_file.read(), dtype=np.uint8))
            ids = json.loads(ids_file.read())
            docs = [json.loads(line) for line in docs_file.read().decode("utf-8").splitlines() if line.strip()]
            texts = [d["text"] for d in docs]
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"index: {name}: unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                            "rebuild it") from None
        if [d.get("id") for d in docs] != ids:
            raise UserError(f"index: {name}: the ids of {IDS_FILE} and {DOCS_FILE} differ; rebuild it")
        if entry.get("kind") == "hnsw":
            index.hnsw.efSearch = int(entry.get("ef_search", 128))
        return cls(index, ids, texts, entry, key)

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


def read_build(folder: Path, entry: dict[str, Any] | None = None, fingerprint: str | None = None) -> DenseIndex:
    """The build in ``folder``, every file opened through one handle on the folder itself, so that ids,
    vectors and texts are one build's even while another is renamed into its place. Its entry is the
    folder's ``build.json`` (else ``entry``, the manifest's: a build written before build files).

    Raises:
        UserError: no folder, a file missing or unreadable, files not one build's, another model's build.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise UserError(f"index: {folder}: {e.strerror}") from None
    try:
        key = _key(os.fstat(fd))
        own = _open_in(fd, folder, BUILD_FILE, missing_ok=True)
        if own is not None:
            with own:
                entry = _json(own.read(), folder / BUILD_FILE)
        if not entry:
            raise UserError(f"index: {folder} has no {BUILD_FILE} and the manifest no index entry; rebuild it")
        _check_model(entry, fingerprint)
        with (_open_in(fd, folder, INDEX_FILE) as f, _open_in(fd, folder, IDS_FILE) as g,
              _open_in(fd, folder, DOCS_FILE) as h):
            return DenseIndex.read(f, g, h, entry, str(folder), key)
    finally:
        os.close(fd)


def folder_key(folder: Path) -> tuple[int, int, int] | None:
    """What tells one ``DIR/index/`` folder from the next (device, inode, ctime); None when there is none."""
    try:
        return _key(os.stat(folder))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _key(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _open_in(fd: int, folder: Path, name: str, missing_ok: bool = False) -> IO[bytes] | None:
    try:
        return open(name, "rb", opener=lambda path, flags: os.open(path, flags, dir_fd=fd))
    except FileNotFoundError:
        if missing_ok:
            return None
        raise UserError(f"index: {folder / name} is missing; rebuild it with `elastic-export index --overwrite`") from None


def _json(raw: bytes, path: Path) -> Any:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise UserError(f"index: {path}: not JSON ({e}); rebuild it") from None


def _check_model(entry: dict[str, Any], fingerprint: str | None) -> None:
    built_with = (entry.get("model") or {}).get("fingerprint")
    if built_with and fingerprint and built_with != fingerprint:
        raise UserError(f"index: built with model {built_with}, the directory holds {fingerprint}; "
                        f"rebuild it with `elastic-export index --overwrite`")


class LiveIndex:
    """The index a server searches: one whole build, swapped for the next in one assignment.

    A request takes :meth:`current` once and answers from that build alone. :meth:`current` also stats
    ``DIR/index/``; when it is another folder than the one last read (``index --overwrite`` renamed a new
    build into place), a background thread reads it whole and swaps it in. A build that cannot be read is
    refused: the previous one stays served, one line is logged, and it is not read again until it changes.
    """

    def __init__(self, directory: str | Path, build: DenseIndex | None = None,
                 log: Callable[[str], None] | None = None):
        self.root = Path(directory)
        self.folder = self.root / INDEX_DIR
        self.build = build
        self._seen = build.key if build is not None else None
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._reading, self._starting = threading.Lock(), threading.Lock()
        self._thread: threading.Thread | None = None

    @classmethod
    def load(cls, directory: str | Path, log: Callable[[str], None] | None = None) -> "LiveIndex":
        """DIR's index as the manifest names it (see :meth:`DenseIndex.load`), watched for rebuilds.

        Raises:
            UserError: the index there is broken.
        """
        return cls(directory, DenseIndex.load(directory), log)

    def current(self) -> DenseIndex | None:
        """The build to answer with (None: none yet); a reload starts in the background when the folder
        is not the one last read."""
        if folder_key(self.folder) not in (None, self._seen):
            self._start()
        return self.build

    def reload(self) -> bool:
        """Read the folder in place and swap it in (True); else keep the build served: the folder is the
        one last read or absent, it was replaced while read (read again at the next look), or it is refused."""
        with self._reading:
            key = folder_key(self.folder)
            if key is None or key == self._seen:
                return False
            try:
                manifest = Manifest.load(self.root)
                build = read_build(self.folder, manifest.index, manifest.model.fingerprint)
            except UserError as e:
                if folder_key(self.folder) == key:  # still in place: refused until it changes
                    self._seen = key
                    self._log(f"index: refused {self.folder} ({e}); serving {self._serving()}")
                return False
            self._seen, self.build = build.key, build
            self._log(f"index: serving {self._serving()}")
            return True

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for a background reload, if one runs (tests, shutdown)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _start(self) -> None:
        with self._starting:
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._reload_logged, name="index-reload", daemon=True)
            self._thread.start()

    def _reload_logged(self) -> None:
        try:
            self.reload()
        except Exception as e:  # noqa: BLE001 - a reload never takes the server down: logged, old build kept
            self._log(f"index: reload of {self.folder} failed ({type(e).__name__}: {e}); serving {self._serving()}")

    def _serving(self) -> str:
        b = self.build
        return "no index" if b is None else f"build {b.build or '(unnamed)'} ({b.count} documents)"


def index_files(manifest: Manifest) -> dict[str, Path]:
    """The files of the manifest's ``index`` entry (``file``, ``ids``, ``docs``), checked to exist and to be
    built with the directory's model, without reading them.

    Raises:
        UserError: no index entry, a file missing, or an index built with another model.
    """
    entry = manifest.index
    if not entry:
        raise UserError("no index: build one with `elastic-export index DIR CORPUS`")
    _check_model(entry, manifest.model.fingerprint)
    files = {k: manifest.path(entry[k]) for k in ("file", "ids", "docs")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise UserError(f"index: {missing[0]} is missing; rebuild it with `elastic-export index --overwrite`")
    return files
