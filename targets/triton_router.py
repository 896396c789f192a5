"""elastic-export router for Triton's Python backend: each request (or each row) to a budget model.

This file is copied verbatim into ``<repository>/<name>/1/model.py`` by ``elastic-export build
triton`` (:func:`elastic_export.targets.triton.build_repository`); it is also an ordinary module of
the package (``elastic_export.targets.triton_router``), linted and unit-tested. Its core imports the
standard library and numpy only, plus Triton's in-server ``triton_python_backend_utils`` when that
exists. Two features import more, only when the config asks for them: load-adaptive routing
(``policy: adaptive``) imports :mod:`elastic_export.serving.slo` (the standard library only), and the ``text`` input imports
:mod:`elastic_export.models.text` (the ``tokenizers`` library); ``elastic-export serve`` runs the server with
the project's own Python, where both are installed.

Everything that differs between repositories lives in the router's ``config.pbtxt``: its
``parameters`` (``budget_models``: JSON ``[[sparsity, model name], ...]``; ``default_sparsity``;
``policy``; ``slo_ms``, ``slo_quantile``, ``max_sparsity``; ``precision``; ``max_rows``) and its
``input`` / ``output`` lists (forwarded to the budget model, less the router's own tensors). Triton hands that config to
:meth:`TritonPythonModel.initialize` as JSON (``args["model_config"]``).

Rule: a requested sparsity within :data:`TOLERANCE` of a served budget gets that budget; otherwise
the smallest served budget whose sparsity is *at least* the requested one (more savings, never
less). A request outside [0, 1), not a number, or sparser than the sparsest served budget is
refused with :class:`BudgetError`, as is one with a missing input, inputs of different batch sizes, no
rows or more than ``max_rows``: ``execute`` answers it with an ``INVALID_ARG`` error (HTTP 400) before
anything is counted. A request that names no sparsity gets the configured default (``policy: fixed``)
or the best-quality budget whose predicted latency meets the SLO (``policy: adaptive``,
:class:`SloRouting`); one predicted to miss the SLO behind the rows in flight at its budget is refused
with ``UNAVAILABLE`` (HTTP 503, retryable: :class:`Overload`). A budget model that fails as gone is
routed around (:class:`BudgetHealth`) and probed until it answers again.

No head-of-line blocking: once it has checked a request, ``execute`` hands it to a worker thread
(``max_concurrency`` of them) and returns; each worker calls the budget model (BLS) and answers
through the request's response sender, so a small request never waits behind a large one. (Threads rather
than ``async`` BLS: measured here, a synchronous BLS call in a worker adds less latency.) (Nor are
requests answered in ``execute`` itself when the router is idle: that saves the thread handoff and
the response sender, about 0.2 ms at batch 1, but requests arriving meanwhile wait, and under load
the budget models then batch less: measured here, the load test's late requests grew several-fold.)
The router does not batch (``max_batch_size: 0``); the budget models' dynamic batchers do.

Inline runs (``inline: "1"``, written for Python budget models, whose Python has onnxruntime): the
router opens a session on each budget model's own ``1/model.onnx`` at load and runs a request there
when nothing else is in flight (one budget for every row) and (adaptive policy) the estimated load is
light, instead of the BLS round trip through the server process (about 1 ms on a 2-CPU machine, more
than the router's own work); with other requests in flight, or a load at which the next one likely
arrives during the run, it forwards, so that the budget models' dynamic batchers batch under load. The
sessions open and run on one thread of their own at the budget models' niceness (``nice``), so the
router's compute yields to the request path as theirs does (at a higher priority than the budget models,
a run started while idle would take the cores from the batches forwarded as the load rises).
"""

import asyncio
import json
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server (the builder, the tests): no model class at work
    pb_utils = None

TOLERANCE = 1e-6
PARAMETER = "sparsity"
QUEUED_PARAMETER = "queued_ms"  # request parameter: the ms its oldest row waited before it was sent
SPARSITY_INPUT = "sparsity"
TEXT_INPUT = "text"
SERVED_OUTPUT = "served_sparsity"
PRECISION_OUTPUT = "served_precision"
OWN_TENSORS = (SPARSITY_INPUT, TEXT_INPUT, SERVED_OUTPUT, PRECISION_OUTPUT)
MODELS_PARAMETER = "budget_models"
DEFAULT_PARAMETER = "default_sparsity"
POLICY_PARAMETER = "policy"
SLO_PARAMETER = "slo_ms"
PRECISION_PARAMETER = "precision"
READY_TIMEOUT_PARAMETER = "ready_timeout_s"
CONCURRENCY_PARAMETER = "max_concurrency"
INLINE_MAX_LOAD = 0.25  # adaptive policy: inline runs only while the estimated load is below this (SloRouting.light)
INLINE_PARAMETER = "inline"  # "1": the router runs a request itself when it has nothing else in flight
QUANTILE_PARAMETER = "slo_quantile"
MAX_SPARSITY_PARAMETER = "max_sparsity"
MAX_ROWS_PARAMETER = "max_rows"  # the budget models' max_batch_size: larger requests are refused
TOKENS_PARAMETER = "warmup_tokens"  # the model's nominal tokens (the latency model's measurements)
DEFAULT_CONCURRENCY = 64
DEFAULT_SLO_MS = 250.0  # the adaptive policy's objective when the config names none
DEFAULT_QUANTILE = 0.99
DEFAULT_MAX_ROWS = 128
POLICIES = ("fixed", "adaptive")
PROFILE_FILE = "latency_profile.json"  # next to model.py, copied from the artifact directory when it has one
TOKENIZER_DIR = "tokenizer"  # next to model.py, for the text input


class BudgetError(ValueError):
    """A request the router cannot serve (the message goes back to the client)."""


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise BudgetError(f"{where}: {value!r} is not a number")
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(s):
        raise BudgetError(f"{where}: {value!r} is not a finite number")
    return s


def choose_budget(requested: Optional[float], sparsities: Sequence[float], default: float) -> float:
    """The served budget for a requested sparsity.

    Args:
        requested: the sparsity asked for (fraction of prunable FLOPs removed), or None for the
            default.
        sparsities: the served budgets' sparsities (any order; 0.0 is the dense model).
        default: the budget served when nothing is requested (one of ``sparsities``).

    Returns:
        An element of ``sparsities``: the one within :data:`TOLERANCE` of ``requested``, else the
        smallest one above it.

    Raises:
        BudgetError: ``requested`` outside [0, 1) or above the sparsest served budget, or no budgets.
    """
    served = sorted(float(s) for s in sparsities)
    if not served:
        raise BudgetError("no budgets are served")
    if requested is None:
        return float(default)
    s = _number(requested, "sparsity")
    if not 0.0 <= s < 1.0:
        raise BudgetError(f"sparsity {s:g} is outside [0, 1); served budgets: {_listing(served)}")
    for b in served:
        if abs(b - s) <= TOLERANCE:
            return b
    for b in served:
        if b >= s:
            return b
    raise BudgetError(f"sparsity {s:g} is above the sparsest served budget {served[-1]:g}; "
                      f"served budgets: {_listing(served)}")


def row_sparsities(values: Optional[Sequence[Any]], parameters: Optional[str], batch: int) -> Optional[List[float]]:
    """The sparsity each row asks for: the ``sparsity`` input, else the ``sparsity`` parameter.

    Args:
        values: the flattened ``sparsity`` input (one value for every row, or one per row), or None
            when the request has no such input.
        parameters: the request's parameters as a JSON object string (``request.parameters()``).
        batch: the request's batch size.

    Returns:
        One sparsity per row, or None when the request names none (the policy / default applies).

    Raises:
        BudgetError: an input of another length, or a value / parameter that is not a number.
    """
    if values is not None:
        rows = [_number(v, "sparsity input") for v in values]
        if len(rows) == 1:
            return rows * batch
        if len(rows) != batch:
            raise BudgetError(f"sparsity input has {len(rows)} values for a batch of {batch}; send shape [1, 1] "
                              f"(one budget for every row) or [{batch}, 1] (one per row)")
        return rows
    if not parameters:
        return None
    try:
        params = json.loads(parameters)
    except ValueError:
        raise BudgetError("request parameters are not a JSON object") from None
    if not isinstance(params, dict) or params.get(PARAMETER) is None:
        return None
    return [_number(params[PARAMETER], "sparsity parameter")] * batch


def queued_ms(parameters: Optional[str]) -> float:
    """How long the request's oldest row waited before it was sent (ms; the API's ``queued_ms`` parameter,
    :mod:`elastic_export.serving.coalesce`); 0 when absent or not a non-negative number."""
    if not parameters or QUEUED_PARAMETER not in parameters:
        return 0.0
    try:
        value = float(json.loads(parameters).get(QUEUED_PARAMETER))
    except (ValueError, TypeError, AttributeError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _listing(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


# --- configuration: the router's config.pbtxt, as Triton passes it (JSON) ------------------------
class RouterConfig:
    """What the router reads from its model config (``json.loads(args["model_config"])``).

    Attributes:
        models: served sparsity -> budget model name.
        sparsities: the served sparsities, ascending.
        default: the sparsity served when a request names none (``policy: fixed``).
        policy: ``fixed`` or ``adaptive``.
        slo_ms: the latency objective of the adaptive policy (None: none).
        precision: the precision the budget models serve (``fp32`` / ``fp16``).
        inputs: the input names forwarded to the budget model.
        outputs: the output names the budget model answers with.
        text: whether the config declares the ``text`` input.
        ready_timeout_s: how long ``initialize`` waits for the budget models to be ready.
        max_concurrency: requests the router works on at once (its worker threads); more wait.
        inline: run a request on the budget's ``model.onnx`` in the router's own process when nothing
            else is in flight (see :class:`TritonPythonModel`).
        slo_quantile: the latency quantile the SLO bounds (0.99: p99).
        max_sparsity: the adaptive policy's quality floor (None: every budget).
        max_rows: the largest request (rows) the router accepts: the budget models' ``max_batch_size``.
        tokens: the model's nominal tokens (the free dims of the latency model's measurements).
        input_specs: the forwarded inputs' config entries (name, data_type, dims).
        parameters: every parameter, as text (the inline sessions read theirs: threads, spinning,
            warm-up length, as the python budget models do).
    """

    def __init__(self, model_config: Dict[str, Any]):
        params = {k: (v or {}).get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        self.models = {float(s): str(n) for s, n in _table(params.get(MODELS_PARAMETER))}
        self._chosen: Dict[Any, float] = {}  # requested sparsity -> served (route's memory)
        self.sparsities = sorted(self.models)
        if not self.sparsities:
            raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r} lists no budget models")
        default = params.get(DEFAULT_PARAMETER)
        self.default = choose_budget(_number(default, DEFAULT_PARAMETER) if default else self.sparsities[0],
                                     self.sparsities, self.sparsities[0])
        self.policy = params.get(POLICY_PARAMETER) or "fixed"
        if self.policy not in POLICIES:
            raise ValueError(f"config.pbtxt parameter {POLICY_PARAMETER!r}: {self.policy!r}, not one of {POLICIES}")
        slo = params.get(SLO_PARAMETER)
        self.slo_ms = _number(slo, SLO_PARAMETER) if slo else None
        self.precision = params.get(PRECISION_PARAMETER) or "fp32"
        self.ready_timeout_s = _number(params.get(READY_TIMEOUT_PARAMETER) or 300, READY_TIMEOUT_PARAMETER)
        self.max_concurrency = int(_number(params.get(CONCURRENCY_PARAMETER) or DEFAULT_CONCURRENCY,
                                           CONCURRENCY_PARAMETER))
        self.inline = params.get(INLINE_PARAMETER) == "1"
        self.slo_quantile = _number(params.get(QUANTILE_PARAMETER) or DEFAULT_QUANTILE, QUANTILE_PARAMETER)
        if not 0 < self.slo_quantile < 1:
            raise ValueError(f"config.pbtxt parameter {QUANTILE_PARAMETER!r}: {self.slo_quantile:g} is not in (0, 1)")
        floor = params.get(MAX_SPARSITY_PARAMETER)
        self.max_sparsity = _number(floor, MAX_SPARSITY_PARAMETER) if floor else None
        self.max_rows = int(_number(params.get(MAX_ROWS_PARAMETER) or DEFAULT_MAX_ROWS, MAX_ROWS_PARAMETER))
        self.tokens = int(_number(params.get(TOKENS_PARAMETER) or 16, TOKENS_PARAMETER))
        self.parameters = params
        specs = model_config.get("input", [])
        names = [t["name"] for t in specs]
        self.text = TEXT_INPUT in names
        self.inputs = [n for n in names if n not in OWN_TENSORS]
        self.input_specs = [t for t in specs if t["name"] in self.inputs]
        self.outputs = [t["name"] for t in model_config.get("output", []) if t["name"] not in OWN_TENSORS]

    def route(self, rows: Optional[List[float]], chosen: Optional[float] = None) -> List[float]:
        """The served sparsity of every row: each requested one mapped by :func:`choose_budget`, or
        ``chosen`` (the policy's pick; default: the configured default) when none is named."""
        if rows is None:
            return [self.default if chosen is None else chosen]
        first = rows[0] if rows else None
        if all(r == first for r in rows):  # one budget for every row, the usual case
            return [self._choose(first)] * len(rows)
        return [self._choose(r) for r in rows]

    def _choose(self, requested: Any) -> float:
        """:func:`choose_budget`, remembered for the values requests name (at most 1024 of them)."""
        served = self._chosen.get(requested)
        if served is None:
            served = choose_budget(requested, self.sparsities, self.default)
            if len(self._chosen) < 1024:
                self._chosen[requested] = served
        return served


def _table(text: Optional[str]) -> List[List[Any]]:
    """The ``budget_models`` parameter: a JSON list of ``[sparsity, model name]`` pairs."""
    if not text:
        raise ValueError(f"config.pbtxt has no parameter {MODELS_PARAMETER!r}")
    try:
        table = json.loads(text)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r} is not JSON: {text[:80]!r}") from None
    if not isinstance(table, list) or not all(isinstance(p, list) and len(p) == 2 for p in table):
        raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r}: expected [[sparsity, model name], ...]")
    return table


# --- what the router observes and decides --------------------------------------------------------
class Overload(Exception):
    """A request refused because it cannot be answered within the SLO (HTTP 503 / gRPC UNAVAILABLE:
    retryable); ``reason`` labels the refusal in the metrics."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class LoadMonitor:
    """Requests and rows in flight, as the router sees them.

    Attributes:
        in_flight: requests received and not yet answered.
        rows_at: per budget, the rows in flight there (what a new request sent there queues behind).
        last_arrival: when the latest request arrived (``clock``; None before the first).
        last_ticket: the latest arrival's ticket (what :meth:`leave` takes back).
    """

    def __init__(self, clock=time.monotonic):
        self.in_flight = 0
        self.rows_at: Dict[float, int] = {}
        self.last_arrival: Optional[float] = None
        self.last_ticket = 0
        self._since: Dict[float, Dict[int, Tuple[float, int]]] = {}  # budget -> ticket -> (arrival, rows)
        self._batch_start: Dict[float, float] = {}  # budget -> when its running batch began (as the router sees it)
        self._clock = clock

    def arrive(self, budget: Optional[float], rows: int) -> int:
        """Count an arrival of ``rows`` for ``budget`` (None: several); returns the rows ahead of it there."""
        self.last_arrival = now = self._clock()
        self.in_flight += 1
        self.last_ticket += 1
        if budget is None:
            return 0
        waiting = self._since.setdefault(budget, {})
        if not waiting:  # nothing in flight there: a batch starts with this one
            self._batch_start[budget] = now
        waiting[self.last_ticket] = (now, rows)
        ahead = self.rows_at.get(budget, 0)
        self.rows_at[budget] = ahead + rows
        return ahead

    def leave(self, budget: Optional[float], rows: int, ticket: Optional[int] = None) -> None:
        self.in_flight -= 1
        if budget is not None:
            left = self.rows_at.get(budget, 0) - rows  # rows cost fractions (their padded shape): no float residue
            self.rows_at[budget] = 0 if abs(left) < 1e-6 else left
            self._since.get(budget, {}).pop(ticket, None)
            self._batch_start[budget] = self._clock()  # an answer: the next batch takes what waits, now

    def oldest_ms(self, budget: float, now: float) -> float:
        """How long the oldest request in flight at ``budget`` has been waiting (ms; 0 when none)."""
        since = self._since.get(budget)
        return (now - min(t for t, _ in since.values())) * 1e3 if since else 0.0

    def running(self, budget: float, now: float) -> Tuple[int, float]:
        """The batch running at ``budget`` as the router sees it: the rows in flight there that arrived by the
        latest answer there (or by the arrival that found it idle), and the ms since then (0, 0 when none)."""
        start, since = self._batch_start.get(budget), self._since.get(budget)
        if start is None or not since:
            return 0, 0.0
        return sum(n for t, n in since.values() if t <= start), (now - start) * 1e3


class SloRouting:
    """The router's use of :class:`elastic_export.serving.slo.SloPolicy` (imported here, only for
    ``policy: adaptive``): the best-quality budget whose predicted latency quantile meets the SLO, and
    admission (a request predicted to miss the SLO behind the rows in flight at its budget is refused).

    Args:
        config: the router's configuration (SLO, quantile, quality floor, precision).
        points: per served budget, measured ``{batch: ms}`` service times.
        clock: seconds (monotonic).
    """

    def __init__(self, config: RouterConfig, points: Dict[float, Dict[int, float]], clock=time.monotonic):
        from elastic_export.serving import slo

        pairs = [(s, config.precision) for s in config.sparsities]
        service = slo.ServiceModel({(s, config.precision): points[s] for s in config.sparsities})
        self.policy = slo.SloPolicy(pairs, service, config.slo_ms or DEFAULT_SLO_MS, quantile=config.slo_quantile,
                                    max_sparsity=config.max_sparsity, rate=slo.RateEstimator(clock=clock))
        self.precision, self._clock = config.precision, clock
        self.last = None  # the latest decision

    def arrive(self, rows: int, work: Optional[float] = None) -> Any:
        """Count an arrival of ``rows`` rows costing ``work`` rows of the nominal length (default: ``rows``);
        the decision (pair, prediction, rate) for it."""
        now = self._clock()
        self.policy.rate.arrive(now, rows)
        self.policy.note_rows(rows, rows if work is None else work)
        self.last = self.policy.decide(now)
        return self.last

    def admit(self, budget: float, rows: int, ahead: int, waited_ms: float = 0.0,
              elsewhere: Optional[Dict[float, int]] = None, running: Tuple[int, float] = (0, 0.0),
              queued_ms: float = 0.0) -> float:
        """The request's uncorrected predicted latency (ms) at ``budget`` (what
        :meth:`~elastic_export.serving.slo.SloPolicy.admitted` takes back), or :class:`Overload` when it is
        predicted past the policy's admission limit (the SLO less its margin) behind ``ahead`` rows in flight
        there and ``elsewhere`` (rows in flight per other budget: they share the cores), by the model or by
        what they already waited (``waited_ms``: the oldest of them, measured; its own service comes on top).
        ``running``: the rows of the batch running there and how long it has run (ms,
        :meth:`LoadMonitor.running`): past its modelled time, the queued work is predicted at least as slow
        (:meth:`~elastic_export.serving.slo.SloPolicy.admit`'s ``live_slope``). ``queued_ms``: what the request
        waited before it reached the router (the API merging it with others), on top of every prediction. A
        request with nothing in flight ahead of it always runs, unless its wait already makes it late."""
        pair, policy = (budget, self.precision), self.policy
        others = self._others(budget, elsewhere)
        n_run, ran_ms = running
        live = ran_ms / policy.service.ms(pair, n_run) if n_run > 0 else 0.0
        ok, ms, raw = policy.admit(pair, rows, ahead, others, live_slope=live)
        ms += queued_ms
        ok = ok and ms <= policy.admission_limit_ms
        behind = queued_ms + waited_ms + policy.request_ms(pair, rows, 0)  # the oldest's wait so far, then its run
        if (ahead > 0 or others or queued_ms > 0) and (not ok or behind > policy.admission_limit_ms):
            raise Overload(f"overloaded: predicted {max(ms, behind):.0f} ms at sparsity {budget:g} exceeds the SLO "
                           f"of {policy.slo_ms:g} ms less its {policy.margin:.0%} margin; retry later", "overload")
        return raw

    def overflow(self, budget: float, rows: int, ahead: int, elsewhere: Optional[Dict[float, int]] = None,
                 allowed: Sequence[float] = ()) -> Optional[float]:
        """The fastest of ``allowed`` when a request the policy routed to ``budget`` is predicted past the
        policy's overflow limit behind ``ahead`` rows there and ``elsewhere`` (:meth:`~elastic_export.serving.
        slo.SloPolicy.overflows`); None otherwise."""
        others = self._others(budget, elsewhere)
        if not allowed or not self.policy.overflows((budget, self.precision), rows, ahead, others):
            return None
        return self.policy.fastest([(s, self.precision) for s in allowed])[0]

    def place(self, budget: float, rows: int, rows_at: Dict[float, int], waited_ms: Callable[[float], float],
              faster: Sequence[float] = (),
              running: Callable[[float], Tuple[int, float]] = lambda s: (0, 0.0),
              queued_ms: float = 0.0) -> Tuple[float, float]:
        """Where a request runs and its uncorrected prediction (:meth:`admit`): at ``budget``, else (a request
        the policy routed: ``faster``, the budgets it may move to) at the first of ``faster`` that admits it;
        first at the fastest when it overflows at ``budget`` (:meth:`overflow`: a queue building there), then
        back at ``budget`` and the others, so that a queue at the fastest refuses nothing another budget would
        answer in time. :class:`Overload` when none admits it. ``rows_at``: rows in flight per budget;
        ``waited_ms``: how long the oldest in flight at a budget has waited; ``running``: its running batch
        (:meth:`LoadMonitor.running`)."""
        order = [budget, *faster]
        fastest = self.overflow(budget, rows, rows_at.get(budget, 0), rows_at, faster)
        if fastest is not None:
            order.remove(fastest)
            order.insert(0, fastest)
        for s in order:
            try:
                return s, self.admit(s, rows, rows_at.get(s, 0), waited_ms(s), rows_at, running(s), queued_ms)
            except Overload:
                if s == order[-1]:
                    raise

    def _others(self, budget: float, elsewhere: Optional[Dict[float, int]]) -> Dict[Any, int]:
        """The rows in flight at budgets other than ``budget``, as the policy's pairs (those with any)."""
        return {(s, self.precision): n for s, n in (elsewhere or {}).items() if s != budget and n > 0}

    def light(self, budget: float) -> bool:
        """Whether the estimated load at ``budget`` is light enough for an inline run: rate x its batch-1
        service time below :data:`INLINE_MAX_LOAD`. Above it the next request likely arrives during the
        run, and forwarded it would compete for the cores with it instead of batching behind it."""
        one = self.policy.service.ms((budget, self.precision), self.policy.row_weight)  # a row as long as lately
        return self.rate() * one / 1e3 < INLINE_MAX_LOAD

    def rate(self) -> float:
        """The arrival rate the latest decision assumed (rows/s; 0 before the first)."""
        return self.last.rate if self.last is not None else 0.0

    def set_down(self, down: Sequence[float]) -> None:
        self.policy.unavailable = {(s, self.precision) for s in down}


def service_points(config: RouterConfig, sessions: Optional[Dict[float, Any]], profile_path: Optional[str],
                   tokens: int) -> Optional[Dict[float, Dict[int, float]]]:
    """Every budget's measured service times ``{batch: ms}``: measured here on the router's inline sessions
    (the serving machine, the budget models' session options) when it has them, else the directory's
    latency profile (every profiled batch size); None when neither covers every budget (then the router
    measures them through the budget models themselves, :meth:`TritonPythonModel._calibrate`)."""
    if sessions:
        from elastic_export.targets.triton_onnx_model import service_times

        return service_times(sessions, tokens)
    if profile_path and os.path.isfile(profile_path):
        from elastic_export.core.latency_profile import load_profile
        from elastic_export.serving.slo import service_points_from_profile

        points = service_points_from_profile(load_profile(profile_path).rows(config.precision), config.precision,
                                             config.sparsities)
        if points is not None:
            return {s: v for (s, _), v in points.items()}
    return None


# --- budget models that fail ----------------------------------------------------------------------
_DOWN_MARKERS = ("not healthy", "unknown model", "not found", "not ready", "is not available", "unavailable")
_OVERLOAD_MARKERS = ("timeout", "timed out", "exceeds maximum queue size", "queue size")


def classify_failure(message: str) -> str:
    """A budget model's error: ``overload`` (its queue policy refused or timed out the request), ``down``
    (the model or its stub is gone: route around it) or ``failed``."""
    text = message.lower()
    if any(m in text for m in _OVERLOAD_MARKERS):
        return "overload"
    if any(m in text for m in _DOWN_MARKERS):
        return "down"
    return "failed"


class BudgetHealth:
    """Which budget models are down (they failed as gone), and the nearest one up for a budget."""

    def __init__(self, sparsities: Sequence[float]):
        self.sparsities = sorted(sparsities)
        self.down: Dict[float, float] = {}  # sparsity -> when it went down

    def mark_down(self, budget: float, now: float) -> bool:
        """True when it was up."""
        if budget in self.down:
            return False
        self.down[budget] = now
        return True

    def mark_up(self, budget: float) -> bool:
        return self.down.pop(budget, None) is not None

    def nearest(self, budget: float) -> float:
        """``budget`` when it is up, else the nearest one up (ties: the sparser, more savings); raises
        :class:`Overload` when none is."""
        if budget not in self.down:
            return budget
        up = [s for s in self.sparsities if s not in self.down]
        if not up:
            raise Overload("no budget model is available; retry later", "unavailable")
        return min(up, key=lambda s: (abs(s - budget), -s))


def probe_feeds(specs: Sequence[Dict[str, Any]], tokens: int = 4) -> Dict[str, np.ndarray]:
    """One row of zeros for every model input (``specs``: the router config's inputs; free dims ``tokens``)."""
    feeds = {}
    for spec in specs:
        dims = [int(d) for d in spec.get("dims", [])]
        shape = [1] + [d if d > 0 else tokens for d in dims[1:]] if dims else [1]
        feeds[spec["name"]] = np.zeros(shape, dtype=_NUMPY_TYPES.get(spec.get("data_type", ""), np.float32))
    return feeds


_NUMPY_TYPES = {"TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_FP16": np.float16,
                "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT8": np.int8, "TYPE_FP64": np.float64}


class RouterMetrics:
    """The router's own metrics on Triton's metrics endpoint (Python backend custom metrics).

    Counters: ``elastic_router_requests_total{outcome}`` (served, refused, failed),
    ``elastic_router_refused_total{reason}`` (bad_request, overload, queue_full, unavailable),
    ``elastic_router_served_total{sparsity,path}`` (requests per served budget, ``path`` inline: run by the
    router itself, or forwarded), ``elastic_router_rows_total{sparsity}``, ``elastic_router_events_total{event}``
    (switch, failover). Gauges, from :meth:`TritonPythonModel.snapshot`:
    ``elastic_router_served_sparsity``, ``elastic_router_arrival_rate``, ``elastic_router_in_flight``,
    ``elastic_router_predicted_latency_ms`` (the SLO quantile predicted for the budget served; +Inf when
    the estimated rate is past its capacity) and ``elastic_router_measured_latency_ms`` (over the recent
    answers), ``elastic_router_slo_ms``, ``elastic_router_latency_correction`` (the served budget's service
    time scale: its batches' measured times over the modelled ones), ``elastic_router_overhead_ms`` (the time
    outside the budget model added to every prediction), ``elastic_router_densest_predicted_latency_ms`` and
    ``elastic_router_densest_latency_correction`` (the same two for the best-quality budget allowed: how far
    the load is from serving it), ``elastic_router_budget_up{sparsity}``.

    Counts queue up in memory (:meth:`count`: one append) and a thread of their own adds them every
    :attr:`FLUSH_S`: each update is a round trip to the server, handled by the thread of the server that
    also passes on the router's BLS requests and responses, so it stays off the requests' path; and this
    server crashes (``boost::interprocess::lock_exception``) when metrics are updated from several threads
    at once (seen under load).
    """

    OUTCOMES = ("served", "refused", "failed")
    REASONS = ("bad_request", "overload", "queue_full", "unavailable")
    PATHS = ("inline", "forwarded")
    GAUGES = ("served_sparsity", "arrival_rate", "in_flight", "predicted_latency_ms", "measured_latency_ms", "slo_ms",
              "latency_correction", "overhead_ms", "densest_predicted_latency_ms", "densest_latency_correction")
    FLUSH_S = 0.5

    def __init__(self, router: str, sparsities: Sequence[float], snapshot=lambda: {}):
        family, lab = pb_utils.MetricFamily, {"router": router}

        def metrics(name, description, kind, labels):
            f = family(name=name, description=description, kind=kind)
            self._families.append(f)
            return {k: f.Metric(labels={**lab, **extra}) for k, extra in labels.items()}

        self._families: List[Any] = []
        C, G = family.COUNTER, family.GAUGE
        self.requests = metrics("elastic_router_requests_total", "requests answered by the router, by outcome", C,
                                {o: {"outcome": o} for o in self.OUTCOMES})
        self.refused = metrics("elastic_router_refused_total", "requests refused, by reason", C,
                               {r: {"reason": r} for r in self.REASONS})
        self.served = metrics("elastic_router_served_total", "requests served per budget and path", C,
                              {(s, p): {"sparsity": f"{s:g}", "path": p} for s in sparsities for p in self.PATHS})
        self.rows = metrics("elastic_router_rows_total", "rows served per budget (sparsity)", C,
                            {s: {"sparsity": f"{s:g}"} for s in sparsities})
        self.events = metrics("elastic_router_events_total", "budget switches and failovers", C,
                              {e: {"event": e} for e in ("switch", "failover")})
        self.gauges = {g: metrics(f"elastic_router_{g}", f"router gauge: {g.replace('_', ' ')}", G, {0: {}})[0]
                       for g in self.GAUGES}
        self.up = metrics("elastic_router_budget_up", "1 while the budget model answers, 0 while routed around", G,
                          {s: {"sparsity": f"{s:g}"} for s in sparsities})
        self._snapshot = snapshot
        self._done: Deque[Tuple[str, Any, Any]] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-metrics", daemon=True)
        self._thread.start()

    def count(self, outcome: str, detail: Any = None, n: int = 1) -> None:
        """``n`` requests answered with ``outcome``; ``detail``: (served rows, path) when served, the reason
        when refused."""
        self._done.append((outcome, detail, n))  # deque.append: atomic, no lock

    def event(self, name: str) -> None:
        self._done.append(("event", name, 1))

    def flush(self) -> None:
        """Add what was counted since the last flush, and set the gauges (only this thread, or :meth:`close`
        once it stopped, calls it)."""
        tally: Counter = Counter()
        while self._done:
            outcome, detail, n = self._done.popleft()
            if outcome == "event":
                tally[("event", detail)] += n
                continue
            tally[("outcome", outcome)] += n
            if outcome == "refused" and detail in self.refused:
                tally[("reason", detail)] += n
            elif outcome == "served" and detail:
                rows, path = detail
                tally[("served", (rows[0], path))] += n
                for s, k in Counter(rows).items():
                    tally[("rows", s)] += k
        tables = {"outcome": self.requests, "reason": self.refused, "served": self.served, "rows": self.rows,
                  "event": self.events}
        for (kind, k), n in tally.items():
            metric = tables[kind].get(k)
            if metric is not None:
                metric.increment(n)
        self._set_gauges(self._snapshot())

    def _set_gauges(self, snap: Dict[str, Any]) -> None:
        for name, metric in self.gauges.items():
            value = snap.get(name)
            if value is not None and not math.isnan(value):  # +Inf is a value (the prediction when overloaded)
                metric.set(float(value))
        for s, metric in self.up.items():
            metric.set(0.0 if s in snap.get("down", ()) else 1.0)

    def _run(self) -> None:
        while not self._closed.wait(self.FLUSH_S):
            try:
                self.flush()
            except Exception:  # the server refused an update (unloading): those counts are lost, not the thread
                pass

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self.flush()


# --- the router (Triton Python backend, business-logic scripting) -------------------------------
def _error(message: str, code: str = "INVALID_ARG") -> Any:
    """A Triton error with ``code`` (``INVALID_ARG``: HTTP 400 / gRPC INVALID_ARGUMENT; ``UNAVAILABLE``: HTTP
    503 / gRPC UNAVAILABLE, retryable; ``INTERNAL``: 500)."""
    kind = getattr(getattr(pb_utils, "TritonError", None), code, None)
    try:
        return pb_utils.TritonError(message, kind) if kind is not None else pb_utils.TritonError(message)
    except TypeError:  # an older backend without error codes
        return pb_utils.TritonError(message)


def _error_response(message: str, code: str) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=_error(message, code))


def wait_ready(models: Sequence[str], timeout_s: float, is_ready, sleep=time.sleep, clock=time.monotonic) -> bool:
    """Wait until every model in ``models`` is ready.

    Returns:
        True once they are; False when the server cannot tell yet (it answers "Server not ready"
        while it is still loading its startup models: then Triton's own strict readiness and
        ``--exit-on-error`` stand guard, and ``elastic-export serve`` loads the router last).

    Raises:
        RuntimeError: naming the models not ready after ``timeout_s`` (the router then fails to
            load: it is never READY in front of a budget model that is not).
    """
    deadline = clock() + timeout_s
    while True:
        try:
            missing = [m for m in models if not is_ready(m)]
        except Exception as e:  # the server is still starting: it cannot answer for any model
            if "not ready" in str(e).lower():
                return False
            raise
        if not missing:
            return True
        if clock() >= deadline:
            raise RuntimeError(f"budget models not ready after {timeout_s:g} s: {', '.join(missing)}")
        sleep(0.2)


def length_cost(config: RouterConfig, sessions: Optional[Dict[float, Any]],
                points: Optional[Dict[float, Dict[int, float]]]) -> Any:
    """What a row costs by its padded length (:mod:`elastic_export.serving.cost`), for token inputs only
    (None: every row costs one row): measured on the densest budget's inline session at batch 8 and the
    lengths :data:`~elastic_export.serving.cost.MEASURED_LENGTHS`, beside its nominal-length time in
    ``points``; without sessions, proportional to the tokens."""
    if "input_ids" not in config.inputs:
        return None
    from elastic_export.serving import cost

    dense = config.sparsities[0]
    if not sessions or not points or 8 not in points.get(dense, {}):
        return cost.linear_cost(config.tokens)
    from elastic_export.targets.triton_onnx_model import service_times

    ms = {n: service_times({dense: sessions[dense]}, n, (8,), repeats=5)[dense][8]
          for n in cost.MEASURED_LENGTHS if n < config.tokens}
    ms[config.tokens] = points[dense][8]
    fitted = cost.fit_length_cost(config.tokens, ms)
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        logger.log_info("router: a row's cost by its padded length (rows of " + str(config.tokens) + " tokens): "
                        + ", ".join(f"{n}: {w:.3f}" for n, w in fitted.points))
    return fitted


def _log_service_times(points: Dict[float, Dict[int, float]], how: str) -> None:
    """One line in the server's log: the service times the policy starts from."""
    logger = getattr(pb_utils, "Logger", None)
    if logger is not None:
        times = "; ".join(f"{s:g}: " + " / ".join(f"{ms:.1f}" for _, ms in sorted(v.items())) for s, v in sorted(points.items()))
        batches = " / ".join(str(b) for b in sorted(next(iter(points.values()))))
        logger.log_info(f"router: service times {how} (ms at batch {batches}): {times}")


def inline_sessions(config: RouterConfig, repository: str) -> Dict[float, Any]:
    """One onnxruntime session per served budget, on its budget model's ``1/model.onnx`` under
    ``repository`` (the model repository's root), opened and warmed up as the budget models open theirs
    (:func:`elastic_export.targets.triton_onnx_model.open_session`, with the session parameters the build
    wrote into the router's config too)."""
    from elastic_export.targets import triton_onnx_model as ort_model

    return {s: ort_model.open_session(os.path.join(repository, name, "1", ort_model.MODEL_FILE), config.parameters)
            for s, name in config.models.items()}


class _Job:
    """A request ``execute`` accepted: its model-input tensors (None for text), its texts, batch size, the
    served sparsity of every row (named by the request, else picked by the policy: ``routed``), the outputs
    it asks for, when it arrived, the one budget that serves it (``budget``; None: several), whether the
    router runs it itself (``inline``) and its admission's uncorrected predicted latency (``admit_raw``)."""

    __slots__ = ("request", "tensors", "text", "batch", "served", "wanted", "arrived", "routed", "budget",
                 "inline", "admit_raw", "model_ms", "counted", "ticket", "feeds", "work", "queued_ms")

    def __init__(self, request: Any, tensors: Optional[List[Any]], text: Optional[List[str]], batch: int,
                 served: Optional[List[float]], wanted: Sequence[str]):
        self.request, self.tensors, self.text, self.batch = request, tensors, text, batch
        self.served, self.wanted = served, wanted
        self.arrived, self.routed, self.budget, self.inline = 0.0, False, None, False
        self.admit_raw: Optional[float] = None  # the admission's uncorrected prediction (ms)
        self.model_ms: Optional[float] = None  # of its latency, the time in the budget model (or inline run)
        self.counted, self.ticket = None, 0  # the budget the monitor counted it at (None: several or not yet)
        self.feeds: Optional[Dict[str, np.ndarray]] = None  # the tokenized text
        self.work = float(batch)  # its cost in rows of the nominal length (its padded shape)
        self.queued_ms = 0.0  # how long it waited before it was sent (the API's merging)


class TritonPythonModel:
    """Forwards each request (each group of rows of one budget) to the budget model it selects.

    Refusals are error responses with a code: a client's mistake (:class:`BudgetError`) is
    ``INVALID_ARG`` (HTTP 400 / gRPC INVALID_ARGUMENT), an overload or no budget model up
    (:class:`Overload`) ``UNAVAILABLE`` (HTTP 503 / gRPC UNAVAILABLE: retry later). Triton's own
    statistics count an error response as a success; the router's ``elastic_router_refused_total``
    counts them by reason.
    """

    def initialize(self, args: Dict[str, str]) -> None:
        if pb_utils is None:
            raise RuntimeError("the router runs inside Triton's Python backend (triton_python_backend_utils)")
        self.config = config = RouterConfig(json.loads(args["model_config"]))
        if hasattr(pb_utils, "is_model_ready"):
            wait_ready(sorted(set(config.models.values())), config.ready_timeout_s,
                       lambda m: pb_utils.is_model_ready(model_name=m))
        here = os.path.join(args.get("model_repository", ""), str(args.get("model_version", "1")))
        self.tokenizer = None
        if config.text:
            from elastic_export.models.text import TextEncoder

            self.tokenizer = TextEncoder.from_dir(os.path.join(here, TOKENIZER_DIR), config.inputs)
        self.sessions, self._inline = None, None
        if config.inline:  # sessions and runs on one thread at the budget models' niceness (its ORT threads too)
            from elastic_export.targets.triton_onnx_model import NICE_PARAMETER, nice_this_thread

            self._inline = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-inline",
                                              initializer=nice_this_thread,
                                              initargs=(int(config.parameters.get(NICE_PARAMETER) or 0),))
            self.sessions = self._inline.submit(inline_sessions, config,
                                                os.path.dirname(args.get("model_repository", ""))).result()
        self.monitor, self.health = LoadMonitor(), BudgetHealth(config.sparsities)
        points = (service_points(config, self.sessions, os.path.join(here, PROFILE_FILE), config.tokens)
                  if config.policy == "adaptive" else None)
        self.routing = SloRouting(config, points) if points is not None else None
        if points is not None:
            _log_service_times(points, "measured on the router's sessions" if self.sessions else "from the profile")
        self.cost = length_cost(config, self.sessions, points)
        self._calibrating = config.policy == "adaptive" and points is None  # measured by the probe thread
        self._precision = np.array([[config.precision]], dtype=object)
        self._lock = threading.Lock()  # the monitor, the policy and the health table, shared by the threads
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrency, thread_name_prefix="router")
        self.metrics = (RouterMetrics(args.get("model_name", "router"), config.sparsities, self.snapshot)
                        if hasattr(pb_utils, "MetricFamily") else None)
        self._closed = threading.Event()
        self._batches_before = None  # the server's per-batch statistics at the last read
        self._prober = threading.Thread(target=self._probe_loop, name="router-probe", daemon=True)
        self._prober.start()

    def snapshot(self) -> Dict[str, Any]:
        """What the gauges show: served sparsity, arrival rate, in flight, predicted and measured latency
        quantile, SLO, the overhead, the densest allowed budget's prediction and scale, budgets down."""
        with self._lock:
            snap: Dict[str, Any] = {"in_flight": self.monitor.in_flight, "down": tuple(self.health.down)}
            if self.routing is not None:
                policy, last = self.routing.policy, self.routing.last
                snap.update(served_sparsity=policy.current[0], slo_ms=policy.slo_ms,
                            measured_latency_ms=policy.measured(),
                            latency_correction=policy.factor(policy.current), overhead_ms=policy.overhead_ms(),
                            densest_latency_correction=policy.factor(policy.pairs[0]))
                if last is not None:
                    rate = policy.rate.rate()
                    snap.update(arrival_rate=rate, predicted_latency_ms=last.predicted_ms,
                                densest_predicted_latency_ms=policy.predict(policy.pairs[0], rate))
        return snap

    def execute(self, requests: List[Any]) -> None:
        """Check each request here, then hand it to a worker thread (answered through its response
        sender) and return at once; a refused request is answered here with an error response."""
        for request in requests:
            try:
                job = self._accept(request)
                self._arrive(job)
            except BudgetError as e:
                self._refuse(request, str(e), "INVALID_ARG", "bad_request")
                continue
            except Overload as e:
                self._refuse(request, str(e), "UNAVAILABLE", e.reason)
                continue
            self._pool.submit(self._serve, job)
        return None

    def _refuse(self, request: Any, message: str, code: str, reason: str) -> None:
        request.get_response_sender().send(_error_response(message, code),
                                           flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.metrics is not None:
            self.metrics.count("refused", reason)

    def _arrive(self, job: _Job) -> None:
        """Pick the job's budget if it names none, route around budgets that are down, admit it (or raise
        :class:`Overload`) and count it in flight."""
        with self._lock:
            switches = self.routing.policy.switches if self.routing is not None else 0
            decision = self.routing.arrive(job.batch, job.work) if self.routing is not None else None
            if decision is not None and self.routing.policy.switches != switches and self.metrics is not None:
                self.metrics.event("switch")
            if job.served is None:
                job.served = [decision.pair[0] if decision is not None else self.config.default] * job.batch
                job.routed = decision is not None
            if self.health.down:
                job.served = [self.health.nearest(s) for s in job.served]
            first = job.served[0]
            job.budget = first if all(s == first for s in job.served) else None
            if self.monitor.in_flight >= self.config.max_concurrency:
                raise Overload(f"the router has {self.monitor.in_flight} requests in flight, its limit; retry later",
                               "queue_full")
            if self.routing is not None and job.budget is not None:
                self._admit(job)
            job.inline = (self.sessions is not None and self.monitor.in_flight == 0 and job.budget is not None
                          and (self.routing is None or self.routing.light(job.budget)))
            self.monitor.arrive(job.budget, job.work)
            job.arrived, job.counted, job.ticket = self.monitor.last_arrival, job.budget, self.monitor.last_ticket

    def _admit(self, job: _Job) -> None:
        """Admit the job at its budget or, when the policy picked it, at a faster one
        (:meth:`SloRouting.place`); :class:`Overload` when none admits it."""
        now = time.monotonic()
        faster = [s for s in self.config.sparsities if s > job.budget and s not in self.health.down
                  and (self.config.max_sparsity is None or s <= self.config.max_sparsity + TOLERANCE)]
        job.budget, job.admit_raw = self.routing.place(job.budget, job.work, self.monitor.rows_at,
                                                       lambda s: self.monitor.oldest_ms(s, now),
                                                       faster if job.routed else (),
                                                       lambda s: self.monitor.running(s, now), job.queued_ms)
        job.served = [job.budget] * job.batch

    def _accept(self, request: Any) -> _Job:
        """The request's tensors and the served sparsity of its rows (when it names one), checked.

        Raises:
            BudgetError: both ``text`` and model inputs, a missing input, no rows, more rows than
                ``max_rows``, inputs of different batch sizes, text that is not UTF-8, or a sparsity the
                router refuses (:func:`row_sparsities`, :func:`choose_budget`).
        """
        tensors = {t.name(): t for t in request.inputs()}
        text = tensors.get(TEXT_INPUT) if self.config.text else None
        model_inputs = [tensors[n] for n in self.config.inputs if n in tensors]
        if text is not None:
            if model_inputs:
                raise BudgetError(f"send either {TEXT_INPUT!r} or the model inputs, not both")
            batch = math.prod(text.shape())
        else:
            batch = self._batch_of(tensors, model_inputs)
        if batch < 1:
            raise BudgetError("the request has no rows (batch size 0)")
        if batch > self.config.max_rows:
            raise BudgetError(f"the request has {batch} rows, more than the {self.config.max_rows} a request may "
                              f"have; split it")
        texts = _texts(text) if text is not None else None
        sparsity = tensors.get(SPARSITY_INPUT)
        values = None if sparsity is None else sparsity.as_numpy().reshape(-1).tolist()
        params = request.parameters() if values is None and hasattr(request, "parameters") else None
        rows = row_sparsities(values, params, batch)
        served = None if rows is None else self.config.route(rows)
        wanted = request.requested_output_names() if hasattr(request, "requested_output_names") else ()
        job = _Job(request, None if text is not None else model_inputs, texts, batch, served, wanted)
        if texts is not None:
            job.feeds = self.tokenizer.encode(texts)
        shapes = [a.shape for a in job.feeds.values()] if job.feeds is not None else [t.shape() for t in model_inputs]
        job.work = self.cost.request_work(batch, shapes) if self.cost is not None else float(batch)
        job.queued_ms = queued_ms(request.parameters() if hasattr(request, "parameters") else None)
        return job

    def _batch_of(self, tensors: Dict[str, Any], model_inputs: List[Any]) -> int:
        missing = [n for n in self.config.inputs if n not in tensors]
        if missing:
            extra = f" (or {TEXT_INPUT!r})" if self.config.text else ""
            raise BudgetError(f"missing input {', '.join(map(repr, missing))}{extra}")
        shapes = [t.shape() for t in model_inputs]
        batch = shapes[0][0] if shapes[0] else 0
        for t, shape in zip(model_inputs, shapes):
            b = shape[0] if shape else 0
            if b != batch:
                raise BudgetError(f"input {t.name()!r} has batch {b}, input {self.config.inputs[0]!r} has batch {batch}")
        return batch

    def _serve(self, job: _Job) -> None:
        """A worker: the job's response (an error one if it fails), sent; counted."""
        outcome, detail = "served", None
        try:
            response = self._answer(job)
            detail = (job.served, "inline" if job.inline else "forwarded")
        except BudgetError as e:  # the tokenizer's refusal
            response, outcome, detail = _error_response(str(e), "INVALID_ARG"), "refused", "bad_request"
        except Overload as e:
            response, outcome, detail = _error_response(str(e), "UNAVAILABLE"), "refused", e.reason
        except Exception as e:  # a bug or a budget model's failure: answer it, never leave the client waiting
            response, outcome = _error_response(f"router: {e}", "INTERNAL"), "failed"
        ms = (time.monotonic() - job.arrived) * 1e3
        with self._lock:
            self.monitor.leave(job.counted, job.work, job.ticket)
            if outcome == "served" and self.routing is not None:
                self.routing.policy.answered(ms, job.model_ms)
                if job.admit_raw is not None:
                    self.routing.policy.admitted(ms, job.admit_raw)
        job.request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.metrics is not None:
            self.metrics.count(outcome, detail)

    def _answer(self, job: _Job) -> Any:
        feeds = job.feeds
        wanted = job.wanted
        names = [n for n in self.config.outputs if not wanted or n in wanted]
        start = time.monotonic()
        if job.inline:  # nothing else in flight: run it here, no round trip to the budget model
            arrays = feeds if feeds is not None else {t.name(): t.as_numpy() for t in job.tensors}
            arrays = self._inline.submit(self.sessions[job.budget].run, names, arrays).result()
            outputs = [pb_utils.Tensor(n, a) for n, a in zip(names, arrays)]
        else:
            outputs = self._forward_with_failover(job, feeds, names)
        job.model_ms = (time.monotonic() - start) * 1e3
        if not wanted or SERVED_OUTPUT in wanted:
            outputs.append(pb_utils.Tensor(SERVED_OUTPUT, np.array(job.served, dtype=np.float64).reshape(-1, 1)))
        if not wanted or PRECISION_OUTPUT in wanted:
            outputs.append(pb_utils.Tensor(PRECISION_OUTPUT, np.repeat(self._precision, job.batch, axis=0)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _forward_with_failover(self, job: _Job, feeds: Optional[Dict[str, np.ndarray]], names: List[str]) -> List[Any]:
        """:meth:`_forward`; a budget model that fails as gone is marked down and the rows it had go once
        to the nearest budget up (``job.served`` says so); its queue's refusal is an :class:`Overload`."""
        try:
            return self._forward(job.tensors, feeds, job.served, job.budget, names)
        except _BudgetFailure as e:
            kind = classify_failure(str(e))
            if kind == "overload":
                raise Overload(f"overloaded: budget model {self.config.models[e.budget]!r}: {e}; retry later",
                               "overload") from None
            if kind != "down":
                raise RuntimeError(str(e)) from None
            with self._lock:
                if self.health.mark_down(e.budget, time.monotonic()) and self.metrics is not None:
                    self.metrics.event("failover")
                if self.routing is not None:
                    self.routing.set_down(list(self.health.down))
                job.served = [self.health.nearest(s) for s in job.served]
            first = job.served[0]
            job.budget = first if all(s == first for s in job.served) else None
            try:
                return self._forward(job.tensors, feeds, job.served, job.budget, names)
            except _BudgetFailure as again:
                raise Overload(f"budget model {self.config.models[again.budget]!r} failed too: {again}; retry later",
                               "unavailable") from None

    def _bls(self, budget: float, inputs: List[Any], names: List[str]) -> Any:
        timeout = int(2 * (self.routing.policy.slo_ms if self.routing is not None else 60e3) * 1e3)  # microseconds
        try:
            return pb_utils.InferenceRequest(model_name=self.config.models[budget], requested_output_names=names,
                                             inputs=inputs, timeout=timeout)
        except TypeError:  # a backend without request timeouts
            return pb_utils.InferenceRequest(model_name=self.config.models[budget], requested_output_names=names,
                                             inputs=inputs)

    def _forward(self, tensors: Optional[List[Any]], feeds: Optional[Dict[str, np.ndarray]], served: List[float],
                 budget: Optional[float], names: List[str]) -> List[Any]:
        """Run every group of rows on its budget model (several groups: at once); the output tensors, in
        row order. ``tensors``: the request's own (forwarded as they are when one budget serves every
        row), else ``feeds`` (the tokenized text); ``budget``: the one budget of every row (None: several).

        Raises:
            _BudgetFailure: a budget model answered with an error.
        """
        if budget is not None:  # one budget: the request's tensors in, the budget model's out
            inputs = tensors if tensors is not None else [pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in feeds.items()]
            response = self._bls(budget, inputs, names).exec()
            if response.has_error():
                raise _BudgetFailure(budget, response.error().message())
            out = response.output_tensors()
            if [t.name() for t in out] == names:  # the budget model answers what was asked, in that order
                return list(out)
            by_name = {t.name(): t for t in out}
            return [by_name[n] for n in names]
        if feeds is None:
            feeds = {t.name(): t.as_numpy() for t in tensors}
        groups: Dict[float, List[int]] = {}
        for i, s in enumerate(served):
            groups.setdefault(s, []).append(i)
        calls = [self._bls(s, [pb_utils.Tensor(n, np.ascontiguousarray(a[idx])) for n, a in feeds.items()], names)
                 for s, idx in groups.items()]
        responses = asyncio.run(_exec_all(calls))
        for s, r in zip(groups, responses):
            if r.has_error():
                raise _BudgetFailure(s, r.error().message())
        out = []
        for n in names:
            parts = [{t.name(): t for t in r.output_tensors()}[n].as_numpy() for r in responses]
            full = np.empty((len(served),) + parts[0].shape[1:], dtype=parts[0].dtype)
            for idx, part in zip(groups.values(), parts):
                full[idx] = part
            out.append(pb_utils.Tensor(n, full))
        return out

    # --- budget models down: probed until they answer again ---
    PROBE_S = 0.5
    PROBER_JOIN_S = 15.0  # finalize waits this long for the prober's round to end (a statistics fetch is bounded)

    def _probe_loop(self) -> None:
        """First, where nothing measured them, the budgets' service times (:meth:`_calibrate`); then every
        :attr:`PROBE_S`: a budget model that is down and answers a one-row request again is up; one that is
        up but no longer ready (unloaded) is down; the batches they ran, to the policy's scales."""
        feeds = probe_feeds(self.config.input_specs)
        if self._calibrating:
            try:
                self._calibrate()
            except Exception:  # a budget model that does not answer: the default budget is served
                pass
            finally:
                self._calibrating = False
        while not self._closed.wait(self.PROBE_S):
            try:
                stats = self._statistics()
            except Exception:  # no answer this round (busy, stopping): the next round asks again
                continue
            try:
                self._probe(feeds, stats)
            except Exception:  # the server is stopping: the next round tries again
                pass
            try:
                self._read_batches(stats)
            except Exception:
                pass

    def _statistics(self) -> Optional[Dict[str, Any]]:
        """Every loaded model's statistics from the server (where ``serve`` said it is:
        :data:`~elastic_export.serving.triton_stats.STATS_URL_ENV`); None under a server started otherwise."""
        from elastic_export.serving import triton_stats

        url = os.environ.get(triton_stats.STATS_URL_ENV)
        return triton_stats.fetch(url) if url else None

    def _read_batches(self, stats: Optional[Dict[str, Any]]) -> None:
        """The batches each budget model ran since the last round (the server's ``stats``), to the policy's
        service scales."""
        from elastic_export.serving import triton_stats

        if self.routing is None or stats is None:
            return
        totals = triton_stats.batch_totals(stats)
        before, self._batches_before = self._batches_before, totals
        if before is None:
            return
        ran, now = triton_stats.batch_deltas(before, totals), time.monotonic()
        with self._lock:
            weight = self.routing.policy.row_weight  # the batches' rows, in rows of the nominal length
            for s, name in self.config.models.items():
                if name in ran:
                    batches = [(rows * weight, count, ms) for rows, count, ms in ran[name]]
                    self.routing.policy.served_batches((s, self.config.precision), batches, now)

    def _probe(self, feeds: Dict[str, np.ndarray], stats: Optional[Dict[str, Any]]) -> None:
        """Budgets down that are ready and answer are up; budgets up that are not ready are down. Ready: in
        the server's ``stats`` (they list the loaded models), not asked of the server through the backend:
        ``pb_utils.is_model_ready`` called while the server stopped crashed it (the backend's interprocess
        lock, ``boost::interprocess::lock_exception``, in two stops of three here), and a stub whose calls
        the statistics answer asks nothing of it. Without ``stats`` (a server ``serve`` did not start),
        ``is_model_ready``."""
        if stats is not None:
            loaded = {m.get("name") for m in stats.get("model_stats", ())}
            ready = lambda model_name: model_name in loaded  # noqa: E731
        else:
            ready = getattr(pb_utils, "is_model_ready", None)
        changed = False
        for s, name in self.config.models.items():
            is_ready = ready(model_name=name) if ready is not None else True
            if s in self.health.down:
                if is_ready and self._answers(s, feeds):
                    with self._lock:
                        changed |= self.health.mark_up(s)
            elif not is_ready:
                with self._lock:
                    changed |= self.health.mark_down(s, time.monotonic())
        if changed and self.routing is not None:
            with self._lock:
                self.routing.set_down(list(self.health.down))

    def _calibrate(self, batches: Sequence[int] = (1, 8), repeats: int = 5) -> None:
        """Every budget's service times measured through its budget model (BLS, zeros at the model's nominal
        tokens; :func:`~elastic_export.targets.triton_onnx_model.least_in_turn`, as the inline sessions are
        measured), then the load-adaptive policy on them; until then requests that name no budget get the
        default."""
        from elastic_export.targets.triton_onnx_model import least_in_turn

        zeros = probe_feeds(self.config.input_specs, self.config.tokens)
        feeds = {b: {n: np.repeat(a, b, axis=0) for n, a in zeros.items()} for b in batches}

        def run(key: Tuple[float, int]) -> None:
            s, b = key
            response = self._bls(s, [pb_utils.Tensor(n, a) for n, a in feeds[b].items()],
                                 self.config.outputs[:1]).exec()
            if response.has_error():
                raise RuntimeError(response.error().message())

        least = least_in_turn([(s, b) for s in self.config.sparsities for b in batches], run, repeats)
        points = {s: {b: least[(s, b)] for b in batches} for s in self.config.sparsities}
        with self._lock:
            self.routing, self._calibrating = SloRouting(self.config, points), False
        _log_service_times(points, "measured through the budget models")

    def _answers(self, budget: float, feeds: Dict[str, np.ndarray]) -> bool:
        inputs = [pb_utils.Tensor(n, a) for n, a in feeds.items()]
        try:
            return not self._bls(budget, inputs, self.config.outputs[:1]).exec().has_error()
        except Exception:
            return False

    def finalize(self) -> None:
        self._closed.set()
        self._prober.join(timeout=self.PROBER_JOIN_S)  # its calls into the server (BLS, statistics) end first
        self._pool.shutdown(wait=True, cancel_futures=False)
        if self._inline is not None:
            self._inline.shutdown(wait=True)
        if self.metrics is not None:
            self.metrics.close()


class _BudgetFailure(Exception):
    """A budget model's error response (``budget``: its sparsity)."""

    def __init__(self, budget: float, message: str):
        super().__init__(message)
        self.budget = budget


def _texts(tensor: Any) -> List[str]:
    """The ``text`` input's strings; :class:`BudgetError` for bytes that are not UTF-8."""
    from elastic_export.models.text import decode_utf8  # the text input's module (loaded with its tokenizer)

    return decode_utf8(tensor.as_numpy().reshape(-1), BudgetError)


async def _exec_all(calls: List[Any]) -> List[Any]:
    """Several BLS requests at once (a worker's own event loop: ``async_exec`` needs a running one)."""
    return list(await asyncio.gather(*(c.async_exec() for c in calls)))
