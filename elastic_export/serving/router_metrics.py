"""The router's own metrics on Triton's metrics endpoint (Python backend custom metrics).

Counted on the request path with one ``deque.append``; a thread of its own adds the counts and sets the
gauges every :attr:`RouterMetrics.FLUSH_S`. Triton's ``MetricFamily`` is passed in (``family``), so this
module imports the standard library only: copied next to the router's ``model.py``, as
:mod:`~elastic_export.serving.router_budgets`.
"""

import math
import threading
from collections import Counter, deque
from typing import Any, Callable, Deque, Dict, List, Sequence, Tuple


class RouterMetrics:
    """The router's own metrics on Triton's metrics endpoint (Python backend custom metrics).

    Counters: ``elastic_router_requests_total{outcome}`` (served, refused, failed),
    ``elastic_router_refused_total{reason}`` (bad_request, overload, queue_full, unavailable),
    ``elastic_router_served_total{sparsity,path}`` (requests per served budget, ``path`` inline: run by the
    router itself, or forwarded), ``elastic_router_rows_total{sparsity}``, ``elastic_router_events_total{event}``
    (switch, failover). Gauges, from
    :meth:`~elastic_export.targets.triton_router.TritonPythonModel.snapshot`:
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

    Args:
        router: the router's model name (every metric's ``router`` label).
        sparsities: the served budgets (a label value each).
        snapshot: the gauges' values (:meth:`TritonPythonModel.snapshot`), read at each flush.
        family: Triton's ``pb_utils.MetricFamily`` (injected: the tests pass a stand-in).
    """

    OUTCOMES = ("served", "refused", "failed")
    REASONS = ("bad_request", "overload", "queue_full", "unavailable")
    PATHS = ("inline", "forwarded")
    GAUGES = ("served_sparsity", "arrival_rate", "in_flight", "predicted_latency_ms", "measured_latency_ms", "slo_ms",
              "latency_correction", "overhead_ms", "densest_predicted_latency_ms", "densest_latency_correction")
    FLUSH_S = 0.5

    def __init__(self, router: str, sparsities: Sequence[float], snapshot: Callable[[], Dict[str, Any]] = dict, *,
                 family: Any):
        lab = {"router": router}

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
