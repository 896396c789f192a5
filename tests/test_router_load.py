"""The router's load accounting and admission (``elastic_export.serving.router_load``), on a manual clock:
rows in flight per budget, the SLO policy's pick, admission and the overflow to a faster budget."""

from __future__ import annotations

import json

import pytest

from elastic_export.serving.router_budgets import Overload
from elastic_export.serving.router_config import RouterConfig
from elastic_export.serving.router_load import LoadMonitor, SloRouting


def _routing(budgets=(0.0, 0.3, 0.6), slo_ms="250", **params):
    config = RouterConfig({"parameters": {"budget_models": {"string_value": json.dumps(
        [[s, f"m{i}"] for i, s in enumerate(budgets)])}, "policy": {"string_value": "adaptive"},
        "slo_ms": {"string_value": slo_ms}, **{k: {"string_value": v} for k, v in params.items()}},
        "input": [], "output": []})
    points = {s: {1: 10.0 * (1 - s), 8: 80.0 * (1 - s)} for s in budgets}  # c = 10 ms x (1 - s) per row
    clock = [0.0]
    return SloRouting(config, points, clock=lambda: clock[0]), clock


def test_slo_routing_serves_dense_at_light_load_and_steps_sparser_when_it_cannot_keep_up():
    routing, clock = _routing()
    for i in range(200):  # 20 rows/s: dense's 100 rows/s capacity covers it
        clock[0] = i * 0.05
        decision = routing.arrive(1)
    assert decision.pair == (0.0, "fp32") and decision.meets
    for i in range(400):  # 150 rows/s: only 0.6 (250 rows/s) keeps up
        clock[0] = 10 + i / 150
        decision = routing.arrive(1)
    assert decision.pair == (0.6, "fp32") and decision.predicted_ms <= 250


def test_slo_routing_refuses_a_request_predicted_to_miss_the_slo_behind_the_rows_in_flight():
    routing, _ = _routing()
    routing.arrive(1)
    assert routing.admit(0.0, 1, ahead=0) == pytest.approx(10.0)  # nothing ahead: it runs, whatever its size
    assert routing.admit(0.0, 100, ahead=0) > 250
    routing.admit(0.0, 1, ahead=10)  # 2 x a + 10 x c + its own: 110 ms
    with pytest.raises(Overload) as err:  # the oldest of those 10 has waited 245 ms already: measured
        routing.admit(0.0, 1, ahead=10, waited_ms=245.0)
    assert "predicted 255 ms" in str(err.value)  # its wait so far and its own run, not the wait alone
    with pytest.raises(Overload, match="exceeds the SLO of 250 ms") as err:
        routing.admit(0.0, 1, ahead=30)
    assert err.value.reason == "overload"


def test_a_request_that_overflows_to_a_slow_fastest_budget_runs_where_it_was_routed():
    """A queue building at the routed budget sends a request to the fastest one first; when the fastest's
    own queue has waited too long, the request runs at the routed budget (predicted within the SLO there)
    rather than being refused: refused only when no budget it may move to admits it."""
    routing, _ = _routing()
    rows_at = {0.3: 23, 0.6: 2}  # at 0.3: 2 x 0 + 23 x 7 + 0.6's 2 rows (8 ms) + its own 7: 176 ms > 0.7 x 250
    assert routing.overflow(0.3, 1, 23, rows_at, [0.6]) == 0.6
    def waited(at):  # how long the oldest in flight at each budget has waited (ms)
        return lambda s: at.get(s, 0.0)

    calm = waited({0.6: 10.0})
    # the fastest admits it: its 2 rows and its own (12 ms) beside 0.3's 161 ms of rows, at half speed
    assert routing.place(0.3, 1, rows_at, calm, [0.6]) == (0.6, pytest.approx(24.0))
    slow = waited({0.6: 236.0})  # the oldest at 0.6 waited 236 ms: 240 with its own run
    assert routing.place(0.3, 1, rows_at, slow, [0.6]) == (0.3, pytest.approx(176.0))
    with pytest.raises(Overload, match="predicted 240 ms at sparsity 0.6"):
        routing.place(0.6, 1, rows_at, slow)  # named: its own budget or nothing
    assert routing.place(0.0, 1, {}, calm, [0.3, 0.6]) == (0.0, pytest.approx(10.0))  # nothing queued: where routed


def test_slo_routing_quality_floor_and_budgets_down():
    routing, clock = _routing(max_sparsity="0.3")
    for i in range(400):  # 150 rows/s: nothing at or below 0.3 keeps up; the floor holds: 0.3, the fastest allowed
        clock[0] = i / 150
        decision = routing.arrive(1)
    assert decision.pair == (0.3, "fp32") and not decision.meets
    routing, clock = _routing()
    routing.set_down([0.0])
    assert routing.arrive(1).pair == (0.3, "fp32")  # dense is down: the best one up


def test_load_monitor_counts_rows_in_flight_per_budget():
    clock = [0.0]
    monitor = LoadMonitor(clock=lambda: clock[0])
    assert monitor.arrive(0.3, 4) == 0
    clock[0] = 0.01
    assert monitor.arrive(0.3, 2) == 4
    clock[0] = 0.02
    assert monitor.arrive(None, 3) == 0
    assert monitor.in_flight == 3 and monitor.rows_at == {0.3: 6} and monitor.last_arrival == 0.02
    assert monitor.oldest_ms(0.3, 0.5) == pytest.approx(500.0) and monitor.oldest_ms(0.6, 0.5) == 0.0
    assert monitor.running(0.3, 0.1) == (4, pytest.approx(100.0))  # the first found it idle: its batch runs
    clock[0] = 0.2
    monitor.leave(0.3, 4, ticket=1)  # answered: the next batch takes what waits, now
    monitor.leave(None, 3, ticket=3)
    assert monitor.in_flight == 1 and monitor.rows_at == {0.3: 2}
    assert monitor.oldest_ms(0.3, 0.5) == pytest.approx(490.0)  # the second one is the oldest now
    assert monitor.running(0.3, 0.5) == (2, pytest.approx(300.0)) and monitor.running(0.6, 0.5) == (0, 0.0)
    clock[0] = 0.3
    monitor.arrive(0.3, 5)  # arrived while that batch runs: queued behind it
    assert monitor.running(0.3, 0.5) == (2, pytest.approx(300.0))


def test_a_running_batch_that_overruns_its_modelled_time_slows_the_admissions_predictions():
    """The batch running at dense (4 rows: 40 ms modelled) has run 120 ms: what queues behind it is predicted
    at least 3x its modelled time, before the service scale (20 batches) or the admission's correction (30
    answers) has measured any slow-down; a batch within its modelled time changes nothing."""
    routing, _ = _routing()
    routing.arrive(1)
    assert routing.admit(0.0, 1, ahead=12, running=(4, 30.0)) == pytest.approx(130.0)  # 2 x 0 + 12 x 10 + 10
    with pytest.raises(Overload, match="predicted 390 ms"):
        routing.admit(0.0, 1, ahead=12, running=(4, 120.0))


def test_the_wait_before_a_request_reached_the_router_counts_in_its_admission():
    """A merged request whose oldest query waited 120 ms in the API is predicted that much later: 130 ms of
    work ahead is admitted, 250 ms is past the SLO's 250 less its margin. Nothing ahead: it runs unless its
    wait alone makes it late."""
    routing, _ = _routing()
    routing.arrive(1)
    assert routing.admit(0.0, 1, ahead=12) == pytest.approx(130.0)
    with pytest.raises(Overload, match="predicted 250 ms"):
        routing.admit(0.0, 1, ahead=12, queued_ms=120.0)
    assert routing.admit(0.0, 1, ahead=0, queued_ms=200.0) == pytest.approx(10.0)
    with pytest.raises(Overload, match="predicted 240 ms"):
        routing.admit(0.0, 1, ahead=0, queued_ms=230.0)
    assert routing.admit(0.0, 1, ahead=0) == pytest.approx(10.0)


def test_fractional_rows_in_flight_leave_nothing_behind():
    """Rows cost fractions of a nominal row (their padded shape); every request that leaves takes its share
    back exactly, so a budget with nothing in flight has 0 rows, not a float residue that the admission would
    read as work ahead (and as rows at the other budgets, which share the cores)."""
    monitor = LoadMonitor(clock=lambda: 0.0)
    works = [0.1 * i + 0.302 for i in range(1, 12)]
    for w in works:
        monitor.arrive(0.5, w)
    tickets = range(1, 12)
    for t, w in zip(tickets, works):
        monitor.leave(0.5, w, t)
    assert monitor.rows_at[0.5] == 0 and monitor.in_flight == 0
