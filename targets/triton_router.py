"""elastic-export router for Triton's Python backend: each request (or each row) to a budget model.

This file is thin glue between Triton and the serving modules it imports: the one rule for matching a
requested budget and the request's parameters (:mod:`elastic_export.serving.router_budgets`), the
router's configuration (:mod:`~elastic_export.serving.router_config`), load accounting and admission
(:mod:`~elastic_export.serving.router_load`, over :mod:`~elastic_export.serving.slo`), the budget models'
health (:mod:`~elastic_export.serving.router_health`) and its metrics
(:mod:`~elastic_export.serving.router_metrics`), each unit-tested on its own with an injected clock.

It is copied verbatim into ``<repository>/<name>/1/model.py`` by ``elastic-export build triton``
(:func:`elastic_export.targets.triton.build_repository`), and those modules (:data:`SERVING_MODULES`,
the standard library and numpy only) verbatim next to it; it is also an ordinary module of the package
(``elastic_export.targets.triton_router``), linted and unit-tested. Portability: it imports the modules
from the package where that is installed, else from its own folder, so the router (fixed policy, token
inputs, forwarded to the budget models) loads in a Triton whose Python has numpy but not this package
(``test_triton_router.py::test_the_built_router_loads_without_the_package``), plus Triton's in-server
``triton_python_backend_utils``. Three features import more of the package, only when the config asks
for them: the adaptive policy's service times (the latency profile, or measurements through
:mod:`elastic_export.targets.triton_onnx_model`), inline runs (onnxruntime) and the ``text`` input
(:mod:`elastic_export.models.text`, the ``tokenizers`` library); ``elastic-export serve`` runs the server
with the project's own Python, where all are installed.

Everything that differs between repositories lives in the router's ``config.pbtxt``
(:class:`~elastic_export.serving.router_config.RouterConfig` reads it): Triton hands that config to
:meth:`TritonPythonModel.initialize` as JSON (``args["model_config"]``).

Rule (:func:`~elastic_export.serving.router_budgets.choose_budget`): a requested sparsity within
:data:`TOLERANCE` of a served budget gets that budget; otherwise the smallest served budget whose
sparsity is *at least* the requested one (more savings, never less). A request outside [0, 1), not a
number, or sparser than the sparsest served budget is refused with :class:`BudgetError`, as is one with
a missing input, inputs of different batch sizes, no rows or more than ``max_rows``: ``execute``
answers it with an ``INVALID_ARG`` error (HTTP 400) before anything is counted. A request that names no
sparsity gets the configured default (``policy: fixed``) or the best-quality budget whose predicted
latency meets the SLO (``policy: adaptive``, :class:`SloRouting`); one predicted to miss the SLO behind
the rows in flight at its budget is refused with ``UNAVAILABLE`` (HTTP 503, retryable:
:class:`Overload`). A budget model that fails as gone is routed around (:class:`BudgetHealth`) and
probed until it answers again.

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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server (the builder, the tests): no model class at work
    pb_utils = None

# The serving modules this file is glue over, and which the builder copies next to it (``<router>/1/``):
SERVING_MODULES = ("router_budgets", "router_config", "router_load", "router_health", "router_metrics", "slo", "cost",
                   "triton_stats", "length_groups")
try:  # the package, where it is installed (``elastic-export serve``, the tests)
    from elastic_export.serving import (
        cost,
        length_groups,
        router_budgets,
        router_config,
        router_health,
        router_load,
        router_metrics,
        triton_stats,
    )
except ImportError:  # a Python without it: the copies next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cost
    import length_groups
    import router_budgets
    import router_config
    import router_health
    import router_load
    import router_metrics
    import triton_stats

TOLERANCE, BudgetError, Overload = router_budgets.TOLERANCE, router_budgets.BudgetError, router_budgets.Overload
choose_budget, row_sparsities, queued_ms = router_budgets.choose_budget, router_budgets.row_sparsities, router_budgets.queued_ms
RouterConfig = router_config.RouterConfig
SPARSITY_INPUT, TEXT_INPUT = router_config.SPARSITY_INPUT, router_config.TEXT_INPUT
SERVED_OUTPUT, PRECISION_OUTPUT = router_config.SERVED_OUTPUT, router_config.PRECISION_OUTPUT
LoadMonitor, SloRouting = router_load.LoadMonitor, router_load.SloRouting
BudgetHealth, classify_failure = router_health.BudgetHealth, router_health.classify_failure
probe_feeds, wait_ready = router_health.probe_feeds, router_health.wait_ready
RouterMetrics = router_metrics.RouterMetrics

PROFILE_FILE = "latency_profile.json"  # next to model.py, copied from the artifact directory when it has one
TOKENIZER_DIR = "tokenizer"  # next to model.py, for the text input


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


def length_cost(config: RouterConfig, sessions: Optional[Dict[float, Any]],
                points: Optional[Dict[float, Dict[int, float]]]) -> Any:
    """What a row costs by its padded length (:mod:`elastic_export.serving.cost`), for token inputs only
    (None: every row costs one row): measured on the densest budget's inline session at batch 8 and the
    lengths :data:`~elastic_export.serving.cost.MEASURED_LENGTHS`, beside its nominal-length time in
    ``points``; without sessions, proportional to the tokens."""
    if "input_ids" not in config.inputs:
        return None
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
        self.metrics = (RouterMetrics(args.get("model_name", "router"), config.sparsities, self.snapshot,
                                      family=pb_utils.MetricFamily) if hasattr(pb_utils, "MetricFamily") else None)
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
            arrays = self._inline.submit(length_groups.run_grouped, self.sessions[job.budget].run, names, arrays,
                                         self.config.row_outputs).result()  # pooled rows: in groups of similar length
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
        url = os.environ.get(triton_stats.STATS_URL_ENV)
        return triton_stats.fetch(url) if url else None

    def _read_batches(self, stats: Optional[Dict[str, Any]]) -> None:
        """The batches each budget model ran since the last round (the server's ``stats``), to the policy's
        service scales."""
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
