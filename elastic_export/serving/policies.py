"""Budget policies of :class:`elastic_export.serving.runtime.ElasticRuntime`: which (sparsity, precision)
pair serves a request.

* :class:`FixedPolicy`: one pair.
* :class:`LatencyTargetPolicy`: the highest-quality pair whose measured latency (p90 by default)
  at the request's batch size meets a target (from a :class:`LatencyProfile`); when none does,
  the fastest measured pair.
* :class:`LoadAdaptivePolicy`: queue depth and/or arrival rate -> a level, with hysteresis; the
  levels run from the highest quality down (with several precisions: the frontier, each level
  faster than every level above it).
* :class:`SloAdaptivePolicy`: the served router's ``--policy adaptive`` in-process: the same
  :class:`elastic_export.serving.slo.SloPolicy` (built by :func:`elastic_export.serving.router_load.
  adaptive_policy`), the best-quality budget whose predicted latency quantile meets an SLO at the
  measured arrival rate.

By name (:data:`POLICIES`, :func:`make_policy`): ``fixed``, ``latency``, ``load``, ``adaptive``;
``fixed`` and ``adaptive`` mean what the router's ``--policy`` of that name means (:data:`ROUTER_POLICIES`).

**Quality order.** Where the profile (or the caller) gives a quality figure for every candidate
pair, higher is better. Without one, the default order is: lower sparsity first, and at equal
sparsity fp32 > fp16 > int8 (:func:`quality_order`). So sparsity dominates: (0.1, int8) ranks
above (0.3, fp32), which matches what int8 costs on the models measured here (a fraction of a
point of embedding cosine) against what 20 % more pruning costs; give quality figures to rank
otherwise.

**Protocol.** The runtime calls ``policy.bind_pairs(pairs, precision)`` once with its loaded
pairs (ascending) and its current precision, then ``policy.select(batch)`` per request, which may
return a pair or a bare sparsity (served at the runtime's current precision): a policy written
before precisions existed (``bind(sparsities)``, ``select -> float``) keeps working; the base
class's ``bind_pairs`` calls its ``bind`` with the sparsities of the current precision. Every
request the runtime serves is reported first with ``policy.arrive(rows)`` (named budget or not, as
the router counts every request in its arrival rate); ``select`` is then called for those that name none.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

from elastic_export.core.errors import UserError
from elastic_export.core.latency_profile import PRECISION_ORDER, STATS, LatencyProfile, Pair, fmt_pair, key
from elastic_export.serving import slo
from elastic_export.serving.router_budgets import BudgetError, choose_budget
from elastic_export.serving.router_load import adaptive_policy, arrival

# How a served router picks a budget for a request that names none (`--policy`); the router file,
# copied standalone into the repository, spells the same tuple (checked where the repository is written).
ROUTER_POLICIES = ("fixed", "adaptive")


def match_budget(requested: float | None, listed: Sequence[float], default: float | None = None,
                 precision: str | None = None) -> float:
    """The loaded sparsity that serves ``requested``, by the router's one rule
    (:func:`elastic_export.serving.router_budgets.choose_budget`: within its tolerance of a listed one, else
    the smallest listed one at least as sparse), so a sparsity means the same in-process and served.

    Args:
        requested: the sparsity asked for; None: ``default``.
        listed: the loaded sparsities (at one precision).
        default: what None gets (default: the densest listed).
        precision: named in the message (where several are loaded).

    Raises:
        UserError: outside [0, 1), not a number, or sparser than the sparsest listed one (one line
            naming them).
    """
    fallback = default if default is not None else (min(listed) if listed else 0.0)
    try:
        return choose_budget(requested, listed, fallback)
    except BudgetError as e:
        raise UserError(f"{e}" + (f" (at {precision})" if precision else "")) from None


def _loaded_at(pairs: Sequence[Pair], precision: str, who: str = "") -> list[float]:
    """The sparsities loaded at ``precision``, ascending; UserError (one line, ``who`` first) naming the loaded
    precisions when there are none."""
    listed = sorted({s for s, q in pairs if q == precision})
    if not listed:
        loaded = sorted({q for _, q in pairs}, key=lambda q: PRECISION_ORDER.index(q) if q in PRECISION_ORDER else 99)
        raise UserError(f"{who}precision {precision!r} is not loaded; loaded: {', '.join(loaded)}")
    return listed


def quality_order(pairs: Sequence[Pair], quality: Mapping[Pair, float] | None = None) -> list[Pair]:
    """``pairs`` best first.

    Args:
        pairs: (sparsity, precision) pairs.
        quality: a figure per pair, higher is better; used only when it covers every pair,
            otherwise the default order (lower sparsity first, then fp32 > fp16 > int8). Ties
            follow the default order.
    """
    def default(pair: Pair) -> tuple[float, int]:
        return pair[0], PRECISION_ORDER.index(pair[1]) if pair[1] in PRECISION_ORDER else len(PRECISION_ORDER)

    if quality and all(p in quality for p in pairs):
        return sorted(pairs, key=lambda p: (-quality[p], *default(p)))
    return sorted(pairs, key=default)


def frontier(pairs: Sequence[Pair], latency: Mapping[Pair, float],
             quality: Mapping[Pair, float] | None = None) -> list[Pair]:
    """The quality/latency frontier, best quality first: a pair is kept when it is strictly faster
    than every pair of higher quality (a slower, worse pair is never worth serving).

    Args:
        pairs: candidates (each must have a latency).
        latency: ms per pair (e.g. a profile's p90 at one batch size).
        quality: optional figures (see :func:`quality_order`).
    """
    out: list[Pair] = []
    for p in quality_order(pairs, quality):
        if not out or latency[p] < min(latency[q] for q in out):
            out.append(p)
    return out


def _pair(value: float | Pair, precision: str) -> Pair:
    """A bare sparsity -> (sparsity, ``precision``); a pair with its sparsity rounded."""
    if isinstance(value, tuple):
        return key(value[0]), str(value[1])
    return key(value), precision


def _quality(profile: LatencyProfile, pairs: Sequence[Pair]) -> dict[Pair, float] | None:
    """The profile's quality figures for ``pairs``: all of them, none (the default order), or a
    UserError naming the first pair without one."""
    q = {p: profile.quality_of(*p) for p in pairs}
    have = [p for p, v in q.items() if v is not None]
    if not have:
        return None
    lacking = [p for p, v in q.items() if v is None]
    if lacking:
        raise UserError(f"latency profile: quality figures for some pairs but not for {fmt_pair(lacking[0])}; "
                        f"give one for every pair or none")
    return {p: float(v) for p, v in q.items()}


class Policy:
    """Chooses the (sparsity, precision) of a request. Subclasses override :meth:`select` and
    :meth:`bind` or :meth:`bind_pairs` (and :meth:`observe`)."""

    def bind(self, sparsities: Sequence[float]) -> None:
        """Called by :meth:`bind_pairs` with the sparsities of the current precision (ascending)."""

    def bind_pairs(self, pairs: Sequence[Pair], precision: str) -> None:
        """Called once by the runtime with its loaded pairs (ascending) and its current precision."""
        self.bind(sorted({s for s, p in pairs if p == precision}))

    def select(self, batch: int) -> float | Pair:
        """The pair (or sparsity, at the current precision) for a request of ``batch`` rows."""
        raise NotImplementedError

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> None:
        """Load report from the server (ignored by policies that do not use it)."""

    def arrive(self, rows: int) -> None:
        """A request of ``rows`` rows arrived (every request the runtime serves; ignored by policies that
        do not count arrivals)."""


class FixedPolicy(Policy):
    """Always the same pair.

    Args:
        sparsity: a sparsity, matched to the loaded ones as a request's is (:func:`match_budget`: 0.35
            with 0.3 and 0.4 loaded serves 0.4), as the router's ``--policy fixed`` matches its default
            (default 0.0: the densest loaded, the router's default too).
        precision: one of its precisions (None: the runtime's current precision).
    """

    def __init__(self, sparsity: float = 0.0, precision: str | None = None) -> None:
        self.sparsity, self.precision = key(sparsity), precision
        self._pair: Pair | None = None

    def bind_pairs(self, pairs: Sequence[Pair], precision: str) -> None:
        p = self.precision or precision
        listed = _loaded_at(pairs, p)
        multi = len({q for _, q in pairs}) > 1
        self._pair = (match_budget(self.sparsity, listed, precision=p if multi else None), p)

    def select(self, batch: int) -> Pair:
        return self._pair or (self.sparsity, self.precision or "fp32")


class LatencyTargetPolicy(Policy):
    """The highest-quality pair whose measured latency at the request's batch size meets a target.

    Args:
        profile: the measured profile (:func:`elastic_export.core.latency_profile.load_profile`).
        target_ms: the latency target in ms.
        stat: which percentile must meet it (``p90_ms`` default, ``p50_ms``, ``p99_ms``).
        precisions: choose among these precisions only (None: every loaded precision the profile
            measured).

    Candidates are the runtime's loaded pairs whose precision the profile measured; each must have
    ``stat`` at every profiled batch size. Quality: the profile's figures, else the default order
    (module docstring). A request whose batch size was not profiled uses the smallest profiled
    batch >= its own (else the largest profiled). When no pair meets the target the fastest one
    is used (the best that can be done); :attr:`missed` counts those requests.
    """

    def __init__(self, profile: LatencyProfile, target_ms: float, stat: str = "p90_ms",
                 precisions: Sequence[str] | None = None) -> None:
        if stat not in STATS:
            raise UserError(f"stat {stat!r}: choose from {', '.join(STATS)}")
        if not target_ms > 0:
            raise UserError(f"target_ms must be positive, got {target_ms}")
        self.profile, self.target_ms, self.stat = profile, float(target_ms), stat
        self.precisions = tuple(precisions) if precisions else None
        self.missed = 0
        self._choice: dict[int, tuple[Pair, bool]] = {}

    def bind(self, sparsities: Sequence[float]) -> None:
        self.bind_pairs([(key(s), "fp32") for s in sparsities], "fp32")

    def candidates(self, pairs: Sequence[Pair]) -> list[Pair]:
        """The loaded pairs this policy chooses among (see the class docstring)."""
        measured = self.profile.measured_precisions()
        out = [p for p in pairs if p[1] in measured and (self.precisions is None or p[1] in self.precisions)]
        if not out:
            loaded = sorted({p for _, p in pairs}, key=PRECISION_ORDER.index)
            raise UserError(f"latency profile measured precision {', '.join(measured)}; the runtime loaded "
                            f"{', '.join(loaded)}" + (f" (policy limited to {', '.join(self.precisions)})"
                                                      if self.precisions else ""))
        return out

    def bind_pairs(self, pairs: Sequence[Pair], precision: str) -> None:
        cands = self.candidates(pairs)
        for b in self.profile.batch_sizes():
            lacking = [p for p in cands if self.profile.latency(b, p[0], self.stat, p[1]) is None]
            if lacking:
                raise UserError(f"latency profile, batch {b}: no {self.stat} for sparsity "
                                f"{', '.join(map(fmt_pair, lacking))}; measure the profile again for these artifacts")
        order = quality_order(cands, _quality(self.profile, cands))
        self._choice = {}
        for b in self.profile.batch_sizes():
            ms = {p: self.profile.latency(b, p[0], self.stat, p[1]) for p in order}
            ok = next((p for p in order if ms[p] <= self.target_ms), None)
            self._choice[b] = (ok, True) if ok else (min(order, key=lambda p: ms[p]), False)

    def select(self, batch: int) -> Pair:
        pair, met = self._choice[self.profile.batch_for(batch)]
        if not met:
            self.missed += 1
        return pair


class LoadAdaptivePolicy(Policy):
    """Queue depth and/or arrival rate -> level, with hysteresis so it does not flap.

    Levels run from the highest quality (level 0) down. Going up (lower quality, faster): at once,
    by one level per observation while the queue holds ``up_depth`` or more requests, and straight
    to the first level whose utilisation (``arrival_rate`` x service time) is at most
    ``high_utilization`` when rates and ``service_ms`` are given. Going down (higher quality): one
    level, only after ``down_after`` consecutive observations with the queue at most
    ``down_depth`` and (with rates) that level's utilisation at most ``low_utilization``. The gaps
    (``up_depth`` vs ``down_depth``, ``high`` vs ``low`` utilisation, the ``down_after`` dwell)
    are the hysteresis.

    Args:
        up_depth: queue depth that moves one level down in quality.
        down_depth: queue depth at or below which the load counts as calm.
        down_after: calm observations in a row before one level up in quality.
        service_ms: mean service time in ms per sparsity (at the runtime's current precision) or
            per (sparsity, precision) pair (e.g. a profile's p50 at batch 1: :meth:`from_profile`);
            None: queue depth only.
        high_utilization: utilisation above which a level is too slow.
        low_utilization: utilisation the higher-quality level must stay under to move back.
        levels: the sparsities or pairs to choose among, ordered here by quality (default: with one
            precision every loaded sparsity of it; with ``service_ms`` over several precisions
            the frontier of those pairs, :func:`frontier`).
        quality: quality figure per pair (higher is better) for the order; None: the default order.
    """

    def __init__(self, up_depth: int = 4, down_depth: int = 1, down_after: int = 16,
                 service_ms: Mapping[float | Pair, float] | None = None, high_utilization: float = 0.85,
                 low_utilization: float = 0.6, levels: Sequence[float | Pair] | None = None,
                 quality: Mapping[Pair, float] | None = None) -> None:
        if not (up_depth > down_depth >= 0) or down_after < 1:
            raise UserError("LoadAdaptivePolicy needs up_depth > down_depth >= 0 and down_after >= 1")
        if not (0 < low_utilization < high_utilization):
            raise UserError("LoadAdaptivePolicy needs 0 < low_utilization < high_utilization")
        self.up_depth, self.down_depth, self.down_after = up_depth, down_depth, down_after
        self._service_in = dict(service_ms) if service_ms else None
        self._levels_in = list(levels) if levels else None
        self.quality = {_pair(p, "fp32"): float(v) for p, v in quality.items()} if quality else None
        self.high, self.low = high_utilization, low_utilization
        self.service_ms: dict[Pair, float] | None = None
        self.levels: list[Pair] = []
        self.level = 0
        self._calm = 0
        self.switches = 0

    @classmethod
    def from_profile(cls, profile: LatencyProfile, batch: int = 1, stat: str = "p50_ms",
                     **kwargs) -> "LoadAdaptivePolicy":
        """Service times (``stat`` at ``batch``) and quality figures of every measured pair of a
        profile; the levels are then their frontier over the runtime's loaded pairs."""
        b = profile.batch_for(batch)
        service = {(s, p): row[stat] for p in profile.measured_precisions()
                   for s, row in profile.rows(p).get(b, {}).items() if stat in row}
        quality = {(s, p): v for p, q in profile.quality.items() for s, v in q.items()} or None
        return cls(service_ms=service, quality=quality, **kwargs)

    def bind_pairs(self, pairs: Sequence[Pair], precision: str) -> None:
        service = {_pair(k, precision): float(v) for k, v in self._service_in.items()} if self._service_in else None
        if self._levels_in:
            levels = [_pair(v, precision) for v in self._levels_in]
            bad = [p for p in levels if p not in pairs]
            if bad:
                raise UserError(f"LoadAdaptivePolicy levels {', '.join(map(fmt_pair, bad))} are not listed budgets; "
                                f"listed: {', '.join(map(fmt_pair, pairs))}")
        else:
            wanted = {p for _, p in service} if service else {precision}
            levels = [p for p in pairs if p[1] in wanted]
        if service is not None:
            lacking = [p for p in levels if p not in service]
            if lacking:
                raise UserError(f"LoadAdaptivePolicy service_ms lacks sparsity {', '.join(map(fmt_pair, lacking))}")
        multi = len({p for _, p in levels}) > 1
        if multi and service is not None and not self._levels_in:
            levels = frontier(levels, service, self.quality)
        self.levels = quality_order(levels, self.quality)
        self.service_ms, self.level, self._calm = service, 0, 0

    def bind(self, sparsities: Sequence[float]) -> None:
        self.bind_pairs([(key(s), "fp32") for s in sparsities], "fp32")

    def _utilization(self, level: int, rate: float | None) -> float | None:
        if rate is None or self.service_ms is None:
            return None
        return rate * self.service_ms[self.levels[level]] / 1e3

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> None:
        top = len(self.levels) - 1
        want = self.level
        if queue_depth >= self.up_depth:
            want = self.level + 1
        if self._utilization(self.level, arrival_rate) is not None:
            floor = next((i for i in range(top + 1) if self._utilization(i, arrival_rate) <= self.high), top)
            want = max(want, floor)
        want = min(want, top)
        if want > self.level:
            self.level, self._calm = want, 0
            self.switches += 1
            return
        u = self._utilization(self.level - 1, arrival_rate) if self.level > 0 else None
        calm = self.level > 0 and queue_depth <= self.down_depth and (u is None or u <= self.low)
        self._calm = self._calm + 1 if calm else 0
        if self._calm >= self.down_after:
            self.level, self._calm = self.level - 1, 0
            self.switches += 1

    def select(self, batch: int) -> Pair:
        return self.levels[self.level]


class SloAdaptivePolicy(Policy):
    """The served router's ``--policy adaptive``, in-process: the best-quality budget whose predicted latency
    quantile at the measured arrival rate meets the SLO. It is the router's own
    :class:`~elastic_export.serving.slo.SloPolicy`, built by the router's
    :func:`~elastic_export.serving.router_load.adaptive_policy` and fed each arrival by its
    :func:`~elastic_export.serving.router_load.arrival` (every request the runtime serves counts, as every
    request counts at the router), so both pick the same budget for the same arrivals and service times.
    What the router adds around it (admission, overflow, service-scale and overhead corrections from its
    budget models' statistics) is not done in-process.

    Args:
        slo_ms: the objective (ms) for the ``quantile`` of the latency (None: the router's default, 250).
        points: per sparsity (at the policy's precision) or per pair, measured ``{batch: ms}`` service
            times (p50 of a batch alone, as the router measures at start-up); or give ``profile``.
        profile: a latency profile whose ``stat`` rows at the policy's precision give the points
            (:func:`~elastic_export.serving.slo.service_points_from_profile`, as the router reads one).
        quantile: which quantile the SLO bounds (the router's ``slo_quantile``; 0.99: p99).
        max_sparsity: a quality floor (the router's ``max_sparsity``; None: every loaded budget).
        precision: the precision served (None: the runtime's current one when it binds).
        stat: the profile's statistic read as service time.
        clock: seconds, monotonic (tests inject one).
    """

    def __init__(self, slo_ms: float | None = None, points: Mapping[float | Pair, Mapping[int, float]] | None = None,
                 *, profile: LatencyProfile | None = None, quantile: float = slo.DEFAULT_QUANTILE,
                 max_sparsity: float | None = None, precision: str | None = None, stat: str = "p50_ms",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (points is None) == (profile is None):
            raise UserError("SloAdaptivePolicy takes service times: points or a profile (one of them)")
        self.slo_ms, self.quantile, self.max_sparsity = slo_ms, quantile, max_sparsity
        self.points, self.profile, self.precision, self.stat, self.clock = points, profile, precision, stat, clock
        self.policy: slo.SloPolicy | None = None  # the router's policy, once bound
        self.last: Any = None  # the latest decision (slo.Decision)

    def bind_pairs(self, pairs: Sequence[Pair], precision: str) -> None:
        p = self.precision or precision
        sparsities = _loaded_at(pairs, p, "SloAdaptivePolicy: ")
        try:
            self.policy = adaptive_policy(sparsities, p, self._points(sparsities, p), self.slo_ms, self.quantile,
                                       self.max_sparsity, self.clock)
        except ValueError as e:
            raise UserError(f"SloAdaptivePolicy: {e}") from None
        self.last = None

    def _points(self, sparsities: Sequence[float], precision: str) -> dict[float, dict[int, float]]:
        """``{sparsity: {batch: ms}}`` for every loaded sparsity at ``precision``; UserError naming one lacking."""
        if self.profile is not None:
            got = slo.service_points_from_profile(self.profile.rows(precision), precision, sparsities, self.stat)
            have = {s: pts for (s, _), pts in (got or {}).items()}
        else:
            have = {_pair(k, precision): {int(b): float(ms) for b, ms in v.items()} for k, v in self.points.items()}
            have = {s: have[(s, precision)] for s in sparsities if (s, precision) in have}
        lacking = [s for s in sparsities if s not in have]
        if lacking:
            where = f"the latency profile's {self.stat} rows" if self.profile is not None else "points"
            raise UserError(f"SloAdaptivePolicy: {where} lack sparsity {fmt_pair((lacking[0], precision))}; "
                            f"give service times for every loaded budget")
        return have

    def arrive(self, rows: int) -> None:
        self.last = arrival(self._bound(), self.clock(), rows)

    def select(self, batch: int) -> Pair:
        """The latest arrival's decision (before any: the best-quality budget)."""
        return self.last.pair if self.last is not None else self._bound().current

    def _bound(self) -> slo.SloPolicy:
        if self.policy is None:
            raise UserError("SloAdaptivePolicy is not bound to a runtime (ElasticRuntime.set_policy binds it)")
        return self.policy


# The runtime's policies by name (make_policy); "fixed" and "adaptive" are the router's --policy of that name.
POLICIES: dict[str, type[Policy]] = {"fixed": FixedPolicy, "latency": LatencyTargetPolicy, "load": LoadAdaptivePolicy,
                                     "adaptive": SloAdaptivePolicy}


def make_policy(name: str, **kwargs: Any) -> Policy:
    """The runtime policy called ``name`` (:data:`POLICIES`) built with ``kwargs``: ``make_policy("adaptive",
    slo_ms=50, profile=load_profile(DIR))`` is the router's ``--policy adaptive --slo-ms 50`` in-process.

    Raises:
        UserError: an unknown name (the message lists the known ones).
    """
    if name not in POLICIES:
        raise UserError(f"policy {name!r}: unknown; choose from {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs)
