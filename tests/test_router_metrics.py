"""The router's metrics (``elastic_export.serving.router_metrics``), with a stand-in for Triton's
``pb_utils.MetricFamily`` that records every update and the thread that made it."""

from __future__ import annotations

import math
import threading

from elastic_export.serving.router_metrics import RouterMetrics


class _Family:
    """A stand-in for pb_utils.MetricFamily: every update with the thread that made it."""

    COUNTER, GAUGE = "counter", "gauge"
    updates: list = []

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 (Triton's name)
        family = self

        class _Metric:
            def increment(self, value):
                _Family.updates.append((family.name, dict(labels), value, threading.current_thread().name))

            def set(self, value):
                _Family.updates.append((family.name, dict(labels), ("set", value), threading.current_thread().name))

        return _Metric()


def test_router_metrics_gather_counts_and_update_from_one_thread(monkeypatch):
    monkeypatch.setattr(_Family, "updates", [])
    snap = {"served_sparsity": 0.5, "in_flight": 3, "arrival_rate": 41.0, "predicted_latency_ms": math.inf,
            "measured_latency_ms": math.nan, "down": (0.0,)}
    metrics = RouterMetrics("elastic", [0.0, 0.5], snapshot=lambda: snap, family=_Family)
    threads = [threading.Thread(target=lambda: [metrics.count("served", ([0.5, 0.5], "forwarded")) for _ in range(50)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics.count("served", ([0.0], "inline"))
    for reason in ("overload", "overload", "bad_request"):
        metrics.count("refused", reason)
    metrics.event("switch")
    metrics.close()  # the last counts flushed
    totals: dict = {}
    gauges: dict = {}
    for name, labels, value, thread in _Family.updates:
        key = (name, tuple(v for k, v in sorted(labels.items()) if k != "router"))
        if isinstance(value, tuple):
            gauges[key] = value[1]
        else:
            totals[key] = totals.get(key, 0) + value
    assert totals == {("elastic_router_requests_total", ("served",)): 201,
                      ("elastic_router_requests_total", ("refused",)): 3,
                      ("elastic_router_refused_total", ("overload",)): 2,
                      ("elastic_router_refused_total", ("bad_request",)): 1,
                      ("elastic_router_served_total", ("forwarded", "0.5")): 200,
                      ("elastic_router_served_total", ("inline", "0")): 1,
                      ("elastic_router_rows_total", ("0.5",)): 400, ("elastic_router_rows_total", ("0",)): 1,
                      ("elastic_router_events_total", ("switch",)): 1}
    assert gauges[("elastic_router_served_sparsity", ())] == 0.5 and gauges[("elastic_router_in_flight", ())] == 3
    assert gauges[("elastic_router_budget_up", ("0",))] == 0.0 and gauges[("elastic_router_budget_up", ("0.5",))] == 1
    assert gauges[("elastic_router_predicted_latency_ms", ())] == math.inf  # overloaded: Triton shows +Inf
    assert ("elastic_router_measured_latency_ms", ()) not in gauges  # not measured yet: not set
    assert len(_Family.updates) < 4 * 50  # gathered, not one update per request
    assert {thread for *_, thread in _Family.updates} <= {"router-metrics", threading.current_thread().name}
