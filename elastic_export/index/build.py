"""``elastic-export index DIR CORPUS``: embed a corpus with the directory's dense model (onnxruntime,
batched by token length, no torch) and write ``DIR/index/`` (a FAISS index, the ids and the
documents) atomically, recorded in the manifest's ``index`` entry."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.fileio import existing_dir, file_sha256
from elastic_export.core.manifest import Manifest
from elastic_export.index import BUILD_FILE, DOCS_FILE, IDS_FILE, INDEX_DIR, INDEX_FILE, METRIC
from elastic_export.index.corpus import Corpus, read_corpus

HNSW_M = 32
HNSW_EF_CONSTRUCTION = 200
HNSW_EF_SEARCH = 128


def dense_encoder(directory: Path):
    """The directory's dense model (an :class:`ElasticRuntime` holding sparsity 0 only) and its tokenizer."""
    from elastic_export.models.text import TextEncoder, tokenizer_folder
    from elastic_export.serving.runtime import ElasticRuntime

    rt = ElasticRuntime.from_dir(directory, sparsities=(0.0,))
    if "input_ids" not in rt.input_names:
        raise UserError(f"{directory}: index needs a text encoder; this model takes {', '.join(rt.input_names)}")
    folder = tokenizer_folder(rt.manifest, directory)
    if folder is None:
        raise UserError(f"{directory}: no tokenizer found for the model")
    return rt, TextEncoder.from_dir(folder, rt.input_names)


def embed(rt, encoder, texts: Sequence[str], batch_size: int = 64, progress: bool = True) -> np.ndarray:
    """L2-normalised dense embeddings of ``texts`` (float32, in order), run in batches of about one
    token length so that little is padding."""
    from tqdm import tqdm

    from elastic_export.models.text import mean_pool

    lengths = [sum(e.attention_mask) for e in encoder.tokenizer.encode_batch(list(texts))]  # padded: real tokens
    order = sorted(range(len(texts)), key=lambda i: (-lengths[i], i))
    out: np.ndarray | None = None
    starts = range(0, len(order), batch_size)
    for s in tqdm(starts, desc="embedding", unit="batch", disable=not progress, leave=False):
        rows = order[s:s + batch_size]
        feeds = encoder.encode([texts[i] for i in rows])
        got = rt.run(feeds, sparsity=0.0)
        emb = got["sentence_embedding"] if "sentence_embedding" in got else mean_pool(got["last_hidden_state"],
                                                                                      feeds["attention_mask"])
        if out is None:
            out = np.empty((len(texts), emb.shape[1]), dtype=np.float32)
        out[rows] = emb
    return normalize(out)


def normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32; zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def faiss_index(vectors: np.ndarray, hnsw: bool = False):
    """An exact inner-product index (``IndexFlatIP``), or HNSW over inner products, holding ``vectors``."""
    import faiss

    dims = vectors.shape[1]
    if hnsw:
        index = faiss.IndexHNSWFlat(dims, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
        index.hnsw.efSearch = HNSW_EF_SEARCH
    else:
        index = faiss.IndexFlatIP(dims)
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    return index


def build_index(directory: str | Path, corpus: str | Path, id_field: str = "id", text_field: str = "text",
                hnsw: bool = False, batch_size: int = 64, overwrite: bool = False, progress: bool = True,
                echo: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Embed ``corpus`` with DIR's dense model and write ``DIR/index/``; returns the manifest entry.

    Raises:
        UserError: a bad corpus or directory, an index already there without ``overwrite``, a bad
            batch size; nothing is written then.
    """
    root = existing_dir(directory)
    manifest = Manifest.load(root)
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be at least 1")
    docs = read_corpus(corpus, id_field, text_field)
    if (root / INDEX_DIR).exists() and not overwrite:
        raise UserError(f"{root / INDEX_DIR} exists; pass --overwrite to replace it")
    rt, encoder = dense_encoder(root)
    vectors = embed(rt, encoder, docs.texts, batch_size, progress)
    echo(f"embedded {len(docs.ids)} documents ({vectors.shape[1]} dims)")
    entry = _entry(root, manifest, docs, vectors.shape[1], hnsw)
    _write_atomically(root, lambda tmp: _write_files(tmp, docs, faiss_index(vectors, hnsw), entry))
    manifest = Manifest.load(root)
    manifest.index = entry
    manifest.write(root)
    return entry


def _entry(root: Path, manifest: Manifest, docs: Corpus, dims: int, hnsw: bool) -> dict[str, Any]:
    dense = manifest.dense.onnx
    kind: dict[str, Any] = {"kind": "hnsw", "hnsw_m": HNSW_M, "ef_search": HNSW_EF_SEARCH} if hnsw else {"kind": "flat"}
    return {"build": uuid.uuid4().hex, "dir": INDEX_DIR, "file": f"{INDEX_DIR}/{INDEX_FILE}", "ids": f"{INDEX_DIR}/{IDS_FILE}",
            "docs": f"{INDEX_DIR}/{DOCS_FILE}", "count": len(docs.ids), "dims": dims, "metric": METRIC,
            "normalized": True, **kind, "corpus": docs.describe(),
            "model": {"fingerprint": manifest.model.fingerprint, "onnx": dense,
                      "onnx_sha256": file_sha256(root / dense), "sparsity": 0.0}}


def _write_files(folder: Path, docs: Corpus, index, entry: dict[str, Any]) -> None:
    """The build's files; ``build.json`` holds its entry, so a server reads the folder without the manifest
    (which is written after the folder is in place)."""
    import faiss

    faiss.write_index(index, str(folder / INDEX_FILE))
    (folder / IDS_FILE).write_text(json.dumps(docs.ids))
    with open(folder / DOCS_FILE, "w", encoding="utf-8") as f:
        for doc_id, text in zip(docs.ids, docs.texts):
            f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
    (folder / BUILD_FILE).write_text(json.dumps(entry))


def _write_atomically(root: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` into a fresh folder inside ``root``, then rename it to ``root/index`` (the old
    one, if any, moved aside first and removed after; restored if the rename fails)."""
    final = root / INDEX_DIR
    tmp = Path(tempfile.mkdtemp(prefix=f".{INDEX_DIR}.", suffix=".tmp", dir=root))
    old = None
    try:
        write(tmp)
        os.chmod(tmp, 0o777 & ~_umask())
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{INDEX_DIR}.", suffix=".old", dir=root))
            os.replace(final, old / INDEX_DIR)
        os.replace(tmp, final)
    except BaseException:
        if old is not None and not final.exists():
            os.replace(old / INDEX_DIR, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    from elastic_export.core.fileio import umask

    return umask()
