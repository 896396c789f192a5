"""elastic-export search model for Triton's Python backend: query text in, the dense index's top-k out.

``elastic-export build triton`` (and ``serve``) copy this file verbatim into ``<repository>/<name>_search/1/
model.py`` when the artifact directory holds an index (``elastic-export index``), next to hard links of the
index's files (``1/index/``) and the tokenizer (``1/tokenizer/``). It is glue: the checks, the pooling and the
search are :mod:`elastic_export.index.search` (plain Python, tested without a server), imported from the
project's Python, which ``serve`` runs the server with (as the router imports the SLO policy).

Inputs: ``text`` (BYTES ``[-1]``, one query per row), ``top_k`` (INT32 ``[1]``, optional, default 10, at
most 1000 and the documents indexed; or a ``top_k`` request parameter), ``sparsity`` (FP32 ``[-1, 1]``,
optional, as the router's: one for every row or one per row; or a ``sparsity`` request parameter).
Outputs: ``ids`` (BYTES ``[rows, top_k]``, the corpus ids as strings), ``scores`` (FP32 ``[rows, top_k]``,
cosine similarity, best first), ``served_sparsity`` (FP64 ``[rows, 1]``, from the router) and, only when
asked for, ``texts`` (BYTES ``[rows, top_k]``, the documents).

Each query is encoded by the **router** (BLS), so search is load like any other request: the router's
load-adaptive policy picks the budget (or serves the one named), and its admission refuses what would
miss the SLO. The index is the dense model's, searched whatever the budget: the corpus is never
re-embedded. A client's mistake is an ``INVALID_ARG`` error (HTTP 400, one line); the router's refusals
keep their code (an overload is ``UNAVAILABLE``, HTTP 503, retryable). As in the router, ``execute`` checks
a request and hands it to a worker thread, so requests wait for the router side by side, never in line.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import numpy as np

from elastic_export.index import search as S

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server (the builder, the tests): no model class at work
    pb_utils = None


class RouterFailure(Exception):
    """The router's error response: its code's name (None where the backend has no codes) and message."""

    def __init__(self, code: Optional[str], message: str):
        super().__init__(message)
        self.code = code


def _error_response(message: str, code: str) -> Any:
    """An error response with ``code`` (``INVALID_ARG``: HTTP 400; ``UNAVAILABLE``: 503; ``INTERNAL``: 500)."""
    kind = getattr(pb_utils.TritonError, code, None)
    try:
        error = pb_utils.TritonError(message, kind) if kind is not None else pb_utils.TritonError(message)
    except TypeError:  # an older backend without error codes
        error = pb_utils.TritonError(message)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _code_name(error: Any) -> Optional[str]:
    """The error's code by name (Triton 2.51 gives a BLS caller ``INTERNAL`` for every error: then the
    message decides, :func:`elastic_export.index.search.failure_code`)."""
    code = error.code() if hasattr(error, "code") else None
    for name in ("INVALID_ARG", "UNAVAILABLE", "INTERNAL", "NOT_FOUND", "UNKNOWN", "CANCELLED"):
        if code is not None and code == getattr(pb_utils.TritonError, name, object()):
            return name
    return None


class TritonPythonModel:
    """Encodes each request's queries through the router and searches the index with them."""

    def initialize(self, args: Dict[str, str]) -> None:
        if pb_utils is None:
            raise RuntimeError("the search model runs inside Triton's Python backend (triton_python_backend_utils)")
        self.settings = S.SearchSettings.from_config(json.loads(args["model_config"]))
        here = os.path.join(args["model_repository"], str(args["model_version"]))
        self.searcher = S.Searcher.from_folder(here, self.settings)
        if hasattr(pb_utils, "is_model_ready"):
            from elastic_export.serving.router_health import wait_ready

            wait_ready([self.settings.router], self.settings.ready_timeout_s,
                       lambda m: pb_utils.is_model_ready(model_name=m))
        self._pool = ThreadPoolExecutor(max_workers=self.settings.concurrency, thread_name_prefix="search")

    def execute(self, requests: List[Any]) -> None:
        """Check each request here (a mistake is answered at once), then hand it to a worker thread."""
        for request in requests:
            try:
                job = self._accept(request)
            except S.SearchError as e:
                self._send(request, _error_response(str(e), "INVALID_ARG"))
                continue
            self._pool.submit(self._serve, request, job)
        return None

    def _accept(self, request: Any) -> Dict[str, Any]:
        from elastic_export.serving.router_budgets import BudgetError, choose_budget, row_sparsities

        text = pb_utils.get_input_tensor_by_name(request, S.TEXT_INPUT)
        if text is None:
            raise S.SearchError(f"missing input {S.TEXT_INPUT!r} (BYTES, one query per row)")
        texts = S.decode_texts(text.as_numpy().reshape(-1))
        S.check_rows(len(texts), self.settings.max_rows)
        params = request.parameters() if hasattr(request, "parameters") else None
        top_k = pb_utils.get_input_tensor_by_name(request, S.TOP_K_INPUT)
        k = S.parse_top_k(None if top_k is None else top_k.as_numpy().reshape(-1).tolist(), params,
                          self.searcher.count)
        sparsity = pb_utils.get_input_tensor_by_name(request, S.SPARSITY_INPUT)
        budgets = self.settings.sparsities
        try:
            rows = row_sparsities(None if sparsity is None else sparsity.as_numpy().reshape(-1).tolist(), params,
                                  len(texts))
            for r in set(rows or ()) if budgets else ():  # the router's refusal would come back as INTERNAL
                choose_budget(r, budgets, budgets[0])
        except BudgetError as e:
            raise S.SearchError(str(e)) from None
        wanted = list(request.requested_output_names()) if hasattr(request, "requested_output_names") else []
        return {"texts": texts, "top_k": k, "sparsity": rows, "wanted": wanted}

    def _serve(self, request: Any, job: Dict[str, Any]) -> None:
        """A worker: the router's embeddings, the search, the response (an error one if anything fails)."""
        try:
            response = self._answer(job)
        except RouterFailure as e:
            response = _error_response(str(e), S.failure_code(e.code, str(e)))
        except S.SearchError as e:
            response = _error_response(str(e), "INVALID_ARG")
        except Exception as e:  # a bug: answer it, never leave the client waiting
            response = _error_response(f"search: {e}", "INTERNAL")
        self._send(request, response)

    def _answer(self, job: Dict[str, Any]) -> Any:
        feeds = self.searcher.feeds(job["texts"])
        inputs = [pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in feeds.items()]
        rows = job["sparsity"]
        if rows is not None:
            same = all(r == rows[0] for r in rows)
            inputs.append(pb_utils.Tensor(S.SPARSITY_INPUT, np.array(rows[:1] if same else rows,
                                                                     dtype=np.float32).reshape(-1, 1)))
        response = pb_utils.InferenceRequest(model_name=self.settings.router, inputs=inputs,
                                             requested_output_names=[self.settings.output, S.SERVED_OUTPUT]).exec()
        if response.has_error():
            raise RouterFailure(_code_name(response.error()), response.error().message())
        outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
        wanted = job["wanted"] or [n for n in S.OUTPUTS if n != S.TEXTS_OUTPUT]
        found = self.searcher.results(self.searcher.embeddings(outputs, feeds), job["top_k"], S.TEXTS_OUTPUT in wanted)
        found[S.SERVED_OUTPUT] = np.asarray(outputs[S.SERVED_OUTPUT], dtype=np.float64).reshape(-1, 1)
        return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, found[n]) for n in wanted])

    def _send(self, request: Any, response: Any) -> None:
        request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
