"""Concurrent queries merged into one router request (``elastic_export.serving.coalesce``), with the router
call injected and a manual clock: sent at once when a slot is free, merged while the slots are busy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from elastic_export.serving import router_budgets
from elastic_export.serving.coalesce import QUEUED_PARAMETER, QueryBatcher
from elastic_export.serving.openai_schema import Tokens
from elastic_export.serving.router_client import Served


class Router:
    """The injected router call: records each request, answers when released (row i's vector is [id]),
    or refuses when told to."""

    def __init__(self):
        self.sent, self.gates, self.refuse = [], [], None

    async def __call__(self, rows, sparsity, queued_ms):
        gate = asyncio.Event()
        self.sent.append(([r.ids[0] for r in rows], sparsity, queued_ms))
        self.gates.append(gate)
        await gate.wait()
        if self.refuse is not None:
            raise self.refuse
        return Served(np.array([[r.ids[0]] for r in rows], dtype=np.float32), sparsity or 0.3, "fp32")


def _q(i: int, length: int = 5) -> list[Tokens]:
    return [Tokens([i] + [0] * (length - 1), [0] * length)]


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_query_that_finds_a_free_slot_goes_at_once_and_busy_slots_merge_the_rest():
    async def go():
        now, router = [10.0], Router()
        b = QueryBatcher(router, max_rows=64, max_in_flight=2, clock=lambda: now[0])
        first = [asyncio.ensure_future(b.embed(_q(i), None)) for i in (1, 2)]  # two slots: two requests
        await _settle()
        assert [ids for ids, _, _ in router.sent] == [[1], [2]] and router.sent[0][2] == 0.0
        rest = [asyncio.ensure_future(b.embed(_q(i), None)) for i in range(3, 8)]
        await _settle()
        assert len(router.sent) == 2 and b.waiting == 5  # both slots busy: they wait
        now[0] += 0.040
        router.gates[0].set()
        await _settle()
        assert sorted(router.sent[2][0]) == [3, 4, 5, 6, 7] and router.sent[2][2] == pytest.approx(40.0)
        for g in router.gates[1:]:
            g.set()
        got = await asyncio.gather(*first, *rest)
        assert [float(s.vectors[0, 0]) for s in got] == [1, 2, 3, 4, 5, 6, 7]  # each its own rows
        assert all(s.sparsity == 0.3 and s.vectors.shape == (1, 1) for s in got)
        assert (b.stats.requests, b.stats.queries, b.in_flight) == (3, 7, 0)
    asyncio.run(go())


def test_only_queries_asking_for_the_same_budget_merge_within_the_row_and_token_bounds():
    async def go():
        router = Router()
        b = QueryBatcher(router, max_rows=4, max_tokens=40, max_in_flight=1)
        tasks = [asyncio.ensure_future(b.embed(_q(0), None))]
        await _settle()
        tasks += [asyncio.ensure_future(b.embed(q, s)) for q, s in
                  [(_q(1, 20), None), (_q(2), 0.5), (_q(3), None), (_q(4), None), (_q(5), None), (_q(6), None)]]
        await _settle()
        router.gates[0].set()
        await _settle()
        # the oldest (20 tokens) first; shorter ones while 40 padded tokens allow: one more (2 x 20)
        assert router.sent[1][0] == [1, 3] and router.sent[1][1] is None
        router.gates[1].set()
        await _settle()
        assert router.sent[2][0] == [2] and router.sent[2][1] == 0.5  # its own budget: alone
        router.gates[2].set()
        await _settle()
        assert router.sent[3][0] == [4, 5, 6]
        router.gates[3].set()
        await asyncio.gather(*tasks)
        assert b.stats.padding_waste == pytest.approx(1 - (5 + 20 + 5 + 5 + 15) / (5 + 40 + 5 + 15))
    asyncio.run(go())


def test_a_refusal_is_every_merged_querys_and_a_query_whose_client_left_is_never_sent():
    async def go():
        router = Router()
        b = QueryBatcher(router, max_rows=64, max_in_flight=1)
        t0 = asyncio.ensure_future(b.embed(_q(0), None))
        await _settle()
        gone = asyncio.ensure_future(b.embed(_q(1), None))
        merged = [asyncio.ensure_future(b.embed(_q(i), None)) for i in (2, 3)]
        await _settle()
        gone.cancel()  # the client went away while it waited
        router.refuse = RuntimeError("overloaded")
        router.gates[0].set()
        await _settle()
        assert router.sent[1][0] == [2, 3]
        router.gates[1].set()
        for t in (t0, *merged):
            with pytest.raises(RuntimeError, match="overloaded"):
                await t
        assert b.in_flight == 0 and b.waiting == 0
    asyncio.run(go())


def test_the_router_reads_the_wait_before_it_was_sent():
    assert QUEUED_PARAMETER == router_budgets.QUEUED_PARAMETER  # one name on both sides
    assert router_budgets.queued_ms('{"queued_ms": 12.5}') == 12.5
    assert router_budgets.queued_ms('{"sparsity": 0.5}') == 0.0 and router_budgets.queued_ms(None) == 0.0
    for bad in ('{"queued_ms": "x"}', '{"queued_ms": -3}', '{"queued_ms": NaN}', "[1]", "not json queued_ms"):
        assert router_budgets.queued_ms(bad) == 0.0


def test_a_query_that_waited_past_the_deadline_is_refused_unsent():
    async def go():
        now, router = [0.0], Router()
        b = QueryBatcher(router, max_rows=64, max_in_flight=1, deadline_ms=200.0,
                         late=lambda ms: RuntimeError(f"late {ms:.0f}"), clock=lambda: now[0])
        t0 = asyncio.ensure_future(b.embed(_q(0), None))
        await _settle()
        old = asyncio.ensure_future(b.embed(_q(1), None))
        await _settle()
        now[0] = 0.150
        young = asyncio.ensure_future(b.embed(_q(2), None))
        await _settle()
        now[0] = 0.250  # the slot frees: query 1 has waited 250 ms, query 2 100 ms
        router.gates[0].set()
        await _settle()
        assert router.sent[1][0] == [2] and router.sent[1][2] == pytest.approx(100.0)
        with pytest.raises(RuntimeError, match="late 250"):
            await old
        router.gates[1].set()
        await asyncio.gather(t0, young)
        assert b.stats.late == 1 and b.stats.queries == 2
    asyncio.run(go())


def test_a_query_predicted_past_the_deadline_is_refused_on_arrival():
    """Round trips measured at 100 ms for 1 row and 140 ms for 5 (a line 90 + 10 x rows): with one request of
    1 row running for 10 ms, a query is answered in 90 ms (its rest) + the next request's round trip; the
    third query that would wait makes that 90 + 120 = 210 ms, past the 200 ms deadline: refused at once,
    unsent. With the slot free a query always goes."""
    async def go():
        now, router = [0.0], Router()
        b = QueryBatcher(router, max_rows=64, max_in_flight=1, deadline_ms=200.0,
                         late=lambda ms: RuntimeError(f"predicted {ms:.0f}"), clock=lambda: now[0])
        for rows, ms in [(1, 100.0), (5, 140.0)] * 4:
            b.round_trips.add(rows, ms)
        assert b.predicted_ms(1) is None  # nothing running: it goes at once
        running = asyncio.ensure_future(b.embed(_q(0), None))
        await _settle()
        now[0] = 0.010
        assert b.predicted_ms(1) == pytest.approx(190.0)
        ok = [asyncio.ensure_future(b.embed(_q(i), None)) for i in (1, 2)]
        await _settle()
        with pytest.raises(RuntimeError, match="predicted 210"):
            await b.embed(_q(3), None)
        assert b.stats.refused == 1 and b.waiting == 2
        for _ in range(2):
            router.gates[-1].set()
            await _settle()
        await asyncio.gather(running, *ok)
        assert router.sent[1][0] == [1, 2]
    asyncio.run(go())


def test_the_event_loops_lag_counts_as_time_waited_before_the_batcher():
    """A loop running 150 ms late: a query is taken to have waited that long already (its queued_ms and its
    deadline count it); 230 ms late, it is refused at once, unsent, with nothing running. LoopLag measures
    how late a sleeping task wakes."""
    async def go():
        lag, router = [150.0], Router()
        b = QueryBatcher(router, max_rows=64, deadline_ms=200.0, late=lambda ms: RuntimeError(f"late {ms:.0f}"),
                         lag_ms=lambda: lag[0])
        t = asyncio.ensure_future(b.embed(_q(1), None))
        await _settle()
        assert router.sent[0][2] >= 150.0
        router.gates[0].set()
        await t
        lag[0] = 230.0
        with pytest.raises(RuntimeError, match="late 230"):
            await b.embed(_q(2), None)
        assert len(router.sent) == 1 and b.stats.refused == 1
        from elastic_export.serving.coalesce import LoopLag

        now = [0.0]
        monitor = LoopLag(interval_s=0.01, clock=lambda: now[0])
        monitor.start()
        await asyncio.sleep(0)  # it reads the clock, then sleeps
        now[0] = 0.060  # woke 50 ms late
        await asyncio.sleep(0.02)
        assert max(monitor.recent) == pytest.approx(50.0)
        await monitor.stop()
        monitor.recent.extend([50.0, 50.0])
        assert monitor.ms() == pytest.approx(50.0)  # late wake after late wake: the loop is late
        monitor.recent.extend([0.0] * 5 + [400.0])
        assert monitor.ms() == 0.0  # one long step of the loop is no wait of the queries after it
    asyncio.run(go())


def test_round_trips_are_robust_to_a_slow_trip_and_flat_from_one_row_count():
    """Trips of 1 row at 20 ms and one of 300 ms: 20 ms (the median); with only 1-row trips measured, 10 rows
    are predicted at the 1-row time, not 10 x (a burst at a light load is not refused on a guessed slope)."""
    from elastic_export.serving.coalesce import RoundTrips

    trips = RoundTrips()
    for ms in [20.0] * 9 + [300.0]:
        trips.add(1, ms)
    assert trips.ms(1) == pytest.approx(20.0) and trips.ms(10) == pytest.approx(20.0)
    for _ in range(20):
        trips.add(1, 20.0)
        trips.add(11, 70.0)  # 5 ms a row beyond the first
    assert trips.ms(6) == pytest.approx(45.0)
    trips.add(1, 900.0)  # a slow trip among many of its row count: its median holds
    assert trips.ms(6) == pytest.approx(45.0)


def test_each_query_is_refused_on_its_own_wait_and_the_next_round_trip():
    """Round trips measured at 60 ms: when the slot frees, a query that waited 190 ms would end at 250, past the
    200 ms deadline: refused unsent; the query that waited 100 ms goes (160 ms), with its own wait as the
    request's queued_ms, so the router does not refuse it for the old one's."""
    async def go():
        now, router = [0.0], Router()
        b = QueryBatcher(router, max_rows=64, max_in_flight=1, deadline_ms=200.0,
                         late=lambda ms: RuntimeError(f"late {ms:.0f}"), clock=lambda: now[0])
        for _ in range(8):
            b.round_trips.add(1, 60.0)
        t0 = asyncio.ensure_future(b.embed(_q(0), None))
        await _settle()
        old = asyncio.ensure_future(b.embed(_q(1), None))  # arrives at 0: predicted 60 + 60, accepted
        await _settle()
        now[0] = 0.090
        young = asyncio.ensure_future(b.embed(_q(2), None))
        await _settle()
        now[0] = 0.190  # the slot frees: query 1 waited 190 ms, query 2 100 ms
        router.gates[0].set()
        await _settle()
        with pytest.raises(RuntimeError, match="late 250"):
            await old
        assert router.sent[1][0] == [2] and router.sent[1][2] == pytest.approx(100.0)
        router.gates[1].set()
        await asyncio.gather(t0, young)
        assert b.stats.late == 1
    asyncio.run(go())
