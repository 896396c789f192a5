"""The served router's objective: the best-quality (budget, precision) pair whose predicted latency
quantile at the observed load meets the SLO.

Plain Python with an injected clock (the Triton router only calls it):

* :class:`ServiceModel`: service time of a batch of ``n`` rows at a pair, ``S(n) = a + c·n`` ms, fitted
  from start-up measurements on the serving machine or the directory's latency profile.
* :class:`RateEstimator`: the arrival rate since the load last changed (a two-sample Poisson step test),
  over at most a sliding window.
* :func:`predict_quantile_ms`: the latency quantile of a dynamic-batching server under Poisson arrivals,
  read from a seeded simulation of that bulk-service queue (:func:`queue_table`); a mean-value estimate
  leaves the queue's fluctuations out and understates the tail several-fold.
* :class:`ServiceScale`: per budget, the measured time of its batches over ``S(n)``, so contention on
  shared cores is read where it happens; time spent outside the budget model is added once
  (:meth:`SloPolicy.overhead_ms`).
* :class:`SloPolicy`: the decision (best pair meeting ``SLO x (1 - margin)``, with hysteresis, a dwell and
  a bounded step), admission (:meth:`SloPolicy.admit`: refuse rather than queue a request predicted past
  the limit) and the overflow to the fastest pair (:meth:`SloPolicy.overflows`).

Why each part is there, with the measurements: docs/design.md, "How the serving policy was chosen"."""

from __future__ import annotations

import bisect
import functools
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

Pair = Tuple[float, str]
DEFAULT_QUANTILE = 0.99
ROW_WEIGHT_MEMORY = 200.0  # rows the mean row weight follows (SloPolicy.note_rows)
DEFAULT_MARGIN = 0.05  # the prediction must leave this fraction of the SLO free
DEFAULT_HYSTERESIS = 0.05  # and a denser pair this much more
DEFAULT_DWELL_S = 1.0  # and the current pair must have served this long
DEFAULT_OVERFLOW = 0.7  # a routed request predicted past this fraction of the SLO at the served pair goes to the fastest
DEFAULT_MAX_STEP = 3  # a move denser goes at most this many pairs, past them only to pairs measured just now
DEFAULT_STAY_SPREAD = 1.0  # after a step down the current pair is judged at the rate less this many standard errors
DEFAULT_LENT_MARGIN = 0.1  # a better pair judged on a lent scale is judged this much slower (not after a step down)
DEFAULT_SURGE_SIGMAS = 2.5  # arrivals this many standard deviations above the estimate, short of a step: a surge
DEFAULT_SURGE_OVERFLOW = 0.4  # during which the overflow's fraction of the SLO is this
ADMISSION_QUANTILE = 0.9  # the quantile of the admission's residuals added to its fitted line


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


def least_squares_slope(xs: Sequence[float], ys: Sequence[float],
                        weights: Optional[Sequence[float]] = None) -> Optional[float]:
    """The least-squares slope of ``ys`` on ``xs``, each point weighing ``weights`` (default 1); None when
    the ``xs`` do not spread."""
    w = [1.0] * len(xs) if weights is None else list(weights)
    total = sum(w)
    mx, my = sum(wi * x for wi, x in zip(w, xs)) / total, sum(wi * y for wi, y in zip(w, ys)) / total
    var = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    return sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / var if var > 1e-9 else None


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

    The estimate counts the rows since the *origin*: the window's start or the latest detected step,
    whichever is later. A step is detected when the last ``short_s`` (or its latest half) holds a rate
    that differs from the one before it by more than ``sigmas`` standard deviations of the two Poisson
    counts (``sigmas_up`` for a step up); the origin then moves there. A step moves the estimate within
    about half a second, where a window straddling the step would mix both loads for its whole length.

    Args:
        window_s: the longest window (stable at a constant load).
        short_s: the test window (and its latest half).
        sigmas: the threshold for a step down, high enough that a dip of a steady load is not read as one.
        sigmas_up: the threshold for a step up: an unseen step up fills the served budget's queue, while
            a false one only serves sparser for a moment.
        undo_s: a step up within this long of a step down that only returns to the load before it undoes
            the step down (a lull's return is not a step up).
        hold_s, confirm_sigmas: a step down stands only if, ``hold_s`` after it was seen, the rate since it
            is still ``confirm_sigmas`` below the load before it, else it is undone; until then it is
            pending (:meth:`fall_pending`). Pauses of the client or the server bunch arrivals; a real step
            down is still there a quarter second later.
        young_s: for this long after a step up :meth:`young_rate` reads the rate since where the step most
            likely began (:meth:`_step_start`), so the policy reaches the new load's budget at once.
        clock: seconds (monotonic)."""

    def __init__(self, window_s: float = 8.0, short_s: float = 0.5, sigmas: float = 3.5, sigmas_up: float = 3.5,
                 undo_s: float = 2.0, hold_s: float = 0.25, confirm_sigmas: float = 2.5, young_s: float = 0.5,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.window_s, self.short_s, self.sigmas, self.sigmas_up = window_s, short_s, sigmas, sigmas_up
        self.undo_s, self.hold_s, self.confirm_sigmas, self.young_s = undo_s, hold_s, confirm_sigmas, young_s
        self.rose_at: Optional[float] = None  # where the latest step up most likely began (while it is the latest)
        self._pending = False  # the latest step down is not confirmed yet (:meth:`fall_pending`)
        self._before_fall: Optional[float] = None  # the origin before the latest step down (while it is the latest)
        self.clock = clock or time.monotonic
        self._times: List[float] = []  # arrival times, oldest first, from self._head on
        self._cum: List[int] = []  # rows up to and including each arrival
        self._head = 0
        self._origin: Optional[float] = None
        self.fell_at = -math.inf  # when a step down in the load was last detected
        self.fell_from: Optional[float] = None  # where the latest detected step starts, when it was a step down
        self.surge = 0.0  # the latest :meth:`rate`'s test: standard deviations above the estimate (0: not above)

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

    def _z(self, now: float, origin: float, width: float) -> float:
        """How many standard deviations of the two Poisson counts the rate of the rows of the last ``width`` s
        lies above (negative: below) the rate of those between ``origin`` and it (0 when that earlier part is
        shorter than ``short_s``). Each count's variance is at least what the pooled rate gives it, so a dip's
        low count cannot shrink its own variance, nor a rise's high count that of the load before it."""
        before_s = now - width - origin
        if before_s < self.short_s:
            return 0.0
        recent = self._rows_since(now - width)
        before = self._rows_since(origin) - recent
        pooled = (recent + before) / (width + before_s)
        var = (max(recent / width, pooled, 1 / width) / width
               + max(before / before_s, pooled, 1 / before_s) / before_s)
        return (recent / width - before / before_s) / math.sqrt(var)

    def rate(self, now: Optional[float] = None) -> float:
        """The estimate (rows/s) since the latest step or over the window (class docstring); sets
        :attr:`surge`."""
        now = self.clock() if now is None else now
        if self._origin is None:
            return 0.0
        self._trim(now)
        self._confirm(now)
        origin = max(self._origin, now - self.window_s)
        self.surge = 0.0
        for width in (self.short_s / 2, self.short_s):
            z = self._z(now, origin, width)
            self.surge = max(self.surge, z)
            back = self._over_before_fall(now, width) if z > self.sigmas_up else None
            if back is not None and back <= self.sigmas_up:  # only back to the load before the dip: undone
                self._origin, self.fell_from, self._before_fall = self._before_fall, None, None
                self.surge = max(0.0, back)
                break
            if z > self.sigmas_up or z < -self.sigmas:  # a step: the estimate starts at this window
                self._before_fall = origin if z < 0 else None
                self.rose_at = self._step_start(now, width, origin) if z > 0 else None
                self._origin = origin = now - width
                self.fell_from = origin if z < 0 else None
                if z < 0:
                    self.fell_at, self._pending = now, True
                break
        rows, seconds = self._counted(now)
        return rows / seconds

    def _confirm(self, now: float) -> None:
        """``hold_s`` after a step down was seen: it stands if the rate since it is still ``confirm_sigmas``
        below the load before it, else it is undone (class docstring)."""
        if not self._pending or now - self.fell_at < self.hold_s:
            return
        self._pending = False
        if self.fell_from is None or self._before_fall is None:
            return
        before = max(self._before_fall, now - self.window_s)
        if self._z(now, before, now - self.fell_from) > -self.confirm_sigmas:
            self._origin, self.fell_from, self._before_fall = self._before_fall, None, None

    def fall_pending(self, now: float) -> bool:
        """Whether the latest step down was seen less than ``hold_s`` ago (not yet confirmed or undone)."""
        return self._pending and self.fell_from is not None and now - self.fell_at < self.hold_s

    def _over_before_fall(self, now: float, width: float) -> Optional[float]:
        """Within ``undo_s`` of a step down: the step test's statistic of the last ``width`` s against the load
        since the origin before that step down (None otherwise). At most ``sigmas_up``, a step up seen now
        only returns to that load: the step down was a dip of a steady load, not a change."""
        if self.fell_from is None or self._before_fall is None or now - self.fell_at > self.undo_s:
            return None
        return self._z(now, max(self._before_fall, now - self.window_s), width)

    def spread(self, now: Optional[float] = None) -> float:
        """The standard error of :meth:`rate` (rows/s): a Poisson count's, ``sqrt(rows) / seconds`` over the
        span the estimate counts (call after :meth:`rate`)."""
        now = self.clock() if now is None else now
        if self._origin is None:
            return 0.0
        rows, seconds = self._counted(now)
        return math.sqrt(rows) / seconds

    def _counted(self, now: float) -> Tuple[int, float]:
        """The rows the estimate counts (since the origin, within the window) and the seconds it divides by."""
        origin = max(self._origin, now - self.window_s)
        return self._rows_since(origin), max(now - origin, self.short_s / 2)

    STEP_SPAN_S = 0.05  # the least span :meth:`young_rate` and :meth:`_step_start` divide by

    def young_rate(self, now: float) -> Optional[float]:
        """Within ``young_s`` of where the latest step up most likely began, the rows/s since then (at least
        :data:`STEP_SPAN_S` counted); else None."""
        if self.rose_at is None or now - self.rose_at >= self.young_s:
            return None
        return self._rows_since(self.rose_at) / max(now - self.rose_at, self.STEP_SPAN_S)

    def _step_start(self, now: float, width: float, origin: float) -> float:
        """Where a step up seen in the last ``width`` s most likely began: the arrival in it from which on the
        rows' Poisson log-likelihood ratio of their own rate against the rate before (since ``origin``) is
        largest."""
        lo = bisect.bisect_left(self._times, now - width, self._head)
        before_s = max(now - width - origin, self.short_s)
        r0 = max(self._rows_since(origin) - self._rows_since(now - width), 1) / before_s
        best, start = -math.inf, now - width
        for i in range(lo, len(self._times)):
            n = self._cum[-1] - (self._cum[i - 1] if i > 0 else 0)
            span = max(now - self._times[i], self.STEP_SPAN_S)
            llr = n * math.log(n / (r0 * span)) - (n - r0 * span)
            if llr > best:
                best, start = llr, self._times[i]
        return start

    def settled_fall(self, now: float, within_s: float = 2.0) -> bool:
        """Whether the latest detected step was a step down and the estimate has rested on ``short_s`` of
        the load since it, up to ``within_s`` more (a noisy dip, detected as a step, is mostly gone from
        an estimate half a second long)."""
        return (self.fell_from is not None and not self.fall_pending(now)
                and self.short_s <= now - self.fell_from <= self.short_s + within_s)


#: the queue's table (:func:`queue_table`): shapes ``c / S(1)`` from SHAPES[0] to 1, loads ``λc`` from 0 to
#: LOAD_MAX (denser towards both ends), QUEUE_ARRIVALS seeded arrivals at each, the latency at every
#: 1 / QUANTILE_STEPS quantile
SHAPES = (0.01, 0.025) + tuple(round(0.05 * i, 2) for i in range(1, 21))
LOADS = (0.0, 0.002, 0.005, 0.01, 0.02, 0.035) + tuple(round(0.05 + 0.92 * (1 - (1 - k / 27) ** 2), 4)
                                                     for k in range(28))
LOAD_MAX = LOADS[-1]
QUEUE_ARRIVALS, QUANTILE_STEPS = 10000, 1000


def _bulk_latencies(t: Any, shape: Any) -> Any:
    """Latencies (units of ``S(1)``) of arrivals at times ``t`` (one row per cell) at a server whose batch of
    ``n`` takes ``(1 - shape) + shape·n`` (``shape``: one per cell), arrival by arrival for all cells at once:
    an arrival that finds the server idle starts a batch of one; one that finds it busy joins the batch
    waiting for it, which starts when the server frees, with every row that arrived by then."""
    import numpy as np

    cells, n = t.shape
    ends = np.zeros((cells, n + 1))  # per batch id (from 1), its end
    batch = np.zeros((cells, n), dtype=np.int64)  # per arrival, its batch id
    busy_end, waiting, ids, rows = np.zeros(cells), np.zeros(cells), np.zeros(cells, dtype=np.int64), np.arange(cells)
    for j in range(n):
        now = t[:, j]
        start = (waiting > 0) & (now >= busy_end)  # the waiting batch started when the server freed
        busy_end = np.where(start, busy_end + (1 - shape) + shape * waiting, busy_end)
        ends[rows[start], ids[start]] = busy_end[start]
        waiting[start] = 0
        idle = now >= busy_end
        ids = ids + (idle | (waiting == 0))  # a batch of its own, or the first row of the next waiting one
        busy_end = np.where(idle, now + 1.0, busy_end)
        ends[rows[idle], ids[idle]] = busy_end[idle]
        waiting = np.where(idle, waiting, waiting + 1)
        batch[:, j] = ids
    last = waiting > 0
    ends[rows[last], ids[last]] = busy_end[last] + (1 - shape[last]) + shape[last] * waiting[last]
    return np.take_along_axis(ends, batch, axis=1) - t


def queue_latencies(a: float, c: float, rate: float, n: int = 40000, seed: int = 1) -> Any:
    """Latencies (ms) of ``n`` seeded Poisson arrivals (``rate`` per s) at the queue :func:`queue_table`
    tabulates, simulated batch by batch (the check on the table): a server that, when it frees, takes every
    row waiting and serves them in ``a + c·n`` ms (an arrival that finds it idle starts a batch of one)."""
    import numpy as np

    t = np.cumsum(np.random.default_rng(seed).exponential(1e3 / rate, n))
    lat, i, end = np.empty(n), 0, 0.0
    while i < n:
        start = max(end, t[i])
        j = max(i + 1, int(np.searchsorted(t, start, side="right")))
        end = start + a + c * (j - i)
        lat[i:j] = end - t[i:j]
        i = j
    return lat


@functools.lru_cache(maxsize=1)
def queue_table() -> Any:
    """The simulated bulk-service queue (:func:`_bulk_latencies`): latency quantiles (units of ``S(1)``)
    indexed ``[shape, load, quantile]`` over :data:`SHAPES` x :data:`LOADS` x ``0, 1/QUANTILE_STEPS, ..., 1``,
    non-decreasing in the load. Every cell serves the same seeded Poisson stream (common random numbers);
    batches are as large as the queue. Built once per process (about a second and a half on 2 CPUs):
    :class:`SloPolicy` builds it when it is made, never on a request's path."""
    import numpy as np

    shape = np.repeat(np.asarray(SHAPES), len(LOADS) - 1)  # one cell per (shape, load > 0)
    load = np.tile(np.asarray(LOADS[1:]), len(SHAPES))
    stream = np.cumsum(np.random.default_rng(0).exponential(1.0, QUEUE_ARRIVALS))
    lat = np.sort(_bulk_latencies(stream[None, :] * (shape / load)[:, None], shape), axis=1)
    at = np.clip(np.ceil(np.linspace(0, 1, QUANTILE_STEPS + 1) * QUEUE_ARRIVALS).astype(int) - 1, 0, None)
    table = lat[:, at].reshape(len(SHAPES), len(LOADS) - 1, QUANTILE_STEPS + 1)
    table = np.concatenate([np.ones((len(SHAPES), 1, QUANTILE_STEPS + 1)), table], axis=1)
    return np.maximum.accumulate(table, axis=1)


def _bracket(grid: Sequence[float], x: float) -> Tuple[int, float]:
    """The index ``i`` with ``grid[i] <= x <= grid[i + 1]`` (clamped to the grid) and ``x``'s weight on ``i + 1``."""
    x = min(max(x, grid[0]), grid[-1])
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def predict_quantile_ms(service: Affine, rate: float, quantile: float = DEFAULT_QUANTILE) -> float:
    """The ``quantile`` of the latency (ms) at ``rate`` arrivals/s of one row each at a dynamic-batching
    server whose batch of ``n`` takes ``service`` (:func:`queue_table`, interpolated in the shape
    ``c / S(1)`` and geometrically in the load ``λc``: the queue's convex growth, not a chord above it);
    ``inf`` at or past :data:`LOAD_MAX` of the saturation rate ``1 / c``."""
    one = service.ms(1)
    load = rate * service.c / 1e3
    if load >= LOAD_MAX:
        return math.inf
    if load <= 0:
        return one
    table = queue_table()
    i, u = _bracket(SHAPES, service.c / max(one, 1e-12))
    k, w = _bracket(LOADS, load)
    q = min(QUANTILE_STEPS, max(0, math.ceil(quantile * QUANTILE_STEPS - 1e-9)))
    lo = table[i, k, q] ** (1 - w) * table[i, k + 1, q] ** w
    hi = table[i + 1, k, q] ** (1 - w) * table[i + 1, k + 1, q] ** w
    return one * float(lo + u * (hi - lo))


class ServiceScale:
    """How much slower than the service model a pair's budget model runs its batches now: the measured
    time of the batches it ran (the server's per-batch statistics) over what the model gives for the same
    batch sizes, each batch weighted by ``exp(-age / memory_s)``, within ``bounds``.

    Measured on the batches, not fitted to answer latencies through the queueing model, so the queue's
    share of a latency is left to the queue. Weighted by age, a pair served again after a pause starts
    from its own earlier scale rather than from its first few batches alone.

    :meth:`recent` while its batches weigh ``min_batches``; :meth:`ready` when recent and the latest batch
    came within ``fresh_s`` (a pair no longer served does not keep a spike's scale; the policy then lends it
    the served pair's)."""

    def __init__(self, min_batches: int = 20, bounds: Tuple[float, float] = (0.5, 4.0), memory_s: float = 10.0,
                 fresh_s: float = 2.0, clock: Optional[Callable[[], float]] = None) -> None:
        self.min_batches, self.bounds, self.memory_s, self.fresh_s = min_batches, bounds, memory_s, fresh_s
        self.clock = clock or time.monotonic
        self._at = -math.inf  # when the weighted sums below were last aged
        self._count, self._measured, self._modelled = 0.0, 0.0, 0.0  # batches, measured ms, model ms (weighted)
        self._latest = -math.inf
        self.factor = 1.0

    def add(self, rows: int, count: int, total_ms: float, service: Affine, now: Optional[float] = None) -> None:
        """``count`` batches of ``rows`` rows that took ``total_ms`` in all; ``service``: the pair's model."""
        if count <= 0 or rows <= 0 or not (math.isfinite(total_ms) and total_ms > 0):
            return
        now = self.clock() if now is None else now
        self._age(now)
        self._count, self._measured = self._count + count, self._measured + float(total_ms)
        self._modelled += count * service.ms(rows)
        self._latest = max(self._latest, now)
        if self._count >= self.min_batches and self._modelled > 0:
            lo, hi = self.bounds
            self.factor = min(max(self._measured / self._modelled, lo), hi)

    def _age(self, now: float) -> None:
        if now > self._at:  # from -inf (nothing added yet) the weight is 0 on sums of 0
            w = math.exp(-(now - self._at) / self.memory_s)
            self._count, self._measured, self._modelled = self._count * w, self._measured * w, self._modelled * w
            self._at = now

    def weight(self, now: Optional[float] = None) -> float:
        """The batches behind :attr:`factor`, each weighted by its age."""
        self._age(self.clock() if now is None else now)
        return self._count

    def ready(self, now: Optional[float] = None) -> bool:
        """Whether :attr:`factor` is current: :meth:`recent`, the latest batch within ``fresh_s``."""
        now = self.clock() if now is None else now
        return self.recent(now) and self._latest >= now - self.fresh_s

    def recent(self, now: Optional[float] = None) -> bool:
        """Whether :attr:`factor` rests on a weight of ``min_batches`` batches."""
        return self.weight(now) >= self.min_batches - 1e-9


class AdmissionCorrection:
    """An admitted request's measured latency against the admission's uncorrected prediction for it
    (:meth:`SloPolicy.raw_request_ms`): a least-squares line ``measured = o + k·raw`` over the last ``size``
    answers within ``horizon_s`` (older ones too while fewer than ``min_samples`` are newer), raised by the
    ``quantile`` of its residuals, so :meth:`ms` predicts that quantile of a request's latency.

    Costs every request pays land in ``o``, slow-downs in proportion to the queued work in ``k`` (a factor
    alone would charge the fixed costs once per queued batch). The identity until ``min_samples`` answers are
    in; ``k`` clamped to ``slope``; after a quiet spell the latest fit stays until new answers replace it. A
    line asked for with a steeper slope (:meth:`ms`'s ``min_slope``) takes its offset from the same answers at
    that slope, so it still passes through their quantile."""

    def __init__(self, quantile: float = ADMISSION_QUANTILE, size: int = 200, min_samples: int = 30,
                 slope: Tuple[float, float] = (0.5, 4.0), horizon_s: float = 10.0, refit_every: int = 8,
                 clock: Optional[Callable[[], float]] = None) -> None:
        self.quantile, self.min_samples, self.slope, self.horizon_s = quantile, min_samples, slope, horizon_s
        self.refit_every, self.clock = refit_every, clock or time.monotonic
        self._answers: Deque[Tuple[float, float, float]] = deque(maxlen=size)  # (time, raw, measured)
        self._added = 0
        self.offset, self.k = 0.0, 1.0
        self._fitted: List[Tuple[float, float]] = []  # the (raw, measured) pairs of the latest fit
        self._offsets: Dict[float, float] = {}  # per steeper slope asked for, its offset on the latest fit

    def add(self, measured_ms: float, raw_ms: float, now: Optional[float] = None) -> None:
        if not (math.isfinite(raw_ms) and raw_ms > 0 and math.isfinite(measured_ms)):
            return
        now = self.clock() if now is None else now
        self._answers.append((now, raw_ms, measured_ms))
        while len(self._answers) > self.min_samples and self._answers[0][0] < now - self.horizon_s:
            self._answers.popleft()  # past the horizon, while min_samples newer ones remain
        self._added += 1
        if len(self._answers) >= self.min_samples and (self._added % self.refit_every == 0 or not self._fitted):
            self._fit()

    def _fit(self) -> None:
        xs, ys = [a[1] for a in self._answers], [a[2] for a in self._answers]
        k = least_squares_slope(xs, ys)
        k = sum(ys) / max(sum(xs), 1e-9) if k is None else k
        self.k = min(max(k, self.slope[0]), self.slope[1])
        self._fitted, self._offsets = list(zip(xs, ys)), {}
        self.offset = self._offset(self.k)

    def _offset(self, k: float) -> float:
        """The ``quantile`` of the latest fit's residuals about a line of slope ``k`` (at least 0)."""
        return max(0.0, quantile_of([y - k * x for x, y in self._fitted], self.quantile)) if self._fitted else 0.0

    def ms(self, raw_ms: float, min_slope: float = 0.0) -> float:
        """The corrected prediction (ms) of a request whose uncorrected one is ``raw_ms``, the slope at
        least ``min_slope`` (its offset then from the same answers at that slope, class docstring)."""
        if min_slope <= self.k:
            return self.offset + self.k * raw_ms
        slope = round(min_slope, 2)  # the pairs' scales move slowly: one offset per hundredth, per fit
        offset = self._offsets.get(slope)
        if offset is None:
            offset = self._offsets[slope] = self._offset(slope)
        return offset + max(slope, min_slope) * raw_ms


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
        dwell_s: a better pair only once the current one has served this long, or the load has stepped
            down since it was chosen (seconds; going to a faster pair is never delayed).
        max_step: a move to a better pair goes at most this many pairs up the list, except to a pair whose
            own scale is current (:meth:`ServiceScale.ready`): the others are predicted on a lent scale, so
            it steps up and measures each on the way. Neither this nor the dwell holds once the estimate has
            settled on a step down (:meth:`RateEstimator.settled_fall`).
        max_sparsity: never serve a pair sparser than this (a quality floor); None: no floor.
        overflow: the fraction of the SLO past which a request the policy routes, predicted behind the work
            in flight at the served pair, goes to the fastest allowed pair (:meth:`overflows`): a queue
            building there is the first sign of a step up, before the rate's test can tell it from noise.
        lent_margin: a better pair judged on a lent scale is judged this much slower (not after a step
            down): near saturation the p99 is steep in the service time, and pairs' scales differ by
            10-15 % under the same load.
        stay_spread: once the load has stepped down, the pair served now is judged at the estimated rate
            less this many standard errors (:meth:`RateEstimator.spread`), the others at the estimate:
            hysteresis in the estimate's own uncertainty, wide just after the step.
        surge_sigmas, surge_overflow: while the latest arrivals run ``surge_sigmas`` standard deviations
            above the estimate (:attr:`RateEstimator.surge`), the overflow's fraction of the SLO is
            ``surge_overflow``: a step up is seen sooner than by the step test.
        rate: the arrival-rate estimator (its clock is the policy's).
        clock: seconds (monotonic; default: the rate estimator's)."""

    def __init__(self, pairs: Sequence[Pair], service: ServiceModel, slo_ms: float, *,
                 quantile: float = DEFAULT_QUANTILE, margin: float = DEFAULT_MARGIN,
                 hysteresis: float = DEFAULT_HYSTERESIS, dwell_s: float = DEFAULT_DWELL_S,
                 max_step: int = DEFAULT_MAX_STEP, max_sparsity: Optional[float] = None,
                 overflow: float = DEFAULT_OVERFLOW, stay_spread: float = DEFAULT_STAY_SPREAD,
                 lent_margin: float = DEFAULT_LENT_MARGIN,
                 surge_sigmas: float = DEFAULT_SURGE_SIGMAS, surge_overflow: float = DEFAULT_SURGE_OVERFLOW,
                 rate: Optional[RateEstimator] = None,
                 clock: Optional[Callable[[], float]] = None) -> None:
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
        self.overflow, self.stay_spread, self.lent_margin = overflow, stay_spread, lent_margin
        self.surge_sigmas, self.surge_overflow = surge_sigmas, surge_overflow
        self.switched_at = -math.inf
        self.rate = rate or RateEstimator()
        clock = clock or self.rate.clock
        queue_table()  # built now, not on the first request's path
        self.scales: Dict[Pair, ServiceScale] = {p: ServiceScale(clock=clock) for p in self.pairs}
        self.fallback_scale = 1.0  # the latest scale fitted to any pair
        self.recent: Deque[float] = deque(maxlen=200)  # the latest answers' latencies (ms), every pair
        self.overheads: Deque[float] = deque(maxlen=200)  # their latency outside the budget model (ms)
        self._overhead_ms = 0.0  # the overheads' p90, kept as answers come (read on every prediction)
        self.admission = AdmissionCorrection(clock=clock)
        self.current = self.pairs[0]
        self.switches = 0
        self.unavailable: set = set()
        self.row_weight = 1.0  # a row's mean cost lately, in rows of the nominal length (note_rows)
        self.rows_seen = 0  # rows noted so far, up to the memory: until then the weight is their plain mean

    def note_rows(self, rows: int, work: float, memory_rows: float = ROW_WEIGHT_MEMORY) -> None:
        """An arrival of ``rows`` rows that cost ``work`` rows of the nominal length (their padded shape,
        :mod:`elastic_export.serving.cost`): the mean weight of a row over about the latest ``memory_rows``
        rows, which scales each row's service time in :meth:`predict` (the queue is of the rows that arrive,
        each as costly as they are, not of fewer nominal rows). Rows of the nominal length leave it at 1.
        Until ``memory_rows`` rows are seen the weight is the plain mean of those seen: the starting 1 is a
        guess, not a measurement, and a moving average from it would charge a fresh server's first short
        rows about the nominal cost, predicting dense too slow for them."""
        if rows > 0:
            self.rows_seen = min(memory_rows, self.rows_seen + rows)
            self.row_weight += (work / rows - self.row_weight) * min(1.0, rows / self.rows_seen)

    def predict(self, pair: Pair, rate: float, slower: float = 0.0) -> float:
        """Predicted latency quantile (ms) at ``pair`` under ``rate``: the budget model's queue and service,
        its service times scaled by :meth:`factor` (and ``1 + slower``), plus :meth:`overhead_ms`."""
        f, k = self.service.affine(pair), self.factor(pair) * (1 + slower)
        w = self.row_weight  # a row's cost lately, in rows of the nominal length (note_rows)
        return self.overhead_ms() + predict_quantile_ms(Affine(f.a * k, f.c * k * w), rate, self.quantile)

    def overhead_ms(self) -> float:
        """What a request spends outside its budget model (the router's checks, tokens, hand-offs and
        the round trip to the model): the p90 of the latest answers' (0 before any). Every request pays
        it once, whatever the queue: added to the prediction, not folded into the service scale (at a
        light load a scale would carry it as a factor and overstate every queue)."""
        return self._overhead_ms

    def factor(self, pair: Pair) -> float:
        """The scale of ``pair``'s service times: its own while it has recent batches, else that of the
        pair served now (else the latest fitted to any, :class:`ServiceScale`), or its own, aged, while it still
        weighs ``min_batches`` (:meth:`ServiceScale.recent`) when that is lower: a sparser pair's scale reads
        higher than a denser one's under the same load, and a spike's own scale is forgotten. A lent scale is at
        least 1: a lender's scale below 1 says its start-up measurement ran slow, nothing of the borrower's."""
        own = self.scales.get(pair)
        if own is not None and own.ready():
            return own.factor
        served = self.scales.get(self.current)
        borrowed = max(1.0, served.factor if served is not None and served.ready() else self.fallback_scale)
        return min(own.factor, borrowed) if own is not None and own.recent() else borrowed

    def measured(self) -> Optional[float]:
        """The measured SLO quantile of the latest answers (ms; None before any)."""
        return quantile_of(list(self.recent), self.quantile) if self.recent else None

    def decide(self, now: Optional[float] = None) -> Decision:
        """The pair to serve now (call once per arrival, after :meth:`RateEstimator.arrive`)."""
        now = self.rate.clock() if now is None else now
        rate = self.rate.rate(now)
        young = self.rate.young_rate(now)
        rate = rate if young is None else max(rate, young)
        stay = self.slo_ms * (1 - self.margin)
        move = self.slo_ms * (1 - self.margin - self.hysteresis)
        usable = [p for p in self.pairs if p not in self.unavailable] or self.pairs
        rank = {p: i for i, p in enumerate(usable)}
        here = rank.get(self.current, len(usable))
        pending = self.rate.fall_pending(now)
        fell = self.rate.fell_at > self.switched_at and not pending
        settled = self.rate.settled_fall(now)
        if (pending or now - self.switched_at < self.dwell_s and not (fell or settled)) and self.current in rank:
            usable, here = usable[here:], 0  # too soon to go denser
        spread = self.stay_spread * self.rate.spread(now) if self.rate.fell_from is not None else 0.0
        chosen, predicted = None, math.inf
        for i, p in enumerate(usable):
            if i < here - self.max_step and not settled and not self.scales[p].ready(now):
                continue  # too far up to trust the served pair's scale for it
            ms = self.predict(p, max(0.0, rate - spread) if i == here else rate, self._lent_margin(p, i < here, now))
            if ms <= (move if i < here else stay):
                chosen, predicted = p, ms
                break
        meets = chosen is not None
        if chosen is None:  # nothing meets it: the fastest
            chosen = self.fastest()
            predicted = self.predict(chosen, rate)
        if chosen != self.current:
            self.current, self.switches, self.switched_at = chosen, self.switches + 1, now
        return Decision(chosen, predicted, meets, rate)

    def _lent_margin(self, pair: Pair, better: bool, now: float) -> float:
        """How much slower than its scale a candidate is judged: ``lent_margin`` for a pair better than the
        served one whose scale is lent (its own not current), unless the load has stepped down (a scale
        lent then was measured at the higher load); else 0."""
        lent = better and self.rate.fell_from is None and not self.scales[pair].ready(now)
        return self.lent_margin if lent else 0.0

    def raw_request_ms(self, pair: Pair, rows: int, rows_ahead: int,
                       elsewhere: Optional[Mapping[Pair, int]] = None) -> float:
        """A request's own modelled latency (ms, uncorrected): ``rows_ahead`` rows in flight at ``pair``
        first (the batch running and the one queued behind it), then its own batch, the two in series (one
        model runs one batch at a time); the rows in flight at other pairs (``elsewhere``) run beside them
        on the same cores (processor sharing: each model runs at half speed while both have work), so they
        delay it by their own work or by its, whichever is less, not by their whole backlog in series."""
        f = self.service.affine(pair)
        ahead = 2 * f.a + f.c * rows_ahead if rows_ahead > 0 else 0.0
        own = ahead + f.ms(rows)
        beside = sum(self.service.ms(p, n) for p, n in (elsewhere or {}).items()
                     if n > 0 and p != pair and p in self.service.fits)
        return own + min(own, beside)

    def request_ms(self, pair: Pair, rows: int, rows_ahead: int,
                   elsewhere: Optional[Mapping[Pair, int]] = None) -> float:
        """:meth:`raw_request_ms` corrected by what admitted requests measured (:attr:`admission`), its
        slope at least ``pair``'s service scale (queued work runs no faster than the pair serves)."""
        return self.admission.ms(self.raw_request_ms(pair, rows, rows_ahead, elsewhere), self.factor(pair))

    @property
    def admission_limit_ms(self) -> float:
        """The latest a request with work ahead of it is admitted at (ms): the SLO less the margin every
        choice keeps (admitted at the SLO itself, a burst's answers end just past it)."""
        return self.slo_ms * (1 - self.margin)

    def admit(self, pair: Pair, rows: int, rows_ahead: int, elsewhere: Optional[Mapping[Pair, int]] = None,
              live_slope: float = 0.0) -> Tuple[bool, float, float]:
        """Whether to run a request of ``rows`` at ``pair`` with ``rows_ahead`` in flight there and
        ``elsewhere`` at other pairs (its corrected prediction within :attr:`admission_limit_ms`), the corrected
        prediction and the uncorrected one (what :meth:`admitted` takes back with the measured latency).
        ``live_slope``: the running batch's time so far over its modelled time; the correction's slope is at
        least that, as at least the pair's scale. An overrunning batch is the first sign of a slow-down, long
        before the scale (20 batches) or the correction (30 answers) can see it."""
        raw = self.raw_request_ms(pair, rows, rows_ahead, elsewhere)
        ms = self.admission.ms(raw, max(self.factor(pair), live_slope))
        return ms <= self.admission_limit_ms, ms, raw

    def overflows(self, pair: Pair, rows: int, rows_ahead: int, elsewhere: Optional[Mapping[Pair, int]] = None) -> bool:
        """Whether a request the policy routes to ``pair`` (``rows_ahead`` in flight there, ``elsewhere`` at
        the others) is predicted (:meth:`request_ms`) past ``overflow`` x the SLO, or ``surge_overflow`` x
        the SLO while the arrivals run ``surge_sigmas`` above the estimate (:attr:`RateEstimator.surge`):
        then it goes to :meth:`fastest` (the router's admission), which drains a sudden queue soonest."""
        limit = self.surge_overflow if self.rate.surge >= self.surge_sigmas else self.overflow
        return rows_ahead > 0 and self.request_ms(pair, rows, rows_ahead, elsewhere) > limit * self.slo_ms

    def fastest(self, among: Optional[Sequence[Pair]] = None) -> Pair:
        """The pair of least batch-1 service time among ``among`` (default: the allowed pairs not
        unavailable, else all allowed)."""
        usable = among or [p for p in self.pairs if p not in self.unavailable] or self.pairs
        return min(usable, key=lambda p: self.service.ms(p, 1))

    def admitted(self, measured_ms: float, raw_ms: float) -> None:
        """An admitted request's measured latency against its uncorrected admission prediction."""
        self.admission.add(measured_ms, raw_ms)

    def served_batches(self, pair: Pair, batches: Sequence[Tuple[int, int, float]], now: Optional[float] = None) -> None:
        """Batches ``pair``'s budget model ran since the last call, as ``(rows, count, total_ms)`` (the
        server's per-batch statistics): its :class:`ServiceScale`."""
        own = self.scales.get(pair)
        if own is None:
            return
        for rows, count, total_ms in batches:
            own.add(rows, count, total_ms, self.service.affine(pair), now)
        if own.ready(now):
            self.fallback_scale = own.factor

    def answered(self, measured_ms: float, model_ms: Optional[float] = None) -> None:
        """An answered request's latency (ms) and (when known) the part of it spent in the budget model
        (queue and run, ``model_ms``): the rest is :meth:`overhead_ms`."""
        self.recent.append(measured_ms)
        if model_ms is not None:
            self.overheads.append(max(0.0, measured_ms - model_ms))
            self._overhead_ms = quantile_of(list(self.overheads), ADMISSION_QUANTILE)


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
