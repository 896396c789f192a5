"""OpenAI's embeddings API, the parts that need no server: request checking (one clear message per
mistake, in OpenAI's error shape), tokens, and the response body. Used by
:mod:`elastic_export.serving.http_api`."""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from elastic_export.serving.router_budgets import TOLERANCE

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
SEP = "@"  # model ids NAME@SPARSITY name a budget


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
             503: "server_error", 500: "server_error", 502: "server_error", 504: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class Tokens:
    """One input, tokenized: the model's ids and token types."""

    ids: list[int]
    types: list[int]


def parse_sparsity(value: Any, param: str) -> float | None:
    """A sparsity in [0, 1) (None when not given); ApiError 400 otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 <= value < 1:
        raise ApiError(400, f"{param} must be a number in [0, 1), got {value!r}", param, "invalid_sparsity")
    return float(value)


def resolve_model(model: Any, name: str, sparsity: float | None) -> float | None:
    """The sparsity a request asks for through ``model`` (NAME or NAME@S) and the ``sparsity`` field.

    Raises:
        ApiError: 400 for a model that is not a string or names another sparsity than the field; 404
            for a model that is not NAME or NAME@S.
    """
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", "model", "invalid_model")
    base, sep, tail = model.partition(SEP)
    if base != name:
        raise ApiError(404, f"The model '{model}' does not exist; GET /v1/models lists the served ones",
                       "model", "model_not_found")
    if not sep:
        return sparsity
    try:
        named = parse_sparsity(float(tail), "model")
    except ValueError:
        raise ApiError(404, f"The model '{model}' does not exist; GET /v1/models lists the served ones",
                       "model", "model_not_found")
    if sparsity is not None and abs(sparsity - named) > TOLERANCE:  # the same budget, as the router reads it
        raise ApiError(400, f"model '{model}' names sparsity {named:g}, the 'sparsity' field {sparsity:g}",
                       "sparsity", "conflicting_sparsity")
    return named


QUERY, DOCUMENT = "query", "document"
TYPE_SEP = ":"  # model ids NAME:query / NAME:document name an input type
# input_type as OpenAI-compatible clients of Cohere, Voyage and Jina spell it
INPUT_TYPES = {"query": QUERY, "search_query": QUERY, "retrieval.query": QUERY,
               "document": DOCUMENT, "search_document": DOCUMENT, "retrieval.passage": DOCUMENT,
               "passage": DOCUMENT, "classification": DOCUMENT, "clustering": DOCUMENT}


@dataclass(frozen=True)
class Asked:
    """What a request asks for: its input type (``query`` / ``document``) and the sparsity it names."""

    input_type: str
    sparsity: float | None


def resolve_request(model: Any, name: str, sparsity: Any, input_type: Any, default: str | None = None) -> Asked:
    """The input type and sparsity of a request from ``model`` (NAME, NAME@S, NAME:query, NAME:document),
    ``sparsity`` and ``input_type``.

    Documents are embedded dense: the index is dense, only queries are elastic. A request that states no
    type is a document unless it names a sparsity, so that a vector store filled through a client that
    knows nothing of input types holds dense vectors only (a wrong guess costs capacity, never the index).
    ``default`` replaces that rule (search: a query).

    Raises:
        ApiError: 400 for an unknown input type, a type or sparsity that conflicts with the model id, or a
            sparsity named for documents; 404 for a model id this server does not serve.
    """
    base, sep, kind = (model.partition(TYPE_SEP) if isinstance(model, str) else (model, "", ""))
    if sep and kind not in (QUERY, DOCUMENT):
        raise ApiError(404, f"The model '{model}' does not exist; GET /v1/models lists the served ones",
                       "model", "model_not_found")
    named = resolve_model(base, name, parse_sparsity(sparsity, "sparsity"))
    asked = _input_type(input_type)
    if asked is not None and sep and asked != kind:
        raise ApiError(400, f"model '{model}' names input type {kind}, 'input_type' {input_type!r}", "input_type",
                       "conflicting_input_type")
    kind = asked or kind or default or (QUERY if named is not None else DOCUMENT)
    if kind == DOCUMENT and named is not None and named > 0:
        raise ApiError(400, f"documents are embedded dense (the index is dense, only queries are elastic): name "
                            f"sparsity {named:g} only with input_type 'query'", "sparsity", "sparse_document")
    return Asked(kind, named)


def _input_type(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in INPUT_TYPES:
        raise ApiError(400, f"'input_type' must be one of {', '.join(sorted(INPUT_TYPES))}, got {value!r}",
                       "input_type", "invalid_input_type")
    return INPUT_TYPES[value]


def _is_tokens(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def input_items(value: Any, param: str = "input") -> list[str] | list[list[int]]:
    """``input`` as a list of strings or of token arrays (never mixed); ApiError 400 / 413."""
    if isinstance(value, str):
        items: list = [value]
    elif _is_tokens(value) and value:
        items = [value]
    elif isinstance(value, list) and value and (all(isinstance(x, str) for x in value) or all(_is_tokens(x) for x in value)):
        items = value
    else:
        raise ApiError(400, f"'{param}' must be a string, a list of strings, a token array or a list of token "
                            f"arrays (not empty)", param, "invalid_input")
    if len(items) > MAX_INPUTS:
        raise ApiError(413, f"'{param}' has {len(items)} items, more than the {MAX_INPUTS} a request may have",
                       param, "too_many_inputs")
    empty = next((i for i, x in enumerate(items) if (not x.strip() if isinstance(x, str) else not x)), None)
    if empty is not None:
        raise ApiError(400, f"'{param}'[{empty}] is empty", param, "invalid_input")
    return items


def tokenize(encoder: Any, items: Sequence[str] | Sequence[list[int]], max_len: int, vocab: int) -> list[Tokens]:
    """The model's tokens of every input: strings through the model's tokenizer (truncated as the
    runtime truncates them), token arrays as given (ApiError 400 when longer than the model takes
    or outside its vocabulary)."""
    if isinstance(items[0], str):
        out = []
        for e in encoder.tokenizer.encode_batch(list(items)):  # padded to the longest: keep the real tokens
            n = sum(e.attention_mask)
            out.append(Tokens(list(e.ids[:n]), list(e.type_ids[:n])))
        return out
    out = []
    for i, ids in enumerate(items):
        if len(ids) > max_len:
            raise ApiError(400, f"'input'[{i}] has {len(ids)} tokens, more than the model's {max_len}", "input",
                           "context_length_exceeded")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ApiError(400, f"'input'[{i}] holds a token id outside the model's vocabulary [0, {vocab})", "input",
                           "invalid_input")
        out.append(Tokens(list(ids), [0] * len(ids)))
    return out


def feeds(rows: Sequence[Tokens], input_names: Sequence[str], pad_id: int) -> dict[str, np.ndarray]:
    """The model's inputs for ``rows``, padded to the longest (as the model's tokenizer pads)."""
    width = max(len(r.ids) for r in rows)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    types = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)], mask[i, :len(r.ids)], types[i, :len(r.types)] = r.ids, 1, r.types
    arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
    return {n: arrays[n] for n in input_names}


def encoding_format(value: Any) -> str:
    if value is None:
        return "float"
    if value not in ("float", "base64"):
        raise ApiError(400, f"'encoding_format' must be 'float' or 'base64', got {value!r}", "encoding_format",
                       "invalid_encoding_format")
    return value


def check_dimensions(value: Any, dims: int | None) -> None:
    """``dimensions`` is accepted only when it is the model's own (this model has no shortened embeddings)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value != dims:
        raise ApiError(400, f"'dimensions' {value!r} is not supported: this model's embeddings have {dims} "
                            f"dimensions and cannot be shortened", "dimensions", "unsupported_dimensions")


def embedding_data(vectors: np.ndarray, fmt: str) -> list[dict[str, Any]]:
    """OpenAI's ``data`` list: float lists, or base64 of little-endian float32."""
    v = np.ascontiguousarray(vectors, dtype="<f4")
    if fmt == "base64":
        return [{"object": "embedding", "index": i, "embedding": base64.b64encode(row.tobytes()).decode("ascii")}
                for i, row in enumerate(v)]
    return [{"object": "embedding", "index": i, "embedding": row.tolist()} for i, row in enumerate(v)]
