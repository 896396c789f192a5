"""elastic-export router for Triton's Python backend: each request (or each row) to a budget model.

This file is copied verbatim into ``<repository>/<name>/1/model.py`` by ``elastic-export build
triton`` (:func:`elastic_export.targets.triton.build_repository`); it is also an ordinary module of
the package (``elastic_export.targets.triton_router``), linted and unit-tested. Its core imports the
standard library and numpy only, plus Triton's in-server ``triton_python_backend_utils`` when that
exists. Two features import more, only when the config asks for them: load-adaptive routing
(``policy: adaptive``) imports :mod:`elastic_export.serving.policies`, and the ``text`` input imports
:mod:`elastic_export.models.text` (the ``tokenizers`` library); ``elastic-export serve`` runs the server with
the project's own Python, where both are installed.

Everything that differs between repositories lives in the router's ``config.pbtxt``: its
``parameters`` (``budget_models``: JSON ``[[sparsity, model name], ...]``; ``default_sparsity``;
``policy``; ``slo_ms``; ``precision``) and its ``input`` / ``output`` lists (forwarded to the budget
model, less the router's own tensors). Triton hands that config to
:meth:`TritonPythonModel.initialize` as JSON (``args["model_config"]``).

Rule: a requested sparsity within :data:`TOLERANCE` of a served budget gets that budget; otherwise
the smallest served budget whose sparsity is *at least* the requested one (more savings, never
less). A request outside [0, 1), not a number, or sparser than the sparsest served budget is
refused with :class:`BudgetError`, as is one with a missing input or inputs of different batch sizes:
``execute`` checks every request itself and raises for a refused one, so that Triton counts it as a
failed request (its Python backend counts a request as failed only when ``execute`` raises). A
request that names no sparsity gets the configured default (``policy: fixed``) or what the
load-adaptive policy picks from the load the router observes (``policy: adaptive``).

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
when nothing else is in flight (one budget for every row), instead of the BLS round trip through the
server process (about 1 ms on a 2-CPU machine, more than the router's own work); with other requests
in flight it forwards, so that the budget models' dynamic batchers still batch under load.
"""

import asyncio
import json
import math
import os
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server (the builder, the tests): no model class at work
    pb_utils = None

TOLERANCE = 1e-6
PARAMETER = "sparsity"
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
INLINE_PARAMETER = "inline"  # "1": the router runs a request itself when it has nothing else in flight
DEFAULT_CONCURRENCY = 64
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
        self.parameters = params
        names = [t["name"] for t in model_config.get("input", [])]
        self.text = TEXT_INPUT in names
        self.inputs = [n for n in names if n not in OWN_TENSORS]
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


# --- what the router observes ----------------------------------------------------------------------
class LoadMonitor:
    """In-flight requests, the arrival rate and each budget's measured latency, as the router sees them.

    Args:
        half_life_s: the arrival-rate estimate's memory (an exponentially weighted rate).
        clock: seconds (monotonic).


    Attributes:
        in_flight: requests received and not yet answered.
        at: per budget, the requests in flight there (those a new request sent there queues behind).
        last_arrival: when the latest request arrived (``clock``; None before the first).
        rate: arrival rate (requests/s), exponentially weighted.
        latency_ms: per budget, the moving average of its answers' latency (queueing included).
        service_ms: per budget, the moving average of the latency of requests that had the server to
            themselves (nothing else in flight when they arrived or left): a service-time estimate.
    """

    def __init__(self, half_life_s: float = 0.5, clock=time.monotonic):
        self.in_flight = 0
        self.at: Dict[float, int] = {}
        self.last_arrival: Optional[float] = None
        self.rate = 0.0
        self.latency_ms: Dict[float, float] = {}
        self.service_ms: Dict[float, float] = {}
        self._half_life, self._clock = half_life_s, clock

    def arrive(self) -> int:
        """Count an arrival; returns how many other requests were in flight (the queue it joins)."""
        now = self._clock()
        last = self.last_arrival
        if last is not None:
            decay = 0.5 ** ((now - last) / self._half_life)
            self.rate = self.rate * decay + (1.0 - decay) / max(now - last, 1e-6)
        self.last_arrival = now
        self.in_flight += 1
        return self.in_flight - 1

    def start(self, budget: Optional[float]) -> None:
        """The arrived request goes to ``budget`` (None: to several)."""
        if budget is not None:
            self.at[budget] = self.at.get(budget, 0) + 1

    def leave(self, sparsity: Optional[float], latency_ms: Optional[float], alone: bool = False,
              budget: Optional[float] = None, fresh: bool = True) -> None:
        """Count an answer of ``sparsity`` after ``latency_ms`` (None: not a sample); ``alone``: nothing
        else was in flight (a service time); ``budget``: where :meth:`start` counted it; ``fresh``: a
        latency sample (False: a service time at most)."""
        self.in_flight -= 1
        if budget is not None:
            self.at[budget] -= 1
        if sparsity is None or latency_ms is None:
            return
        if fresh:
            _ewma(self.latency_ms, sparsity, latency_ms)
        if alone and self.in_flight == 0:
            _ewma(self.service_ms, sparsity, latency_ms)


def _ewma(table: Dict[float, float], key: float, value: float, weight: float = 0.2) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - weight) * old + weight * value


class AdaptiveRouting:
    """The project's :class:`~elastic_export.serving.policies.LoadAdaptivePolicy` fed with what the router
    observes. Queue depth: the requests in flight at the budget the policy serves now (those a new one
    queues behind; requests still in flight at a budget it left do not push it further: counted, a
    burst stepped through every budget at once, and on a CPU the budget models then run side by side
    and slow each other down). Service times, where the directory's latency profile has every served
    budget at batch 1: the profile's p50, scaled by the router's own measurements
    (:attr:`LoadMonitor.service_ms`, :meth:`calibrated_service`), so that the arrival rate x service
    time (utilisation) steers the level too. With an SLO, a budget whose measured latency (queueing
    included) exceeds 80 % of it counts as a full queue, so the policy steps to a faster budget at
    once; only requests that arrived since the last switch are samples (:attr:`switched_at`), so one
    overload is not counted again at every faster budget it steps to. Imports
    :mod:`elastic_export.serving.policies`."""

    def __init__(self, config: RouterConfig, profile_path: Optional[str]):
        from elastic_export.serving.policies import LoadAdaptivePolicy

        pairs = [(s, config.precision) for s in config.sparsities]
        service = _profile_service(profile_path, config) if profile_path and os.path.isfile(profile_path) else None
        # Headroom below the policy's default band (0.85 / 0.6): the service times are batch-1 ones
        # and the server's own overheads and arrival bursts come on top. With an SLO the measured
        # latency steers too, so a longer queue is tolerated before it alone steps up.
        self.policy = LoadAdaptivePolicy(up_depth=8 if config.slo_ms else 4, down_depth=1, down_after=8,
                                         service_ms=service, high_utilization=0.75, low_utilization=0.55)
        self.policy.bind_pairs(pairs, config.precision)
        self.config = config
        self.profile = {s: ms for (s, _), ms in service.items()} if service else None
        self.switched_at = float("-inf")

    def calibrated_service(self, measured: Dict[float, float]) -> Optional[Dict[Any, float]]:
        """Every budget's service time: the profile's, scaled by how the budgets measured here compare
        with it (the median ratio), so one measured budget calibrates them all."""
        if self.profile is None:
            return None
        ratios = sorted(measured[s] / self.profile[s] for s in measured if self.profile.get(s))
        k = ratios[len(ratios) // 2] if ratios else 1.0
        return {(s, self.config.precision): ms * k for s, ms in self.profile.items()}

    def choose(self, monitor: LoadMonitor, queue: Optional[int] = None) -> float:
        """The budget for a request that arrived with ``queue`` others ahead of it (None: those in flight
        at the current budget, :attr:`LoadMonitor.at`)."""
        current = self.policy.select(1)[0]
        depth = monitor.at.get(current, 0) if queue is None else queue
        slo = self.config.slo_ms
        if slo is not None and monitor.latency_ms.get(current, 0.0) > 0.8 * slo:
            depth = max(depth, self.policy.up_depth)
        if self.policy.service_ms is not None:
            self.policy.service_ms.update(self.calibrated_service(monitor.service_ms))
        self.policy.observe(depth, monitor.rate if self.policy.service_ms is not None else None)
        chosen = float(self.policy.select(1)[0])
        if chosen != current:  # its latency from the last visit is stale
            monitor.latency_ms.pop(chosen, None)
            self.switched_at = monitor.last_arrival
        return chosen


def _profile_service(path: str, config: RouterConfig) -> Optional[Dict[Any, float]]:
    """p50 ms at batch 1 of every served budget from a latency profile, or None when it lacks one."""
    from elastic_export.core.latency_profile import load_profile

    profile = load_profile(path)
    b = profile.batch_for(1)
    rows = profile.rows(config.precision).get(b, {})
    service = {}
    for s in config.sparsities:
        row = next((r for k, r in rows.items() if abs(k - s) <= TOLERANCE), None)
        if row is None or "p50_ms" not in row:
            return None
        service[(s, config.precision)] = float(row["p50_ms"])
    return service


class RouterMetrics:
    """The router's own counters on Triton's metrics endpoint (Python backend custom metrics).

    ``elastic_router_requests_total{outcome=...}`` counts the requests the router served, refused (bad
    sparsity or inputs: also in Triton's own ``nv_inference_request_failure``, see
    :meth:`TritonPythonModel.execute`) and failed (a budget model's error: Triton counts that one as a
    success of the router, it answers after ``execute`` returned); ``elastic_router_rows_total{sparsity=...}``
    the rows served per budget; ``elastic_router_switches_total`` the adaptive policy's budget switches.

    Counts queue up in memory (:meth:`count`: one append) and a thread of their own adds them to the
    metrics every :attr:`FLUSH_S`: each update is a round trip to the server, handled by the thread
    of the server that also passes on the router's BLS requests and responses, so it stays off the
    requests' path; and this server crashes (``boost::interprocess::lock_exception``) when metrics are
    updated from several threads at once (seen under load).
    """

    OUTCOMES = ("served", "refused", "failed")
    FLUSH_S = 0.5

    def __init__(self, router: str, sparsities: Sequence[float], switches=lambda: 0):
        family = pb_utils.MetricFamily
        self._families = [
            family(name="elastic_router_requests_total", description="requests answered by the elastic router, by outcome",
                   kind=family.COUNTER),
            family(name="elastic_router_rows_total", description="rows served per budget (sparsity)", kind=family.COUNTER),
            family(name="elastic_router_switches_total", description="budget switches of the load-adaptive policy",
                   kind=family.COUNTER),
        ]
        requests, rows, switches_family = self._families
        self.requests = {o: requests.Metric(labels={"router": router, "outcome": o}) for o in self.OUTCOMES}
        self.rows = {s: rows.Metric(labels={"router": router, "sparsity": f"{s:g}"}) for s in sparsities}
        self.switches = switches_family.Metric(labels={"router": router})
        self._switches, self._switches_counted = switches, 0
        self._done: Deque[Tuple[str, Optional[List[float]], int]] = deque()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-metrics", daemon=True)
        self._thread.start()

    def count(self, outcome: str, served: Optional[List[float]] = None, requests: int = 1) -> None:
        """``requests`` answered with ``outcome``; ``served``: the served sparsity of each row."""
        self._done.append((outcome, served, requests))  # deque.append: atomic, no lock

    def flush(self) -> None:
        """Add what was counted since the last flush to the server's metrics (only this thread, or
        :meth:`close` once it stopped, calls it)."""
        requests: Counter = Counter()
        rows: Counter = Counter()
        while self._done:
            outcome, served, n = self._done.popleft()
            requests[outcome] += n
            if served:
                rows.update(served)
        for outcome, n in requests.items():
            self.requests[outcome].increment(n)
        for s, n in rows.items():
            self.rows[s].increment(n)
        switches = self._switches()
        if switches > self._switches_counted:
            self.switches.increment(switches - self._switches_counted)
            self._switches_counted = switches

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
def _error(message: str) -> Any:
    code = getattr(getattr(pb_utils, "TritonError", None), "INVALID_ARG", None)
    try:
        return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    except TypeError:  # an older backend without error codes
        return pb_utils.TritonError(message)


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


def inline_sessions(config: RouterConfig, repository: str) -> Dict[float, Any]:
    """One onnxruntime session per served budget, on its budget model's ``1/model.onnx`` under
    ``repository`` (the model repository's root), opened and warmed up as the budget models open theirs
    (:func:`elastic_export.targets.triton_onnx_model.open_session`, with the session parameters the build
    wrote into the router's config too)."""
    from elastic_export.targets import triton_onnx_model as ort_model

    return {s: ort_model.open_session(os.path.join(repository, name, "1", ort_model.MODEL_FILE), config.parameters)
            for s, name in config.models.items()}


class _Job:
    """A request ``execute`` accepted: its model-input tensors (None for text), its text tensor, batch size,
    the served sparsity of every row (named by the request, else picked by ``execute``: ``routed``), the
    outputs it asks for, the requests in flight when it arrived (``queue``) and when (``arrived``), the one budget
    that serves it (``budget``; None: several), whether the router runs it itself (``inline``)."""

    __slots__ = ("request", "tensors", "text", "batch", "served", "wanted", "queue", "arrived", "routed", "budget",
                 "inline")

    def __init__(self, request: Any, tensors: Optional[List[Any]], text: Any, batch: int,
                 served: Optional[List[float]], wanted: Sequence[str]):
        self.request, self.tensors, self.text, self.batch = request, tensors, text, batch
        self.served, self.wanted = served, wanted
        self.queue, self.arrived, self.routed, self.budget, self.inline = 0, 0.0, False, None, False


class TritonPythonModel:
    """Forwards each request (each group of rows of one budget) to the budget model it selects."""

    def initialize(self, args: Dict[str, str]) -> None:
        if pb_utils is None:
            raise RuntimeError("the router runs inside Triton's Python backend (triton_python_backend_utils)")
        self.config = RouterConfig(json.loads(args["model_config"]))
        if hasattr(pb_utils, "is_model_ready"):
            wait_ready(sorted(set(self.config.models.values())), self.config.ready_timeout_s,
                       lambda m: pb_utils.is_model_ready(model_name=m))
        here = os.path.join(args.get("model_repository", ""), str(args.get("model_version", "1")))
        self.monitor = LoadMonitor()
        self.adaptive = (AdaptiveRouting(self.config, os.path.join(here, PROFILE_FILE))
                         if self.config.policy == "adaptive" else None)
        self.tokenizer = None
        if self.config.text:
            from elastic_export.models.text import TextEncoder

            self.tokenizer = TextEncoder.from_dir(os.path.join(here, TOKENIZER_DIR), self.config.inputs)
        switches = (lambda: self.adaptive.policy.switches) if self.adaptive is not None else (lambda: 0)
        self.metrics = (RouterMetrics(args.get("model_name", "router"), self.config.sparsities, switches)
                        if hasattr(pb_utils, "MetricFamily") else None)
        self.sessions = (inline_sessions(self.config, os.path.dirname(args.get("model_repository", "")))
                         if self.config.inline else None)
        self._precision = np.array([[self.config.precision]], dtype=object)
        self._lock = threading.Lock()  # the monitor and the policy, shared by the worker threads
        self._pool = ThreadPoolExecutor(max_workers=self.config.max_concurrency, thread_name_prefix="router")

    def execute(self, requests: List[Any]) -> None:
        """Check each request here, then hand it to a worker thread (answered through its response
        sender) and return at once.

        A request the router refuses (:class:`BudgetError`) raises from here: Triton 2.51's Python
        backend counts a request as failed (``nv_inference_request_failure``) only when ``execute``
        raises; an error response, returned or sent, counts as a success. The router gets one request
        per call (no dynamic batching in its config); were there several, a refused one among valid
        ones would be answered with an error response instead (raising fails every request of the call).
        """
        jobs, refused = [], []
        for request in requests:
            try:
                jobs.append(self._accept(request))
            except BudgetError as e:
                refused.append((request, str(e)))
        if refused:
            if self.metrics is not None:
                self.metrics.count("refused", requests=len(refused))
            if not jobs:
                raise BudgetError(refused[0][1])
            for request, message in refused:
                request.get_response_sender().send(pb_utils.InferenceResponse(output_tensors=[], error=_error(message)),
                                                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        for job in jobs:
            self._arrive(job)
            self._pool.submit(self._serve, job)
        return None

    def _arrive(self, job: _Job) -> None:
        """Count the job's arrival; pick its budget if it names none (the policy's, else the default)."""
        with self._lock:
            job.queue = self.monitor.arrive()
            job.arrived = self.monitor.last_arrival
            if job.served is None:
                chosen = self.adaptive.choose(self.monitor) if self.adaptive is not None else None
                job.served = [self.config.default if chosen is None else chosen] * job.batch
                job.routed = chosen is not None
            first = job.served[0]
            job.budget = first if all(s == first for s in job.served) else None
            job.inline = self.sessions is not None and job.queue == 0 and job.budget is not None
            self.monitor.start(job.budget)

    def _accept(self, request: Any) -> _Job:
        """The request's tensors and the served sparsity of its rows (when it names one), checked.

        Raises:
            BudgetError: both ``text`` and model inputs, a missing input, inputs of different batch
                sizes, or a sparsity the router refuses (:func:`row_sparsities`, :func:`choose_budget`).
        """
        tensors = {t.name(): t for t in request.inputs()}
        text = tensors.get(TEXT_INPUT) if self.config.text else None
        model_inputs = [tensors[n] for n in self.config.inputs if n in tensors]
        if text is not None:
            if model_inputs:
                raise BudgetError(f"send either {TEXT_INPUT!r} or the model inputs, not both")
            batch = math.prod(text.shape())
        else:
            missing = [n for n in self.config.inputs if n not in tensors]
            if missing:
                extra = f" (or {TEXT_INPUT!r})" if self.config.text else ""
                raise BudgetError(f"missing input {', '.join(map(repr, missing))}{extra}")
            shapes = [t.shape() for t in model_inputs]
            batch = shapes[0][0] if shapes[0] else 0
            for t, shape in zip(model_inputs, shapes):
                b = shape[0] if shape else 0
                if b != batch:
                    raise BudgetError(f"input {t.name()!r} has batch {b}, input {self.config.inputs[0]!r} has "
                                      f"batch {batch}")
        sparsity = tensors.get(SPARSITY_INPUT)
        values = None if sparsity is None else sparsity.as_numpy().reshape(-1).tolist()
        params = request.parameters() if values is None and hasattr(request, "parameters") else None
        rows = row_sparsities(values, params, batch)
        served = None if rows is None else self.config.route(rows)
        wanted = request.requested_output_names() if hasattr(request, "requested_output_names") else ()
        return _Job(request, None if text is not None else model_inputs, text, batch, served, wanted)

    def _serve(self, job: _Job) -> None:
        """A worker: the job's response (an error one if it fails), sent; counted."""
        outcome = "served"
        try:
            response = self._answer(job)
        except BudgetError as e:  # the text input's (the tokenizer's) refusal
            response, outcome = pb_utils.InferenceResponse(output_tensors=[], error=_error(str(e))), "refused"
        except Exception as e:  # a bug or a budget model's failure: answer it, never leave the client waiting
            error = pb_utils.TritonError(f"router: {e}")
            response, outcome = pb_utils.InferenceResponse(output_tensors=[], error=error), "failed"
        ms = (time.monotonic() - job.arrived) * 1e3
        with self._lock:  # only the policy's picks (one budget for every row) since its last switch steer it
            fresh = self.adaptive is None or job.arrived >= self.adaptive.switched_at
            self.monitor.leave(job.served[0] if job.routed else None, ms, alone=job.queue == 0, budget=job.budget,
                               fresh=fresh)
        job.request.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        if self.metrics is not None:
            self.metrics.count(outcome, job.served if outcome == "served" else None)

    def _answer(self, job: _Job) -> Any:
        tensors, feeds = job.tensors, None
        if job.text is not None:
            values = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in job.text.as_numpy().reshape(-1)]
            feeds = self.tokenizer.encode(values)
        wanted = job.wanted
        names = [n for n in self.config.outputs if not wanted or n in wanted]
        if job.inline:  # nothing else in flight: run it here, no round trip to the budget model
            arrays = feeds if feeds is not None else {t.name(): t.as_numpy() for t in tensors}
            outputs = [pb_utils.Tensor(n, a) for n, a in zip(names, self.sessions[job.budget].run(names, arrays))]
        else:
            outputs = self._forward(tensors, feeds, job.served, job.budget, names)
        if not wanted or SERVED_OUTPUT in wanted:
            outputs.append(pb_utils.Tensor(SERVED_OUTPUT, np.array(job.served, dtype=np.float64).reshape(-1, 1)))
        if not wanted or PRECISION_OUTPUT in wanted:
            outputs.append(pb_utils.Tensor(PRECISION_OUTPUT, np.repeat(self._precision, job.batch, axis=0)))
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def _forward(self, tensors: Optional[List[Any]], feeds: Optional[Dict[str, np.ndarray]], served: List[float],
                 budget: Optional[float], names: List[str]) -> List[Any]:
        """Run every group of rows on its budget model (several groups: at once); the output tensors, in
        row order. ``tensors``: the request's own (forwarded as they are when one budget serves every
        row), else ``feeds`` (the tokenized text); ``budget``: the one budget of every row (None: several)."""
        if budget is not None:  # one budget: the request's tensors in, the budget model's out
            inputs = tensors if tensors is not None else [pb_utils.Tensor(n, np.ascontiguousarray(a)) for n, a in feeds.items()]
            response = pb_utils.InferenceRequest(model_name=self.config.models[budget], requested_output_names=names,
                                                 inputs=inputs).exec()
            if response.has_error():
                raise RuntimeError(response.error().message())
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
        calls = [pb_utils.InferenceRequest(model_name=self.config.models[s], requested_output_names=names,
                                           inputs=[pb_utils.Tensor(n, np.ascontiguousarray(a[idx]))
                                                   for n, a in feeds.items()])
                 for s, idx in groups.items()]
        responses = asyncio.run(_exec_all(calls))
        for r in responses:
            if r.has_error():
                raise RuntimeError(r.error().message())
        out = []
        for n in names:
            parts = [{t.name(): t for t in r.output_tensors()}[n].as_numpy() for r in responses]
            full = np.empty((len(served),) + parts[0].shape[1:], dtype=parts[0].dtype)
            for idx, part in zip(groups.values(), parts):
                full[idx] = part
            out.append(pb_utils.Tensor(n, full))
        return out

    def finalize(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        if self.metrics is not None:
            self.metrics.close()


async def _exec_all(calls: List[Any]) -> List[Any]:
    """Several BLS requests at once (a worker's own event loop: ``async_exec`` needs a running one)."""
    return list(await asyncio.gather(*(c.async_exec() for c in calls)))
