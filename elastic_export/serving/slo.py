"""The served router's objective: the best-quality (budget, precision) pair whose predicted latency
quantile at the observed load meets the SLO.

Everything here is plain Python with an injected clock (the Triton router only calls it):

* :class:`ServiceModel`: service time of a batch of ``n`` rows at a pair, ``S(n) = a + c·n`` ms, fitted
  from measurements at two or more batch sizes (the router measures its budgets at start-up on the
  serving machine, or reads the directory's latency profile).
* :class:`RateEstimator`: the arrival rate since the load last changed (a two-sample Poisson test on the
  last 0.5 s and its latest half against what came before), over at most a sliding window (2 s).
* :func:`predict_quantile_ms`: the latency quantile of a dynamic-batching server with Poisson arrivals
  (a bulk-service queue): in steady state each batch holds the arrivals of the previous cycle, so a
  cycle lasts ``T = a / (1 - λc)`` (stable only while ``λc < 1``); an arrival finds the server busy with
  probability ``min(1, λT)``, then waits for a residual uniform on ``[0, T]``, and its own batch holds
  ``Poisson(λT)`` other rows at that quantile.
* :class:`ServiceScale`: what the server observes refreshes the model: per budget, the factor on its
  service times under which the model's median at the admitted rate (the queue forms from the requests
  admitted, not from those refused) equals the measured median of its recent answers (clamped; the
  median rather than the SLO's own quantile, which a few hundred answers estimate too noisily and a
  burst of late answers would swing for seconds): what the model leaves out (the server's and the
  clients' own costs on shared cores, a slower machine) is measured, not guessed, and it moves the load
  at which a budget saturates too. Answers older than 10 s are forgotten, and a budget not served for
  2 s takes the scale of the one served now (not its own, from a spike).
* :class:`SloPolicy`: the decision. Candidates run best quality first (never past ``max_sparsity``);
  the served pair is the best one whose corrected prediction meets ``SLO x (1 - margin)``; a pair better
  than the current one must meet it with ``hysteresis`` more slack (so the choice does not flap), and
  it goes denser as soon as one does (at most ``max_step`` pairs per move, past those measured just
  now). :meth:`SloPolicy.admit`: a request whose own predicted latency (the rows in flight ahead of it
  at its pair drained first, and those at the other pairs, which share the cores; corrected by
  :class:`AdmissionCorrection`, a line fitted to what admitted requests measured) exceeds the SLO is
  refused rather than queued.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

Pair = Tuple[float, str]
DEFAULT_QUANTILE = 0.99
DEFAULT_MARGIN = 0.2  # the prediction must leave this fraction of the SLO free
DEFAULT_HYSTERESIS = 0.1  # and a denser pair this much more
DEFAULT_DWELL_S = 1.0  # and the current pair must have served this long
DEFAULT_MAX_STEP = 3  # a move denser goes at most this many pairs, past them only to pairs measured just now
CORRECTION_QUANTILE = 0.5  # the quantile at which the service scale matches the model to the answers
ADMISSION_QUANTILE = 0.9  # the quantile of the admission's residuals added to its fitted line


def poisson_quantile(mean: float, q: float) -> int:
    """The smallest ``k`` with ``P(Poisson(mean) <= k) >= q``."""
    if mean <= 0:
        return 0
    if mean > 200:  # normal approximation (exact sums underflow)
        return int(math.ceil(mean + _z(q) * math.sqrt(mean)))
    term = cdf = math.exp(-mean)
    k = 0
    while cdf < q:
        k += 1
        term *= mean / k
        cdf += term
    return k


def _z(q: float) -> float:
    """The standard normal quantile, by bisection."""
    lo, hi = -10.0, 10.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class Affine:
    """``S(n) = a + c·n`` ms."""

    a: float
    c: float

    def ms(self, rows: float) -> float:
        return self.a + self.c * rows


def fit_affine(points: Mapping[int, float]) -> Affine:
    """Least squares ``a + c·n`` through ``{batch: ms}`` (one point: ``c = ms``, ``a = 0``); ``a, c >= 0``."""
    if not points:
        raise ValueError("no service-time measurements")
    if len(points) == 1:
        (n, ms), = points.items()
        return Affine(0.0, float(ms) / max(n, 1))
    ns, ms = list(map(float, points)), [float(v) for v in points.values()]
    mn, mm = sum(ns) / len(ns), sum(ms) / len(ms)
    c = least_squares_slope(ns, ms)
    c = max(mm / max(mn, 1.0) if c is None else c, 1e-6)
    a = max(mm - c * mn, 0.0)
    return Affine(a, c)


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """The least-squares slope of ``ys`` on ``xs`` (None when the ``xs`` do not spread)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var > 1e-9 else None


def _forget_before(answers: Deque[Tuple[float, ...]], cutoff: float) -> None:
    """Drop the entries of ``answers`` (time first, oldest first) older than ``cutoff``."""
    while answers and answers[0][0] < cutoff:
        answers.popleft()


class ServiceModel:
    """Service time per pair and batch size: :func:`fit_affine` of each pair's measurements.

    Args:
        points: per pair, measured ``{batch: ms}`` (p50 of a batch alone).
    """

    def __init__(self, points: Mapping[Pair, Mapping[int, float]]) -> None:
        self.fits: Dict[Pair, Affine] = {p: fit_affine(v) for p, v in points.items()}

    def ms(self, pair: Pair, rows: float) -> float:
        """Service time of a batch of ``rows`` at ``pair`` (ms)."""
        return self.fits[pair].ms(rows)

    def affine(self, pair: Pair) -> Affine:
        return self.fits[pair]


class RateEstimator:
    """Rows arriving per second since the load last changed, over at most a sliding window.

    The estimate counts the rows since the *origin*: the window's start, or the latest detected step
    in the load, whichever is later. A step is detected when the last ``short_s`` (or its latest half,
    for a sudden step) holds a rate that differs from the one before it, since the origin, by more than
    ``sigmas`` standard deviations of the two Poisson counts; the origin then moves to that window's
    start. So a step, up or down, moves the estimate within about half a second, and the estimate then
    grows more stable as the new load lasts, where a window that straddles the step would mix both
    loads for its whole length (measured: a step from 1.4x down to 0.6x took the two-second window
    1.8 s to follow).

    Args:
        window_s: the longest window (stable at a constant load).
        short_s: the test window (and its latest half).
        sigmas: the test's threshold in standard deviations.
        clock: seconds (monotonic).
    """

    def __init__(self, window_s: float = 2.0, short_s: float = 0.5, sigmas: float = 4.0,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.window_s, self.short_s, self.sigmas = window_s, short_s, sigmas
        self.clock = clock or time.monotonic
        self._times: List[float] = []  # arrival times, oldest first, from self._head on
        self._cum: List[int] = []  # rows up to and including each arrival
        self._head = 0
        self._origin: Optional[float] = None
        self.fell_at = -math.inf  # when a step down in the load was last detected

    @property
    def origin(self) -> Optional[float]:
        """Where the estimate's count starts: the first arrival or the latest detected step (None before any)."""
        return self._origin

    def arrive(self, now: Optional[float] = None, rows: int = 1) -> None:
        now = self.clock() if now is None else now
        if self._origin is None:
            self._origin = now
        self._times.append(now)
        self._cum.append((self._cum[-1] if self._cum else 0) + rows)
        self._trim(now)

    def _trim(self, now: float) -> None:
        self._head = bisect.bisect_left(self._times, now - self.window_s, self._head)
        if self._head > 4096:  # drop what the window left behind
            del self._times[:self._head], self._cum[:self._head]
            self._head = 0

    def _rows_since(self, t: float) -> int:
        """Rows that arrived at or after ``t`` (within the window)."""
        if not self._cum:
            return 0
        i = bisect.bisect_left(self._times, t, self._head)
        return self._cum[-1] - (self._cum[i - 1] if i > 0 else 0)

    def _stepped(self, now: float, origin: float, width: float) -> bool:
        """Whether the rows of the last ``width`` s arrived at a rate other than those between ``origin``
        and it (a two-sample test on Poisson counts; the earlier part at least ``short_s`` long); a step
        down also sets :attr:`fell_at`."""
        before_s = now - width - origin
        if before_s < self.short_s:
            return False
        recent = self._rows_since(now - width)
        before = self._rows_since(origin) - recent
        var = max(recent, 1) / width ** 2 + max(before, 1) / before_s ** 2
        if abs(recent / width - before / before_s) <= self.sigmas * math.sqrt(var):
            return False
        if recent / width < before / before_s:
            self.fell_at = now
        return True

    def rate(self, now: Optional[float] = None) -> float:
        """The estimate (rows/s) since the latest step or over the window (class docstring)."""
        now = self.clock() if now is None else now
        if self._origin is None:
            return 0.0
        self._trim(now)
        origin = max(self._origin, now - self.window_s)
        for width in (self.short_s / 2, self.short_s):
            if self._stepped(now, origin, width):
                self._origin = origin = now - width
                break
        return self._rows_since(origin) / max(now - origin, self.short_s / 2)


def predict_quantile_ms(service: Affine, rate: float, quantile: float = DEFAULT_QUANTILE) -> float:
    """The ``quantile`` of the latency (ms) at ``rate`` arrivals/s of one row each (module docstring);
    ``inf`` when the server cannot keep up."""
    lam = rate / 1e3  # per ms
    if lam * service.c >= 1.0:
        return math.inf
    cycle = service.a / (1.0 - lam * service.c) if service.a > 0 else service.c
    busy = min(1.0, lam * cycle)
    wait = cycle * max(0.0, 1.0 - (1.0 - quantile) / busy) if busy > 0 else 0.0
    return wait + service.ms(1 + poisson_quantile(lam * cycle, quantile))


class ServiceScale:
    """How much slower than the service model the server serves a pair: the factor ``s`` on its
    ``S(n)`` (``a`` and ``c`` alike) under which :func:`predict_quantile_ms` at ``quantile``, each answer at
    the rate it arrived at, leaves a share ``1 - quantile`` of the last ``size`` answers within ``horizon_s``
    above it; ``s`` within ``bounds``, 1 until ``min_samples`` answers are in.

    A scale on the service time, not a factor on the predicted latency: what the model leaves out (the
    server's, the router's and the clients' costs per request on the same cores) slows every batch, so
    it also lowers the rate at which the pair saturates. A factor on the prediction keeps that pole where
    the bare model puts it and passes a load the pair cannot carry (measured here: the load test's 1.4x
    phase served a budget whose capacity was below the load, its factor pinned at the clamp).

    A pair that stopped being served does not keep the scale of a spike long over: without an answer in
    the last ``fresh_s`` (or with fewer than ``min_samples`` within ``horizon_s``) it is not
    :meth:`ready` and the policy uses the scale of the pair served now."""

    def __init__(self, quantile: float = CORRECTION_QUANTILE, size: int = 200, min_samples: int = 30,
                 bounds: Tuple[float, float] = (0.5, 4.0), horizon_s: float = 10.0, fresh_s: float = 2.0,
                 refit_every: int = 4, clock: Optional[Callable[[], float]] = None) -> None:
        self.quantile, self.min_samples, self.bounds, self.horizon_s = quantile, min_samples, bounds, horizon_s
        self.fresh_s, self.refit_every = fresh_s, refit_every
        self.clock = clock or time.monotonic
        self._answers: Deque[Tuple[float, float, float]] = deque(maxlen=size)  # (time, measured, rate)
        self._added = 0
        self.factor = 1.0

    def add(self, measured_ms: float, rate: float, service: Affine, now: Optional[float] = None) -> None:
        """An answer's measured latency (ms), the arrival rate when it arrived, the pair's service model."""
        if not (math.isfinite(measured_ms) and math.isfinite(rate) and rate >= 0):
            return
        now = self.clock() if now is None else now
        self._answers.append((now, measured_ms, rate))
        _forget_before(self._answers, now - self.horizon_s)
        self._added += 1
        if len(self._answers) >= self.min_samples and (
                self._added % self.refit_every == 0 or len(self._answers) == self.min_samples):
            self.factor = self._fit(service)

    def _fit(self, service: Affine) -> float:
        """The scale under which a share ``1 - quantile`` of the answers took longer than the predicted
        ``quantile`` at the rate each arrived at (rates binned to 1 row/s): answers from before and after a
        step in the load each meet the queue of their own rate, where one mean rate would put the convex
        queueing curve's cost of the busier ones on the scale."""
        by_rate: Dict[int, List[float]] = {}
        for _, m, r in self._answers:
            by_rate.setdefault(round(r), []).append(m)
        for ms in by_rate.values():
            ms.sort()
        allowed = (1 - self.quantile) * len(self._answers)

        def too_slow(scale: float) -> bool:  # more answers above their prediction than the quantile allows
            f = Affine(service.a * scale, service.c * scale)
            over = sum(len(ms) - bisect.bisect_right(ms, predict_quantile_ms(f, r, self.quantile))
                       for r, ms in by_rate.items())
            return over > allowed

        lo, hi = self.bounds
        if not too_slow(lo):
            return lo
        if too_slow(hi):
            return hi
        for _ in range(16):  # fewer answers above as the scale grows: bisection (to 1e-4 of the bounds)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if too_slow(mid) else (lo, mid)
        return (lo + hi) / 2

    def ready(self, now: Optional[float] = None) -> bool:
        """At least ``min_samples`` answers within the horizon, the latest within ``fresh_s``."""
        now = self.clock() if now is None else now
        _forget_before(self._answers, now - self.horizon_s)
        return len(self._answers) >= self.min_samples and self._answers[-1][0] >= now - self.fresh_s


class AdmissionCorrection:
    """An admitted request's measured latency against the admission's uncorrected prediction for it
    (:meth:`SloPolicy.raw_request_ms`): a least-squares line ``measured = o + k·raw`` over the last ``size``
    answers within ``horizon_s``, raised by the ``quantile`` of its residuals, so :meth:`ms` predicts that
    quantile of a request's latency. Costs every request pays (the server's, the router's, the client's)
    land in ``o``; slow-downs in proportion to the queued work (cores shared with other processes) in
    ``k``. A multiplicative factor would charge the fixed costs once per queued batch and refuse work
    that fits. The identity until ``min_samples`` answers are in; ``k`` clamped to ``slope``."""

    def __init__(self, quantile: float = ADMISSION_QUANTILE, size: int = 200, min_samples: int = 30,
                 slope: Tuple[float, float] = (0.5, 4.0), horizon_s: float = 10.0, refit_every: int = 8,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.quantile, self.min_samples, self.slope, self.horizon_s = quantile, min_samples, slope, horizon_s
        self.refit_every, self.clock = refit_every, clock or time.monotonic
        self._answers: Deque[Tuple[float, float, float]] = deque(maxlen=size)  # (time, raw, measured)
        self._added = 0
        self.offset, self.k = 0.0, 1.0

    def add(self, measured_ms: float, raw_ms: float, now: Optional[float] = None) -> None:
        if not (math.isfinite(raw_ms) and raw_ms > 0 and math.isfinite(measured_ms)):
            return
        now = self.clock() if now is None else now
        self._answers.append((now, raw_ms, measured_ms))
        _forget_before(self._answers, now - self.horizon_s)
        self._added += 1
        if len(self._answers) < self.min_samples:
            self.offset, self.k = 0.0, 1.0
        elif self._added % self.refit_every == 0 or len(self._answers) == self.min_samples:
            self._fit()

    def _fit(self) -> None:
        xs, ys = [a[1] for a in self._answers], [a[2] for a in self._answers]
        k = least_squares_slope(xs, ys)
        k = sum(ys) / max(sum(xs), 1e-9) if k is None else k
        k = min(max(k, self.slope[0]), self.slope[1])
        residuals = [y - k * x for x, y in zip(xs, ys)]
        self.offset, self.k = max(0.0, quantile_of(residuals, self.quantile)), k

    def ms(self, raw_ms: float, min_slope: float = 0.0) -> float:
        """The corrected prediction (ms) of a request whose uncorrected one is ``raw_ms``, the slope at
        least ``min_slope``."""
        return self.offset + max(self.k, min_slope) * raw_ms


def quantile_of(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Decision:
    """What :meth:`SloPolicy.decide` picked: the pair, its corrected prediction (ms), whether it meets
    the SLO with the margin, and the rate it assumed."""

    pair: Pair
    predicted_ms: float
    meets: bool
    rate: float


class SloPolicy:
    """The best-quality pair whose predicted latency quantile meets the SLO (module docstring).

    Args:
        pairs: the candidates, best quality first.
        service: service times of every candidate.
        slo_ms: the objective (ms) for the ``quantile`` of the latency.
        quantile: which quantile (0.99: p99).
        margin: fraction of the SLO a prediction must leave free.
        hysteresis: extra fraction a pair better than the current one must leave free.
        dwell_s: a better pair only once the current one has served this long, or the load has
            stepped down since it was chosen (:attr:`RateEstimator.fell_at`: a detected step is not the
            noise the dwell keeps from flapping the choice) (seconds; going to a faster pair is never
            delayed).
        max_step: a move to a better pair goes at most this many pairs up the list, except to a pair
            whose own scale is current (:meth:`ServiceScale.ready`): the others are predicted with the
            served pair's scale, which understates a denser pair's per-request costs, so it steps up and
            measures each on the way (a move to a faster pair is never limited).
        max_sparsity: never serve a pair sparser than this (a quality floor); None: no floor.
        rate: the arrival-rate estimator (its clock is the policy's).
        clock: seconds (monotonic; default: the rate estimator's).
    """

    def __init__(self, pairs: Sequence[Pair], service: ServiceModel, slo_ms: float, *,
                 quantile: float = DEFAULT_QUANTILE, margin: float = DEFAULT_MARGIN,
                 hysteresis: float = DEFAULT_HYSTERESIS, dwell_s: float = DEFAULT_DWELL_S,
                 max_step: int = DEFAULT_MAX_STEP, max_sparsity: Optional[float] = None,
                 rate: Optional[RateEstimator] = None, clock: Optional[Callable[[], float]] = None) -> None:
        if not slo_ms > 0 or not 0 < quantile < 1 or not 0 <= margin < 1 or not 0 <= hysteresis < 1 - margin:
            raise ValueError("SloPolicy needs slo_ms > 0, 0 < quantile < 1, 0 <= margin, hysteresis < 1 - margin")
        allowed = [p for p in pairs if max_sparsity is None or p[0] <= max_sparsity + 1e-9]
        if not allowed:
            raise ValueError(f"no budget at or below max_sparsity {max_sparsity:g}")
        missing = [p for p in allowed if p not in service.fits]
        if missing:
            raise ValueError(f"no service times for {missing}")
        self.pairs, self.service, self.slo_ms, self.quantile = list(allowed), service, float(slo_ms), quantile
        self.margin, self.hysteresis, self.dwell_s, self.max_step = margin, hysteresis, dwell_s, max_step
        self.switched_at = -math.inf
        self.rate = rate or RateEstimator()
        clock = clock or self.rate.clock
        self.admitted_rate = RateEstimator(self.rate.window_s, self.rate.short_s, self.rate.sigmas, clock=clock)
        self.scales: Dict[Pair, ServiceScale] = {p: ServiceScale(clock=clock) for p in self.pairs}
        self.fallback_scale = 1.0  # the latest scale fitted to any pair
        self.recent: Deque[float] = deque(maxlen=200)  # the latest answers' latencies (ms), every pair
        self.overheads: Deque[float] = deque(maxlen=200)  # their latency outside the budget model (ms)
        self._overhead_ms = 0.0  # the overheads' p90, kept as answers come (read on every prediction)
        self.admission = AdmissionCorrection(clock=clock)
        self.current = self.pairs[0]
        self.switches = 0
        self.unavailable: set = set()

    def predict(self, pair: Pair, rate: float) -> float:
        """Predicted latency quantile (ms) at ``pair`` under ``rate``: the budget model's queue and service,
        its service times scaled by :meth:`factor`, plus :meth:`overhead_ms`."""
        f, k = self.service.affine(pair), self.factor(pair)
        return self.overhead_ms() + predict_quantile_ms(Affine(f.a * k, f.c * k), rate, self.quantile)

    def overhead_ms(self) -> float:
        """What a request spends outside its budget model (the router's checks, tokens, hand-offs and
        the round trip to the model): the p90 of the latest answers' (0 before any). Every request pays
        it once, whatever the queue: added to the prediction, not folded into the service scale (at a
        light load a scale would carry it as a factor and overstate every queue)."""
        return self._overhead_ms

    def factor(self, pair: Pair) -> float:
        """The scale of ``pair``'s service times: its own while it has recent answers, else that of the
        pair served now, else the latest fitted to any (:class:`ServiceScale`)."""
        for p in (pair, self.current):
            own = self.scales.get(p)
            if own is not None and own.ready():
                return own.factor
        return self.fallback_scale

    def measured(self) -> Optional[float]:
        """The measured SLO quantile of the latest answers (ms; None before any)."""
        return quantile_of(list(self.recent), self.quantile) if self.recent else None

    def decide(self, now: Optional[float] = None) -> Decision:
        """The pair to serve now (call once per arrival, after :meth:`RateEstimator.arrive`)."""
        now = self.rate.clock() if now is None else now
        rate = self.rate.rate(now)
        stay = self.slo_ms * (1 - self.margin)
        move = self.slo_ms * (1 - self.margin - self.hysteresis)
        usable = [p for p in self.pairs if p not in self.unavailable] or self.pairs
        rank = {p: i for i, p in enumerate(usable)}
        here = rank.get(self.current, len(usable))
        fell = self.rate.fell_at > self.switched_at
        if now - self.switched_at < self.dwell_s and not fell and self.current in rank:
            usable, here = usable[here:], 0  # too soon to go denser
        chosen, predicted = None, math.inf
        for i, p in enumerate(usable):
            if i < here - self.max_step and not self.scales[p].ready(now):
                continue  # too far up to trust the served pair's scale for it
            ms = self.predict(p, rate)
            if ms <= (move if i < here else stay):
                chosen, predicted = p, ms
                break
        meets = chosen is not None
        if chosen is None:  # nothing meets it: the fastest
            chosen = min(usable, key=lambda p: self.service.ms(p, 1))
            predicted = self.predict(chosen, rate)
        if chosen != self.current:
            self.current, self.switches, self.switched_at = chosen, self.switches + 1, now
        return Decision(chosen, predicted, meets, rate)

    def raw_request_ms(self, pair: Pair, rows: int, rows_ahead: int,
                       elsewhere: Optional[Mapping[Pair, int]] = None) -> float:
        """A request's own modelled latency (ms, uncorrected): ``rows_ahead`` rows in flight at ``pair``
        first (the batch running and the one queued behind it), the rows in flight at other pairs
        (``elsewhere``: the pairs share the machine's cores, so their work delays this one's), then its own
        batch."""
        f = self.service.affine(pair)
        ahead = 2 * f.a + f.c * rows_ahead if rows_ahead > 0 else 0.0
        shared = sum(self.service.ms(p, n) for p, n in (elsewhere or {}).items()
                     if n > 0 and p != pair and p in self.service.fits)
        return ahead + shared + f.ms(rows)

    def request_ms(self, pair: Pair, rows: int, rows_ahead: int,
                   elsewhere: Optional[Mapping[Pair, int]] = None) -> float:
        """:meth:`raw_request_ms` corrected by what admitted requests measured (:attr:`admission`), its
        slope at least ``pair``'s service scale (queued work runs no faster than the pair serves)."""
        return self.admission.ms(self.raw_request_ms(pair, rows, rows_ahead, elsewhere), self.factor(pair))

    def admit(self, pair: Pair, rows: int, rows_ahead: int,
              elsewhere: Optional[Mapping[Pair, int]] = None) -> Tuple[bool, float, float]:
        """Whether to run a request of ``rows`` at ``pair`` with ``rows_ahead`` in flight there and
        ``elsewhere`` at other pairs (its corrected prediction within the SLO), the corrected prediction
        and the uncorrected one (what :meth:`admitted` takes back with the measured latency)."""
        raw = self.raw_request_ms(pair, rows, rows_ahead, elsewhere)
        ms = self.admission.ms(raw, self.factor(pair))
        return ms <= self.slo_ms, ms, raw

    def entered(self, rows: int, now: Optional[float] = None) -> float:
        """An admitted request of ``rows``; the rate of admitted rows (rows/s), which is what to give
        :meth:`answered` for it. Its queue forms from the requests admitted, not from those offered: past
        capacity the admission refuses the excess, and held against the offered rate, where every pair's
        prediction is infinite, no answer is above its prediction and the service scale falls to its
        lower bound (measured: a 3x burst then served 0.4 where only 0.6 could carry the admitted load)."""
        self.admitted_rate.arrive(now, rows)
        return self.admitted_rate.rate(now)

    def admitted(self, measured_ms: float, raw_ms: float) -> None:
        """An admitted request's measured latency against its uncorrected admission prediction."""
        self.admission.add(measured_ms, raw_ms)

    def answered(self, measured_ms: float, rate: float, pair: Optional[Pair] = None,
                 model_ms: Optional[float] = None) -> None:
        """An answered request's latency (ms) at ``pair``, the admitted rate it arrived at
        (:meth:`entered`), and (when known) the part of it spent in the budget model (queue and run,
        ``model_ms``): the scale is fitted to that part, the rest is :meth:`overhead_ms`."""
        self.recent.append(measured_ms)
        if model_ms is not None:
            self.overheads.append(max(0.0, measured_ms - model_ms))
            self._overhead_ms = quantile_of(list(self.overheads), ADMISSION_QUANTILE)
        own = self.scales.get(pair)
        if own is not None:
            own.add(measured_ms if model_ms is None else model_ms, rate, self.service.affine(pair))
            if own.ready():
                self.fallback_scale = own.factor


def service_points_from_profile(rows: Mapping[int, Mapping[float, Mapping[str, float]]], precision: str,
                                sparsities: Sequence[float], stat: str = "p50_ms",
                                tolerance: float = 1e-6) -> Optional[Dict[Pair, Dict[int, float]]]:
    """``{(sparsity, precision): {batch: ms}}`` from a latency profile's rows (batch -> sparsity -> stats),
    or None when a sparsity lacks every batch."""
    out: Dict[Pair, Dict[int, float]] = {}
    for s in sparsities:
        pts = {}
        for b, by_s in rows.items():
            row = next((r for k, r in by_s.items() if abs(k - s) <= tolerance), None)
            if row is not None and stat in row:
                pts[int(b)] = float(row[stat])
        if not pts:
            return None
        out[(s, precision)] = pts
    return out


def oracle_pair(capacities: Mapping[Pair, float], rate: float, pairs: Sequence[Pair], headroom: float = 1.25) -> Pair:
    """The benchmark's oracle: the best pair (``pairs``: best first) whose measured capacity covers
    ``headroom`` x ``rate``; the one of largest capacity when none does."""
    for p in pairs:
        if capacities.get(p, 0.0) >= headroom * rate:
            return p
    return max(pairs, key=lambda p: capacities.get(p, 0.0))
