"""Search as a Triton model: what the ``elastic_search`` model of a repository does, as plain Python.

The model file (:mod:`elastic_export.targets.triton_search`, copied verbatim as the model's ``model.py``) is
glue: it reads the request's tensors, calls the router (BLS) with what :meth:`Searcher.feeds` makes of the
texts, and answers with what :meth:`Searcher.results` makes of the router's embeddings. Everything that
decides something lives here, importable and tested without a server:

* the model's settings (:class:`SearchSettings`, from its ``config.pbtxt`` parameters),
* the request's checks (:func:`decode_texts`, :func:`check_rows`, :func:`parse_top_k`): a client's
  mistake is a :class:`SearchError` (answered ``INVALID_ARG``, HTTP 400, one line),
* the search itself (:class:`Searcher`: the dense FAISS index of :class:`~elastic_export.index.store.DenseIndex`,
  loaded once; queries pooled as the index's documents were, L2-normalised, searched),
* how a failure of the router is answered (:func:`failure_code`: its refusals keep their code, so an
  overload stays ``UNAVAILABLE``, HTTP 503, retryable).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from elastic_export.index import DOCS_FILE, IDS_FILE, INDEX_FILE

TEXT_INPUT, TOP_K_INPUT, SPARSITY_INPUT = "text", "top_k", "sparsity"
IDS_OUTPUT, SCORES_OUTPUT, SERVED_OUTPUT, TEXTS_OUTPUT = "ids", "scores", "served_sparsity", "texts"
OUTPUTS = (IDS_OUTPUT, SCORES_OUTPUT, SERVED_OUTPUT, TEXTS_OUTPUT)
DEFAULT_TOP_K = 10
MAX_TOP_K = 1000
INDEX_FOLDER = "index"  # in the model's version folder: the index files and ENTRY_FILE
ENTRY_FILE = "entry.json"  # the manifest's index entry the files were placed from
TOKENIZER_FOLDER = "tokenizer"  # in the model's version folder
ROUTER_PARAMETER = "router"
OUTPUT_PARAMETER = "embedding_output"
INPUTS_PARAMETER = "model_inputs"
MAX_ROWS_PARAMETER = "max_rows"
THREADS_PARAMETER = "search_threads"
CONCURRENCY_PARAMETER = "max_concurrency"
READY_TIMEOUT_PARAMETER = "ready_timeout_s"
BUDGETS_PARAMETER = "budgets"
_UNAVAILABLE_MARKERS = ("retry later", "overloaded", "unavailable", "not ready", "unknown model", "not found",
                        "not healthy")


class SearchError(ValueError):
    """A search request the model refuses: the client's mistake (the message goes back, one line)."""


@dataclass(frozen=True)
class SearchSettings:
    """The search model's ``config.pbtxt`` parameters.

    Attributes:
        router: the router model the queries are encoded by.
        output: the router output that holds the embeddings (``sentence_embedding``, or
            ``last_hidden_state``: mean-pooled here under the attention mask, as the index's documents were).
        inputs: the model inputs the tokenizer makes (``input_ids``, ``attention_mask`` ...).
        max_rows: the most queries a request may have (the router's ``max_rows``).
        threads: FAISS's threads per search (1: requests searched on several worker threads at once).
        concurrency: requests the model works on at once (its worker threads).
        ready_timeout_s: how long ``initialize`` waits for the router to be READY.
        sparsities: the budgets the router serves (a sparsity a request names is checked against them
            here: the router's own refusal reaches the search model without its code).
    """

    router: str
    output: str
    inputs: tuple[str, ...]
    max_rows: int = 128
    threads: int = 1
    concurrency: int = 64
    ready_timeout_s: float = 300.0
    sparsities: tuple[float, ...] = ()

    @classmethod
    def from_config(cls, model_config: dict[str, Any]) -> "SearchSettings":
        """The settings of a model config as Triton passes it (``json.loads(args["model_config"])``).

        Raises:
            ValueError: a parameter missing or not a number.
        """
        p = {k: (v or {}).get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        missing = [k for k in (ROUTER_PARAMETER, OUTPUT_PARAMETER, INPUTS_PARAMETER) if not p.get(k)]
        if missing:
            raise ValueError(f"config.pbtxt has no parameter {missing[0]!r}")
        return cls(p[ROUTER_PARAMETER], p[OUTPUT_PARAMETER], tuple(json.loads(p[INPUTS_PARAMETER])),
                   int(p.get(MAX_ROWS_PARAMETER) or 128), int(p.get(THREADS_PARAMETER) or 1),
                   int(p.get(CONCURRENCY_PARAMETER) or 64), float(p.get(READY_TIMEOUT_PARAMETER) or 300),
                   tuple(float(x) for x in json.loads(p.get(BUDGETS_PARAMETER) or "[]")))

    def parameters(self) -> dict[str, str]:
        """The ``config.pbtxt`` parameters that :meth:`from_config` reads back."""
        return {ROUTER_PARAMETER: self.router, OUTPUT_PARAMETER: self.output, INPUTS_PARAMETER: json.dumps(list(self.inputs)),
                MAX_ROWS_PARAMETER: str(self.max_rows), THREADS_PARAMETER: str(self.threads),
                CONCURRENCY_PARAMETER: str(self.concurrency), READY_TIMEOUT_PARAMETER: repr(float(self.ready_timeout_s)),
                BUDGETS_PARAMETER: json.dumps(list(self.sparsities))}


# --- the request's checks -------------------------------------------------------------------------
def decode_texts(values: Sequence[Any]) -> list[str]:
    """The ``text`` input's queries (UTF-8 bytes or strings, one per row).

    Raises:
        SearchError: bytes that are not UTF-8, or an empty query.
    """
    from elastic_export.models.text import decode_utf8

    out = decode_utf8(values, SearchError)
    empty = next((i for i, v in enumerate(out) if not v.strip()), None)
    if empty is not None:
        raise SearchError(f"text {empty} is empty")
    return out


def check_rows(rows: int, max_rows: int) -> None:
    """Raises:
        SearchError: no queries, or more than ``max_rows``."""
    if rows < 1:
        raise SearchError(f"the request has no queries: send the {TEXT_INPUT!r} input, one query per row")
    if rows > max_rows:
        raise SearchError(f"the request has {rows} queries, more than the {max_rows} a request may have; split it")


def parse_top_k(values: Sequence[Any] | None, parameters: str | None, count: int) -> int:
    """The ``top_k`` input (one INT32 value), else the request parameter ``top_k``, else
    :data:`DEFAULT_TOP_K` (at most the documents there are).

    Raises:
        SearchError: not one integer, or outside 1 .. min(:data:`MAX_TOP_K`, documents).
    """
    limit = min(MAX_TOP_K, count)
    value: Any = None
    if values is not None:
        flat = list(values)
        if len(flat) != 1:
            raise SearchError(f"{TOP_K_INPUT} has {len(flat)} values; send one (shape [1])")
        value = flat[0]
    elif parameters:
        try:
            value = json.loads(parameters).get(TOP_K_INPUT)
        except (ValueError, AttributeError):
            raise SearchError("request parameters are not a JSON object") from None
    if value is None:
        return min(DEFAULT_TOP_K, limit)
    if isinstance(value, (bool, np.bool_)) or not _integral(value):
        raise SearchError(f"{TOP_K_INPUT} must be an integer in [1, {limit}], got {value!r}")
    k = int(value)
    if not 1 <= k <= limit:
        why = f"the index holds {count} documents" if count < MAX_TOP_K else f"at most {MAX_TOP_K}"
        raise SearchError(f"{TOP_K_INPUT} {k} is outside [1, {limit}] ({why})")
    return k


def _integral(value: Any) -> bool:
    if isinstance(value, (int, np.integer)):
        return True
    return isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer()


def failure_code(code: str | None, message: str) -> str:
    """How the search model answers a router failure: the router's own code when it is ``INVALID_ARG``
    (the client's mistake) or ``UNAVAILABLE`` (overload, no budget up: retryable); without one (Triton
    2.51's Python backend hands a BLS caller every error as ``INTERNAL``), ``UNAVAILABLE`` for what reads as
    an overload (the router's refusals all say "retry later") or a router that is not there; else
    ``INTERNAL``."""
    if code in ("INVALID_ARG", "UNAVAILABLE"):
        return code
    text = message.lower()
    return "UNAVAILABLE" if any(m in text for m in _UNAVAILABLE_MARKERS) else "INTERNAL"


# --- the search -----------------------------------------------------------------------------------
class Searcher:
    """The index (loaded once) and the tokenizer of a search model's version folder.

    Args:
        index: the dense index (:class:`~elastic_export.index.store.DenseIndex`).
        encoder: the tokenizer (:class:`~elastic_export.models.text.TextEncoder`).
        settings: the model's settings (the router's embedding output).
    """

    def __init__(self, index: Any, encoder: Any, settings: SearchSettings):
        self.index, self.encoder, self.settings = index, encoder, settings
        self.count = int(index.count)
        self._ids = np.array([str(i).encode("utf-8") for i in index.ids] + [b""], dtype=object)  # [-1]: no hit
        self._texts: np.ndarray | None = None

    @classmethod
    def from_folder(cls, folder: str | Path, settings: SearchSettings) -> "Searcher":
        """The searcher of a version folder: ``index/`` (the index files and ``entry.json``) and ``tokenizer/``;
        FAISS set to ``settings.threads`` threads (for the process)."""
        import faiss

        from elastic_export.index.store import DenseIndex
        from elastic_export.models.text import TextEncoder

        faiss.omp_set_num_threads(settings.threads)
        here = Path(folder)
        files = here / INDEX_FOLDER
        entry = json.loads((files / ENTRY_FILE).read_text())
        index = DenseIndex.open(files / INDEX_FILE, files / IDS_FILE, files / DOCS_FILE, entry)
        return cls(index, TextEncoder.from_dir(here / TOKENIZER_FOLDER, settings.inputs), settings)

    def feeds(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """The router's inputs for ``texts`` (int64, padded to the longest), as the index's documents were made."""
        return self.encoder.encode(list(texts))

    def embeddings(self, outputs: dict[str, np.ndarray], feeds: dict[str, np.ndarray]) -> np.ndarray:
        """The query embeddings of the router's ``outputs``: its pooled output, or ``last_hidden_state``
        mean-pooled under the attention mask (as the index's documents were)."""
        got = np.asarray(outputs[self.settings.output], dtype=np.float32)
        if got.ndim == 3:
            from elastic_export.models.text import mean_pool

            got = mean_pool(got, feeds["attention_mask"])
        return got

    def results(self, embeddings: np.ndarray, top_k: int, with_text: bool = False) -> dict[str, np.ndarray]:
        """The ``top_k`` best documents of each query: ``ids`` (BYTES ``[rows, top_k]``, the corpus ids as
        strings), ``scores`` (FP32, cosine similarity, best first) and, ``with_text``, ``texts``. A place the
        index left empty (HNSW may) has id ``b""`` and score ``-inf``."""
        scores, positions = self.index.search(embeddings, top_k)
        scores = np.where(positions >= 0, scores, -np.inf).astype(np.float32)
        out = {IDS_OUTPUT: self._ids[positions], SCORES_OUTPUT: scores}
        if with_text:
            if self._texts is None:
                self._texts = np.array([t.encode("utf-8") for t in self.index.texts] + [b""], dtype=object)
            out[TEXTS_OUTPUT] = self._texts[positions]
        return out
