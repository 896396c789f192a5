"""Concurrent queries merged into one router request before they reach Triton.

Every request that reaches the router costs the API, the gRPC hop, the router and the server a few
milliseconds of CPU whatever its rows; short queries arrive far faster than that leaves room for on a
CPU. :class:`QueryBatcher` keeps at most ``max_in_flight`` router requests outstanding (a query that
finds fewer is sent at once: no wait at a light load); the queries that arrive meanwhile wait here and
go together in the next request: those that ask for the same budget (or none), oldest first, up to
``max_rows`` rows and ``max_tokens`` padded tokens, shorter ones first where the oldest leaves room, so
that a request pads little. Each waits until a slot frees: the time it waited here travels with the
request (:data:`QUEUED_PARAMETER`), and the router's admission counts it. A query predicted past the
deadline (a share of the SLO) is refused unsent: on arrival (the running request's rest and the next
one's round trip, from the latest measured: :class:`RoundTrips`), so that overload is refused fast
instead of queued, and again when a request is formed (its own wait and that request's round trip), so
that no doomed query makes the router refuse the young ones merged with it. Plain asyncio with an
injected clock; the router call is injected too (:class:`~elastic_export.serving.router_client.RouterClient`).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

QUEUED_PARAMETER = "queued_ms"  # the request parameter: how long its oldest query waited in the API
MAX_TOKENS = 4096  # padded tokens in one merged request (TEI's --max-batch-tokens)
MAX_IN_FLIGHT = 1  # merged requests outstanding: the queries arriving while one runs all go in the next
ROUND_TRIPS = 64  # merged requests whose round trips predict the next one's (RoundTrips)

Send = Callable[[Sequence[Any], "float | None", float], Awaitable[Any]]  # (rows, sparsity, queued_ms) -> Served


@dataclass
class _Item:
    rows: Sequence[Any]  # Tokens
    sparsity: float | None
    arrived: float
    future: asyncio.Future = field(repr=False)

    @property
    def length(self) -> int:
        return max(len(r.ids) for r in self.rows)


class RoundTrips:
    """What a merged request of ``rows`` rows takes, from the latest :data:`ROUND_TRIPS` measured: the line
    ``a + c x rows`` through the median round trip of each row count, weighted by how many it has (a and c at
    least 0; a slow trip moves its row count's median little, and a rare row count weighs little), or None
    before :attr:`MIN_SAMPLES` of them. With one row count measured the line is flat (``c = 0``): a query is
    refused on this prediction, and a slope guessed from one point (``ms / rows``) refused bursts at a
    light load, whose trips of one row cost mostly their fixed part."""

    MIN_SAMPLES = 8

    def __init__(self, size: int = ROUND_TRIPS):
        self.samples: deque = deque(maxlen=size)
        self._line: tuple[float, float] | None = None  # (a, c), fitted once per new round trip

    def add(self, rows: int, ms: float) -> None:
        self.samples.append((rows, ms))
        self._line = None

    def ms(self, rows: int) -> float | None:
        if len(self.samples) < self.MIN_SAMPLES:
            return None
        if self._line is None:
            self._line = self._fit()
        a, c = self._line
        return a + c * rows

    def _fit(self) -> tuple[float, float]:
        from elastic_export.serving.slo import least_squares_slope

        by_rows: dict = {}
        for n, ms in self.samples:
            by_rows.setdefault(n, []).append(ms)
        ns, medians, counts = zip(*((n, statistics.median(v), len(v)) for n, v in by_rows.items()))
        c = max(0.0, least_squares_slope(ns, medians, counts) or 0.0)
        weight = sum(counts)
        mean_n = sum(n * w for n, w in zip(ns, counts)) / weight
        mean_ms = sum(m * w for m, w in zip(medians, counts)) / weight
        return max(0.0, mean_ms - c * mean_n), c


class LoopLag:
    """How late the event loop runs what is ready: a task that asks to wake every ``interval_s`` and keeps how
    much later it woke (ms), the median of the latest ``window`` wakes. A request waits about that long
    between reaching the process and reaching the batcher (parsed, routed, tokenized): time the batcher
    cannot see otherwise, while the cores are saturated. The median, not the largest: one long step of the
    loop (a big request's tokens, a collection) is not a wait of the queries that come after it."""

    def __init__(self, interval_s: float = 0.01, window: int = 25, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.recent: deque = deque([0.0], maxlen=window)
        self._task: asyncio.Task | None = None

    def ms(self) -> float:
        return statistics.median(self.recent)

    def start(self) -> None:
        """Start measuring on the running loop (once)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            t = self.clock()
            await asyncio.sleep(self.interval_s)
            self.recent.append(max(0.0, (self.clock() - t - self.interval_s) * 1e3))


@dataclass
class BatchStats:
    """What the batcher sent: router requests, the queries in them, and padded against real tokens."""

    requests: int = 0
    queries: int = 0
    tokens: int = 0
    padded: int = 0
    late: int = 0  # queries refused unsent: they waited past the deadline
    refused: int = 0  # queries refused on arrival: predicted past the deadline

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.tokens / self.padded if self.padded else 0.0

    def count(self, queries: int, lengths: Sequence[int]) -> None:
        """One request as sent: ``queries`` queries (or documents) whose rows have these token lengths, padded
        to the longest."""
        self.requests += 1
        self.queries += queries
        self.tokens += sum(lengths)
        self.padded += len(lengths) * max(lengths)


class QueryBatcher:
    """Queries of one or a few rows merged into router requests (module docstring).

    Args:
        send: the router call, ``await send(rows, sparsity, queued_ms)`` -> an object with ``vectors``
            (one per row, in order), ``sparsity`` and ``precision``.
        max_rows: the most rows in one router request.
        max_tokens: the most padded tokens (rows x the longest) in one router request.
        max_in_flight: router requests outstanding at once.
        deadline_ms: a query that has waited longer than this is not sent: it ends with ``late(waited_ms)``
            (it could no longer be answered within the SLO); None: no deadline.
        late: the exception such a query gets.
        lag_ms: how late the event loop runs (:class:`LoopLag`): counted as each query's wait before it
            arrived here, in its deadline, its prediction and the ``queued_ms`` the router admits it with.
        clock: seconds (monotonic).
    """

    def __init__(self, send: Send, max_rows: int, max_tokens: int = MAX_TOKENS, max_in_flight: int = MAX_IN_FLIGHT,
                 deadline_ms: float | None = None, late: Callable[[float], BaseException] = TimeoutError,
                 lag_ms: Callable[[], float] = lambda: 0.0, clock: Callable[[], float] = time.monotonic):
        self.send, self.max_rows, self.max_tokens, self.max_in_flight = send, max_rows, max_tokens, max_in_flight
        self.deadline_ms, self.late, self.lag_ms = deadline_ms, late, lag_ms
        self.clock, self.in_flight, self.stats = clock, 0, BatchStats()
        self.round_trips = RoundTrips()
        self._waiting: list[_Item] = []
        self._running: dict[int, tuple[float, int]] = {}  # merged requests in flight: (sent at, rows)

    async def embed(self, rows: Sequence[Any], sparsity: float | None) -> Any:
        """The query's answer (a ``Served`` of its own rows), from whichever merged request carried it."""
        lag = self.lag_ms()  # what it likely waited before it got here: counted as waited
        item = _Item(rows, sparsity, self.clock() - lag / 1e3, asyncio.get_running_loop().create_future())
        predicted = lag + (self.predicted_ms(len(rows)) or 0.0)
        if self.deadline_ms is not None and predicted > self.deadline_ms:
            self.stats.refused += 1
            raise self.late(predicted)
        self._waiting.append(item)
        self._dispatch()
        return await item.future

    def predicted_ms(self, rows: int) -> float | None:
        """When a query of ``rows`` rows arriving now would be answered (ms) while every slot is busy: the
        running requests' predicted rest, then the next request with every row waiting and this one. None
        with a slot free (it goes at once, always) or before enough round trips are measured."""
        if self.in_flight < self.max_in_flight or not self._running:
            return None
        now, rest = self.clock(), 0.0
        for sent, n in self._running.values():
            ms = self.round_trips.ms(n)
            if ms is None:
                return None
            rest = max(rest, ms - (now - sent) * 1e3)
        nxt = self.round_trips.ms(sum(len(i.rows) for i in self._waiting) + rows)
        return None if nxt is None else rest + nxt

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _dispatch(self) -> None:
        while self._waiting and self.in_flight < self.max_in_flight:
            batch = self.take()
            if not batch:
                return
            self.in_flight += 1
            asyncio.ensure_future(self._run(batch))

    def take(self) -> list[_Item]:
        """The next merged request: the oldest waiting query, then the others asking for its budget, shortest
        first, while rows and padded tokens fit (the oldest always goes)."""
        self._drop_late()
        self._waiting = [i for i in self._waiting if not i.future.done()]  # clients gone: never sent
        if not self._waiting:
            return []
        first = self._waiting[0]
        same = sorted((i for i in self._waiting[1:] if i.sparsity == first.sparsity), key=lambda i: i.length)
        batch, rows, longest = [first], len(first.rows), first.length
        for item in same:
            width = max(longest, item.length)
            if rows + len(item.rows) > self.max_rows or (rows + len(item.rows)) * width > self.max_tokens:
                continue
            batch.append(item)
            rows, longest = rows + len(item.rows), width
        taken = {id(i) for i in batch}
        self._waiting = [i for i in self._waiting if id(i) not in taken]
        return batch

    def _drop_late(self) -> None:
        """Queries that would end past the deadline end now, unsent (counted in ``stats.late``): each on its own
        wait and the round trip of a request carrying it and every younger query (up to ``max_rows``; 0 before
        enough trips are measured). Youngest first: once one fails, every older one would too. The router
        admits a merged request on its oldest query's wait, so a doomed query sent along would have it refuse
        the young ones that could still be answered in time."""
        if self.deadline_ms is None:
            return
        now, rows, doomed = self.clock(), 0, False
        for item in reversed(self._waiting):  # oldest first in the list: youngest first here
            rows = min(self.max_rows, rows + len(item.rows))
            ms = (now - item.arrived) * 1e3 + (self.round_trips.ms(rows) or 0.0)
            doomed = doomed or ms > self.deadline_ms
            if doomed and not item.future.done():
                item.future.set_exception(self.late(ms))
                self.stats.late += 1

    async def _run(self, batch: list[_Item]) -> None:
        rows = [r for item in batch for r in item.rows]
        start = self.clock()
        queued_ms = (start - batch[0].arrived) * 1e3
        self.stats.count(len(batch), [len(r.ids) for r in rows])
        self._running[id(batch)] = (start, len(rows))
        try:
            served = await self.send(rows, batch[0].sparsity, queued_ms)
            self.round_trips.add(len(rows), (self.clock() - start) * 1e3)
        except BaseException as e:  # the router's refusal (or a failure) is every merged query's
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(e)
        else:
            start = 0
            for item in batch:
                n = len(item.rows)
                if not item.future.done():
                    item.future.set_result(type(served)(served.vectors[start:start + n], served.sparsity, served.precision))
                start += n
        finally:
            del self._running[id(batch)]
            self.in_flight -= 1
            self._dispatch()

