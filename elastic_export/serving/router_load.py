"""The router's load accounting and admission: what is in flight at each budget, and whether a request may run.

* :class:`LoadMonitor`: requests and rows in flight per budget, the oldest one's wait and the batch the
  budget model is running, as the router sees them (arrivals and answers).
* :func:`adaptive_policy`, :func:`arrival`: the adaptive policy built and fed one arrival, shared with the
  in-process runtime's ``adaptive`` policy (:class:`elastic_export.serving.policies.SloAdaptivePolicy`).
* :class:`SloRouting`: the router's use of :class:`elastic_export.serving.slo.SloPolicy` (``policy:
  adaptive``): the best-quality budget whose predicted latency quantile meets the SLO, and admission (a
  request predicted to miss the SLO behind the rows in flight is refused with
  :class:`~elastic_export.serving.router_budgets.Overload`, or moved to a faster budget the policy allows).

Both take a clock (seconds, monotonic), so the tests drive them without waiting. Standard library only
(the policy's module too): copied next to the router's ``model.py``, as
:mod:`~elastic_export.serving.router_budgets`.
"""

import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

try:
    from elastic_export.serving import slo
    from elastic_export.serving.router_budgets import Overload
except ImportError:  # copies next to the router's model.py, in a Python without this package
    import slo
    from router_budgets import Overload

DEFAULT_SLO_MS = 250.0  # the adaptive policy's objective when the config names none
INLINE_MAX_LOAD = 0.25  # adaptive policy: inline runs only while the estimated load is below this (SloRouting.light)


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


def adaptive_policy(sparsities: Sequence[float], precision: str, points: Dict[float, Dict[int, float]],
                    slo_ms: Optional[float] = None, quantile: float = slo.DEFAULT_QUANTILE,
                    max_sparsity: Optional[float] = None, clock=time.monotonic) -> "slo.SloPolicy":
    """The adaptive policy (``policy: adaptive``) over ``sparsities`` (densest first) at ``precision``: an
    :class:`~elastic_export.serving.slo.SloPolicy` on ``points`` (per sparsity, measured ``{batch: ms}``),
    an arrival-rate estimate on ``clock`` and ``slo_ms`` (None: :data:`DEFAULT_SLO_MS`). The router's
    :class:`SloRouting` and the in-process runtime's ``adaptive`` policy
    (:class:`elastic_export.serving.policies.SloAdaptivePolicy`) both build it here, so they decide alike."""
    pairs = [(s, precision) for s in sparsities]
    service = slo.ServiceModel({(s, precision): points[s] for s in sparsities})
    return slo.SloPolicy(pairs, service, slo_ms or DEFAULT_SLO_MS, quantile=quantile, max_sparsity=max_sparsity,
                         rate=slo.RateEstimator(clock=clock))


def arrival(policy: "slo.SloPolicy", now: float, rows: int, work: Optional[float] = None) -> "slo.Decision":
    """An arrival of ``rows`` rows costing ``work`` rows of the nominal length (default: ``rows``) at ``now``:
    counted in the policy's arrival rate and row weight; the policy's decision for it."""
    policy.rate.arrive(now, rows)
    policy.note_rows(rows, rows if work is None else work)
    return policy.decide(now)


class SloRouting:
    """The router's use of :class:`elastic_export.serving.slo.SloPolicy` (``policy: adaptive``): the
    best-quality budget whose predicted latency quantile meets the SLO, and admission (a request predicted
    to miss the SLO behind the rows in flight at its budget is refused).

    Args:
        config: the router's configuration (:class:`~elastic_export.serving.router_config.RouterConfig`:
            budgets, SLO, quantile, quality floor, precision).
        points: per served budget, measured ``{batch: ms}`` service times.
        clock: seconds (monotonic).
    """

    def __init__(self, config: Any, points: Dict[float, Dict[int, float]], clock=time.monotonic):
        self.policy = adaptive_policy(config.sparsities, config.precision, points, config.slo_ms, config.slo_quantile,
                                      config.max_sparsity, clock)
        self.precision, self._clock = config.precision, clock
        self.last = None  # the latest decision

    def arrive(self, rows: int, work: Optional[float] = None) -> Any:
        """Count an arrival of ``rows`` rows costing ``work`` rows of the nominal length (default: ``rows``);
        the decision (pair, prediction, rate) for it."""
        self.last = arrival(self.policy, self._clock(), rows, work)
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
