"""The served router's latency model and decision (``elastic_export.serving.slo``): synthetic Poisson
arrivals on an injected clock, nothing timed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from elastic_export.serving import slo

BUDGETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6)


def _points() -> dict:
    """Service times shaped like MiniLM's at 128 tokens on 2 cores: dense ``S(n) = 2 + 14 n`` ms (batching saves
    little on a CPU; 71 rows/s), every budget cheaper in proportion to its sparsity."""
    return {(s, "fp32"): {1: (2 + 14) * (1 - 0.8 * s), 8: (2 + 14 * 8) * (1 - 0.8 * s)} for s in BUDGETS}


def _policy(clock, window_s: float | None = None, **kw) -> slo.SloPolicy:
    """The policy over :data:`BUDGETS` at SLO 250 ms; ``window_s``: the rate estimate's (default: its own)."""
    service = slo.ServiceModel(_points())
    rate = slo.RateEstimator(clock=clock) if window_s is None else slo.RateEstimator(window_s=window_s, clock=clock)
    return slo.SloPolicy([(s, "fp32") for s in BUDGETS], service, 250.0, rate=rate, **kw)


def _run(policy: slo.SloPolicy, now: list, rates_and_seconds, seed: int = 0) -> list[tuple[float, float]]:
    """Seeded Poisson arrivals, phase by phase; (time, served sparsity) of every decision."""
    rng = np.random.default_rng(seed)
    out = []
    for rate, seconds in rates_and_seconds:
        end = now[0] + seconds
        while True:
            now[0] += rng.exponential(1.0 / rate)
            if now[0] >= end:
                now[0] = end
                break
            policy.rate.arrive(now[0])
            out.append((now[0], policy.decide(now[0]).pair[0]))
    return out


@pytest.mark.parametrize("a, c", [(1.3, 15.0), (12.0, 14.0), (4.0, 6.0)])
@pytest.mark.parametrize("load", [0.3, 0.6, 0.8])
def test_the_prediction_is_the_queue_it_models(a, c, load):
    """The tabulated queue against the same queue simulated batch by batch on other random numbers
    (MiniLM's dense budget is ``a`` 1.3, ``c`` 15 ms on the 2-core machine: where a mean-value estimate
    gave a p99 of 34 ms at 0.6 of capacity, the queue has about 120 ms)."""
    f = slo.Affine(a, c)
    rate = load * 1e3 / c
    lat = slo.queue_latencies(a, c, rate, seed=7)  # batch by batch, other random numbers than the table
    for q in (0.5, 0.9, 0.99):
        predicted, simulated = slo.predict_quantile_ms(f, rate, q), float(np.quantile(lat, q))
        # at 0.8 the p99 of 10,000 arrivals (the table's) runs 5-20 % above that of 40,000: on the safe side
        assert simulated * 0.95 <= predicted <= simulated * (1.25 if q == 0.99 and load > 0.7 else 1.1), q


def test_fit_affine():
    fit = slo.fit_affine({1: 26.0, 8: 124.0})
    assert fit.a == pytest.approx(12.0) and fit.c == pytest.approx(14.0)
    assert slo.fit_affine({1: 5.0}).ms(4) == pytest.approx(20.0)
    assert slo.ServiceModel({(0.0, "fp32"): {1: 26.0, 8: 124.0}}).ms((0.0, "fp32"), 2) == pytest.approx(40.0)


def test_the_prediction_grows_with_the_rate_and_is_infinite_past_capacity():
    service = slo.Affine(12.0, 14.0)
    ms = [slo.predict_quantile_ms(service, r) for r in (0.0, 10.0, 30.0, 50.0, 65.0)]
    assert ms == sorted(ms) and ms[0] == pytest.approx(26.0)  # idle: one row's service time
    assert math.isinf(slo.predict_quantile_ms(service, 72.0))  # 72 rows/s x 14 ms > 1
    assert slo.predict_quantile_ms(service, 40.0, 0.5) < slo.predict_quantile_ms(service, 40.0, 0.99)


def test_rate_estimator_window_and_steps():
    now = [0.0]
    est = slo.RateEstimator(window_s=2.0, short_s=0.5, clock=lambda: now[0])
    for i in range(80):  # 40/s for 2 s
        now[0] = i / 40
        est.arrive()
    assert est.rate() == pytest.approx(40, rel=0.05)
    for i in range(60):  # a step to 160/s: the short window takes over within 0.4 s
        now[0] = 2 + i / 160
        est.arrive()
    assert est.rate() > 100
    for i in range(60, 80):
        now[0] = 2 + i / 160
        est.arrive()
    assert est.rate() == pytest.approx(160, rel=0.05)
    for i in range(80, 320):  # 160/s for 2 s in all
        now[0] = 2 + i / 160
        est.arrive()
    for i in range(1, 21):  # a step down to 40/s: within half a second the estimate follows
        now[0] = 4 + i / 40
        est.arrive()
    assert est.rate() < 60
    for i in range(21, 60):
        now[0] = 4 + i / 40
        est.arrive()
    assert est.rate() == pytest.approx(40, rel=0.05)
    now[0] += 1.0  # silence: the estimate falls at once
    assert est.rate() < 20
    est.arrive(rows=8)  # a request of 8 rows counts as 8
    assert est.rate() >= 8 / 2.0


def test_a_step_up_is_seen_at_a_lower_threshold_than_a_step_down():
    """The step test's threshold is lower for a step up (3.5 standard deviations) than down (4): evenly
    spaced arrivals stepping from 30 to 90 rows/s (the load test's 0.6x to 1.4x is 36 to 84) are seen
    0.39 s after the step, 0.46 s at 4; a step down is tested as before."""
    def seen_after(before: float, after: float, up_sigmas: float) -> float:
        now = [0.0]
        est = slo.RateEstimator(sigmas_up=up_sigmas, clock=lambda: now[0])
        times = [i / before for i in range(int(3 * before))] + [3 + i / after for i in range(1, int(2 * after))]
        for t in times:
            now[0] = t
            est.arrive()
            est.rate()
            if est.origin > 2.5:
                return t - 3
        return math.inf

    assert seen_after(30, 90, 3.5) < seen_after(30, 90, 4.0) < 1.0
    assert seen_after(70, 30, 3.5) == seen_after(70, 30, 4.0)  # a step down: the same test as before


@pytest.mark.parametrize("pause", [False, True])
def test_a_burst_goes_straight_to_the_budget_it_needs(pause):
    """A 3x burst after 0.3x (or after a pause): once the step test sees it, the policy serves the pair the
    burst needs (the fastest: nothing meets the SLO at 3x), not each pair the young estimate passes on its
    way up (on the estimate since the test window's start: dense, 0.4, 0.5, then 0.6 within 0.15 s, each
    given requests that then ran beside the others on the same cores). A client's pause and bunch in a
    steady load moves no denser (test_a_step_down_stands_only_if_it_holds_a_quarter_second_later)."""
    for seed in range(6):
        now = [0.0]
        policy = _policy(lambda: now[0])
        phases = [(0.3 * 71, 10.0)] + ([(1e-3, 2.0)] if pause else []) + [(3 * 71, 2.0)]
        decisions = _run(policy, now, phases, seed=seed)
        start = sum(s for _, s in phases[:-1])
        served = [s for t, s in decisions if start <= t < start + 1.0]
        moves = [s for i, s in enumerate(served) if i == 0 or s != served[i - 1]]
        assert moves == [0.0, 0.6], (seed, moves)
        seen = next(t for t, s in decisions if t >= start and s == 0.6) - start
        assert seen < 0.15 and policy.rate.young_rate(now[0]) is None  # the young rate only while young


def test_constant_moderate_load_stays_dense():
    """0.6x of dense capacity (the issue's phase where the old rule served 0.4-0.6): dense throughout."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    served = [s for t, s in _run(policy, now, [(0.6 * 71, 30.0)]) if t > 2.0]
    assert np.mean([s == 0.0 for s in served]) >= 0.99 and policy.switches <= 2


def test_a_step_up_goes_sparse_within_a_second_and_a_step_down_returns_to_dense_within_a_few():
    now = [0.0]
    policy = _policy(lambda: now[0])
    decisions = _run(policy, now, [(0.3 * 71, 10.0), (1.4 * 71, 10.0), (0.3 * 71, 10.0)])
    assert all(s == 0.0 for t, s in decisions if 2.0 < t < 10.0)
    sparse_at = next(t for t, s in decisions if t >= 10.0 and s > 0.0)
    assert sparse_at - 10.0 < 1.0
    during = [s for t, s in decisions if 12.0 < t < 20.0]
    assert min(during) > 0.0 and np.mean([s >= 0.3 for s in during]) > 0.9  # 1.4x: only the sparse half keeps up
    dense_again = next(t for t, s in decisions if t >= 20.0 and all(x == 0.0 for u, x in decisions if u >= t))
    assert dense_again - 20.0 < 3.0


def _walk_back(seeds=range(4), **kw) -> list[float]:
    """Seconds from a step down from 1.4x to 0.6x until dense is served for good, per seed."""
    walks = []
    for seed in seeds:
        now = [0.0]
        policy = _policy(lambda: now[0], **kw)
        decisions = _run(policy, now, [(0.3 * 71, 10.0), (1.4 * 71, 10.0), (0.6 * 71, 10.0)], seed=seed)
        walks.append(next(t for t, s in decisions if t >= 20.0 and all(x == 0.0 for u, x in decisions if u >= t)) - 20)
        assert policy.rate.fell_at > 20.0
    return walks


def test_a_step_down_in_the_load_lifts_the_dwell_and_the_step_limit(monkeypatch):
    """From 1.4x to 0.6x: the first move denser comes with the detected step, not a dwell after the last
    switch (a detected step is not noise); once the estimate has rested half a second on the new load,
    the next goes straight to the best budget that meets the SLO, not three budgets a move with a dwell
    between (the served budget's scale, measured at the higher load, errs on the safe side)."""
    walks = _walk_back()
    assert np.mean(walks) < 0.8 and max(walks) < 1.25, walks
    monkeypatch.setattr(slo.RateEstimator, "settled_fall", lambda self, now, within_s=2.0: False)
    assert np.mean(_walk_back()) > 1.25  # three budgets a move, a dwell between: 1.34 s on these seeds


def _dense_after_step_down(stay_spread: float, seeds=range(8)) -> list[float]:
    """Share of decisions for dense from 1 s after a step down from 1.4x to the rate at which dense's
    prediction is 85 % of SLO x (1 - margin), per seed."""
    shares = []
    for seed in seeds:
        now = [0.0]
        policy = _policy(lambda: now[0], stay_spread=stay_spread)
        rate = next(r for r in np.arange(20, 80, 0.25) if policy.predict((0.0, "fp32"), r) > 0.85 * 250 * 0.95)
        decisions = _run(policy, now, [(1.4 * 71, 10.0), (rate, 10.0)], seed=seed)
        shares.append(np.mean([s == 0.0 for t, s in decisions if t > 11.0]))
    return shares


def test_after_a_step_down_the_served_budget_is_judged_a_standard_error_below_the_young_estimate():
    """The load test's second 0.6x: after the step down the estimate is young and noisy (14 % one second
    in), and dense, which meets the SLO at the true rate with 15 % to spare, is sent sparser by its upward
    swings (without the spread one seed of eight keeps dense for 58 % of the phase). Judged a standard
    error below the estimate it stays: every seed 94 % or more (the step down held a quarter second
    before it counts, :class:`~elastic_export.serving.slo.RateEstimator`'s ``hold_s``)."""
    without, spread = _dense_after_step_down(0.0), _dense_after_step_down(1.0)
    assert min(without) < 0.8 and min(spread) >= 0.94 and np.mean(spread) > np.mean(without), (without, spread)


def test_a_dip_in_a_high_load_does_not_send_it_dense():
    """At 1.4x, noise the step test reads as a step down lifts the step limit only once the estimate has
    rested half a second on the supposed new load, by when the dip is mostly gone from it: never dense."""
    for seed in range(8):
        now = [0.0]
        policy = _policy(lambda: now[0])
        decisions = _run(policy, now, [(1.4 * 71, 30.0)], seed=seed)
        assert all(s > 0.0 for t, s in decisions if t > 1.0), seed


def _held_back(hold_s: float, seed: int) -> tuple[slo.SloPolicy, list[tuple[float, float]]]:
    """1.4x for 12 s (100 rows/s, seeded Poisson) with the arrivals of 10.0-10.3 s held back and delivered at
    once at 10.3 s (a client's pause: in the load test's burst its garbage collection held its requests
    back 162 ms); the policy and its decisions."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / 100.0, 1300))
    times = np.where((times >= 10.0) & (times < 10.3), 10.3, times)
    now = [0.0]
    policy = _policy(lambda: now[0])
    policy.rate.hold_s = hold_s
    out = []
    for t in times[times < 12.0]:
        now[0] = float(t)
        policy.rate.arrive(now[0])
        out.append((now[0], policy.decide(now[0]).pair[0]))
    return policy, out


def test_a_step_down_stands_only_if_it_holds_a_quarter_second_later():
    """Arrivals held back 0.3 s, then bunched, inside a steady 1.4x: the step test reads the gap as a step
    down in each of 8 seeds. Without the hold the policy moves denser at once on the gap's rate (in the load
    test's burst, after a 162 ms pause of the client, the router went from 0.6 to 0.5: 9 answers late);
    with it no move goes denser, and no step down stands (the bunch is then a step up: sparser for a
    moment). A real step down (1.4x to 0.6x) still stands, and dense is back within 1.25 s."""
    for seed in range(8):
        without, moved = _held_back(0.0, seed)
        policy, held = _held_back(0.25, seed)
        assert 10.0 < policy.rate.fell_at < 10.5 and 10.0 < without.rate.fell_at < 10.5, seed
        before = min(s for t, s in held if 9.0 < t < 10.0)
        assert min(s for t, s in moved if t >= 10.0) < before, seed
        assert min(s for t, s in held if t >= 10.0) >= before and policy.rate.fell_from is None
    walks = _walk_back()
    assert max(walks) < 1.25, walks


def test_served_budget_is_the_densest_that_meets_the_slo():
    """At each rate the pick is the first pair (best first) whose corrected prediction meets SLO x (1 - margin);
    a pair better than the current one must meet it with the hysteresis' slack too, judged ``lent_margin``
    slower while its scale is lent (none here is measured)."""
    now = [0.0]
    policy = _policy(lambda: now[0], dwell_s=0.0, max_step=len(BUDGETS))  # test_a_move_denser_steps_... below
    for rate in (10.0, 50.0, 60.0, 70.0, 90.0, 110.0):
        policy.rate.rate = lambda now=None, r=rate: r
        stay = [p for p in policy.pairs if policy.predict(p, rate) <= 250 * (1 - policy.margin)]
        policy.current = policy.pairs[0]
        assert policy.decide(0.0).pair == stay[0]
        move = [p for p in policy.pairs
                if policy.predict(p, rate, policy.lent_margin) <= 250 * (1 - policy.margin - policy.hysteresis)]
        policy.current = policy.pairs[-1]
        assert policy.decide(0.0).pair == (move[0] if move else policy.pairs[-1])


def _boundary_switches(window_s: float, seeds=range(4), **kw) -> int:
    """Switches over 60 s at the load where dense's prediction crosses SLO x (1 - margin), summed over seeds."""
    total = 0
    for seed in seeds:
        now = [0.0]
        policy = _policy(lambda: now[0], window_s, **kw)
        boundary = next(r for r in np.arange(30, 80, 0.5) if policy.predict((0.0, "fp32"), r) > 250 * (1 - policy.margin))
        _run(policy, now, [(boundary, 60.0)], seed=seed)
        total += policy.switches
    return total


def test_hysteresis_in_slack_keeps_a_load_at_the_boundary_from_flapping():
    """A load right where dense stops meeting SLO x (1 - margin): the slack, the dwell and the lent scale's
    margin cut the moves."""
    window = slo.RateEstimator().window_s
    with_it = _boundary_switches(window)
    without = _boundary_switches(window, hysteresis=0.0, dwell_s=0.0, lent_margin=0.0)
    assert with_it <= 0.35 * without, (with_it, without)


def test_the_default_rate_window_flaps_less_at_the_boundary_than_a_4s_one():
    """The estimate's noise at a steady load moves the choice near a budget's limit: the default window
    (8 s; a step in the load is still followed at once) makes fewer moves there than a 4 s one."""
    assert slo.RateEstimator().window_s == 8.0
    assert _boundary_switches(8.0) <= 0.7 * _boundary_switches(4.0)


def _batches_at_scale(policy: slo.SloPolicy, now: list, pair, scale: float, n: int, dt: float = 0.1) -> None:
    """``n`` reads of the server's statistics, 0.1 s apart, each two batches at ``pair`` (one and three
    rows) that took ``scale`` x their modelled time."""
    for _ in range(n):
        now[0] += dt
        policy.served_batches(pair, [(1, 1, scale * policy.service.ms(pair, 1)),
                                     (3, 1, scale * policy.service.ms(pair, 3))], now[0])


def test_the_measured_batch_times_scale_the_service_times_and_move_the_saturation_point():
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense, sparse = (0.0, "fp32"), (0.3, "fp32")
    bare = policy.predict(dense, 20.0)
    _batches_at_scale(policy, now, dense, 2.0, 5)  # 10 batches: not yet min_batches
    assert policy.factor(dense) == pytest.approx(1.0)
    _batches_at_scale(policy, now, dense, 2.0, 10)  # the server runs dense's batches at half the model's speed
    assert policy.factor(dense) == pytest.approx(2.0, rel=1e-6)
    f = policy.service.affine(dense)
    assert policy.predict(dense, 20.0) == pytest.approx(
        slo.predict_quantile_ms(slo.Affine(2 * f.a, 2 * f.c), 20.0, policy.quantile), rel=1e-6)
    assert policy.predict(dense, 20.0) > 2 * bare  # more than twice: the queue grows faster than the service
    assert policy.factor(sparse) == pytest.approx(2.0, rel=1e-6)  # no batches of its own: the served pair's
    # 40 rows/s: the bare model has dense at 56 % of its capacity (71 rows/s), the scaled one past it
    assert math.isfinite(slo.predict_quantile_ms(f, 40.0)) and policy.predict(dense, 40.0) == math.inf
    policy.rate.rate = lambda now=None: 40.0
    assert policy.decide(now[0]).pair[0] > 0.0  # dense cannot carry 40 rows/s at 2x
    _batches_at_scale(policy, now, dense, 1.0, 101)  # as modelled for 10 s: the 2x batches weigh e^-1 or less
    assert 1.0 < policy.factor(dense) < 1.1
    _batches_at_scale(policy, now, dense, 1.0, 400)  # 50 s: next to nothing
    assert policy.factor(dense) == pytest.approx(1.0, abs=1e-3)


def test_the_service_scale_weighs_every_batch_by_its_modelled_time():
    """Batches of several sizes: the scale is their measured time over their modelled time in all, so one
    large batch counts as the work it is, and the clamp bounds a read that makes no sense."""
    now = [0.0]
    scale = slo.ServiceScale(min_batches=3, clock=lambda: now[0])
    f = slo.Affine(2.0, 10.0)
    scale.add(1, 2, 2 * 12.0 * 1.5, f)  # two batches of 1 at 1.5x
    scale.add(8, 1, 82.0 * 1.1, f)  # one of 8 at 1.1x
    assert scale.ready() and scale.factor == pytest.approx((36.0 + 90.2) / (24.0 + 82.0))
    scale.add(1, 0, 10.0, f)  # nothing ran: ignored
    scale.add(2, 1, float("nan"), f)
    assert scale.factor == pytest.approx((36.0 + 90.2) / (24.0 + 82.0))
    now[0] = 2.5
    assert not scale.ready()  # nothing for 2 s: stale
    scale.add(1, 5, 5 * 12.0 * 100, f)
    assert scale.factor == scale.bounds[1]


def test_the_time_outside_the_budget_model_is_added_once_not_scaled():
    """Answers that spend 12 ms outside the budget model: each prediction carries the 12 ms once, and the
    service scale (measured on the batches) is untouched by them (a scale fitted to whole latencies read
    12 ms at a light load as a slower model and overstated every queue)."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    f = policy.service.affine(dense)
    for i in range(50):
        now[0] += 0.02
        model = 16.0 + 14.0 * (i % 4)
        policy.answered(model + 12.0, model_ms=model)
    assert policy.factor(dense) == pytest.approx(1.0) and policy.overhead_ms() == pytest.approx(12.0)
    assert policy.predict(dense, 40.0) == pytest.approx(12.0 + slo.predict_quantile_ms(f, 40.0, policy.quantile), rel=1e-6)
    assert policy.measured() == pytest.approx(12.0 + 16.0 + 14.0 * 3)


def test_a_budget_not_served_since_a_spike_forgets_its_spike_scale():
    """Dense's batches during a spike ran 3x their modelled time; afterwards only 0.3 is served, as
    modelled. Once dense has no batch for 2 s its own scale no longer counts (the served pair's does): the
    low load goes back to dense (a stale window would keep it away)."""
    now = [0.0]
    policy = _policy(lambda: now[0], dwell_s=0.0)
    dense, sparse = (0.0, "fp32"), (0.3, "fp32")
    _batches_at_scale(policy, now, dense, 3.0, 15)
    assert policy.factor(dense) == pytest.approx(3.0, rel=1e-6)
    policy.rate.rate = lambda now=None: 20.0
    assert policy.decide(now[0]).pair != dense  # 3x: dense misses it at 20 rows/s
    assert policy.current != dense
    _batches_at_scale(policy, now, sparse, 1.0, 12)  # 1.2 s at 0.3, as modelled: dense's own still fresh
    assert policy.factor(dense) == pytest.approx(3.0, rel=1e-6)
    _batches_at_scale(policy, now, sparse, 1.0, 10)  # 1 s more: dense's own is stale
    assert not policy.scales[dense].ready() and policy.factor(dense) == pytest.approx(1.0, rel=1e-6)
    spiked = policy.pairs.index(policy.current)  # where the spike sent it
    assert spiked >= 4
    path = [policy.decide(now[0]).pair for _ in range(2)]
    assert path == [policy.pairs[spiked - 3], dense]  # back to dense 2 s after its last batch, 3 budgets a move


def test_a_scale_below_one_is_not_lent():
    """Dense's batches ran at 0.9 of their start-up measurement (that measurement ran slow); 0.4, with no
    batches of its own, is predicted at scale 1, not 0.9, so a step up does not pick it on dense's luck."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense, sparse = (0.0, "fp32"), (0.4, "fp32")
    _batches_at_scale(policy, now, dense, 0.9, 25)
    assert policy.factor(dense) == pytest.approx(0.9, rel=1e-6) and policy.factor(sparse) == 1.0
    _batches_at_scale(policy, now, dense, 1.3, 200)  # above 1 it is lent as measured
    assert policy.factor(sparse) == pytest.approx(policy.factor(dense)) and policy.factor(dense) > 1.2


def test_a_budget_not_served_just_now_keeps_its_own_lower_scale_while_it_weighs_enough():
    """Dense measured 1.15 while served; then 0.2, whose batches read 1.3 (a sparser budget's batches carry
    more fixed costs). Two seconds on, dense is predicted with its own 1.15, not 0.2's 1.3; once its own
    batches, aged, weigh less than ``min_batches``, with 0.2's."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense, sparse = (0.0, "fp32"), (0.2, "fp32")
    _batches_at_scale(policy, now, dense, 1.15, 15)
    policy.current = sparse
    _batches_at_scale(policy, now, sparse, 1.3, 25)
    assert not policy.scales[dense].ready() and policy.factor(dense) == pytest.approx(1.15, rel=1e-6)
    _batches_at_scale(policy, now, sparse, 1.3, 80)
    assert policy.factor(dense) == pytest.approx(1.3, rel=1e-6)


def test_a_budget_served_again_starts_from_its_own_earlier_scale():
    """The load test's second 0.6x: dense served for 20 s at 1.15 (the first 0.6x), then 0.5 for 20 s at 1.3
    (the 1.4x); dense again, its first batches beside the 1.4x phase's last work at 1.3. Its earlier batches,
    20 s old, still weigh ``min_batches``: it is predicted with its own 1.15, not 0.5's 1.3, and its first
    slow batches move it part of the way; contention that lasts is measured in full."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense, sparse = (0.0, "fp32"), (0.5, "fp32")
    _batches_at_scale(policy, now, dense, 1.15, 200)
    policy.current = sparse
    _batches_at_scale(policy, now, sparse, 1.3, 200)
    assert policy.scales[dense].recent() and policy.factor(dense) == pytest.approx(1.15, rel=1e-6)
    policy.current = dense
    _batches_at_scale(policy, now, dense, 1.3, 10)  # 20 batches in 1 s
    assert 1.15 < policy.factor(dense) < 1.25
    _batches_at_scale(policy, now, dense, 1.3, 200)
    assert policy.factor(dense) > 1.29


def test_a_move_denser_steps_at_most_max_step_budgets_past_the_ones_measured_just_now():
    """From the sparsest budget under a light load: three budgets up per move (dwell 1 s between), so the
    way back to dense measures each on the way; a denser budget with fresh answers of its own is
    trusted from any distance; going sparser is never limited."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    policy.current, policy.switched_at = (0.6, "fp32"), -10.0
    policy.rate.rate = lambda now=None: 10.0
    path = []
    for t in (0.0, 0.5, 1.0, 2.0, 3.0, 4.0):
        now[0] = t
        path.append(policy.decide(t).pair[0])
    assert path == [0.3, 0.3, 0.0, 0.0, 0.0, 0.0]
    policy.current, policy.switched_at = (0.6, "fp32"), -10.0
    _batches_at_scale(policy, now, (0.0, "fp32"), 1.0, 12)  # dense measured just now
    assert policy.decide(now[0]).pair == (0.0, "fp32")
    policy.rate.rate = lambda now=None: 1e4
    assert policy.decide(now[0]).pair == (0.6, "fp32")  # nothing keeps up: the fastest at once


def test_quality_floor_and_unavailable_pairs():
    now = [0.0]
    policy = _policy(lambda: now[0], max_sparsity=0.3, dwell_s=0.0)
    assert policy.pairs[-1] == (0.3, "fp32")
    policy.rate.rate = lambda now=None: 500.0  # nothing keeps up: the fastest allowed, flagged
    decision = policy.decide(0.0)
    assert decision.pair == (0.3, "fp32") and not decision.meets
    policy.rate.rate = lambda now=None: 1.0
    policy.unavailable = {(0.0, "fp32")}
    assert policy.decide(0.0).pair == (0.1, "fp32")
    with pytest.raises(ValueError, match="no budget at or below max_sparsity"):
        slo.SloPolicy([(0.5, "fp32")], slo.ServiceModel({(0.5, "fp32"): {1: 1.0}}), 100.0, max_sparsity=0.2)


def test_admission_bounds_the_wait_behind_rows_in_flight():
    now = [0.0]
    policy = _policy(lambda: now[0])
    ok, ms, _ = policy.admit((0.0, "fp32"), 1, 0)
    assert ok and ms == pytest.approx(16.0)
    ok, ms, _ = policy.admit((0.0, "fp32"), 1, 20)  # 2 x 2 + 20 x 14 + 16
    assert not ok and ms == pytest.approx(300.0)


def test_admission_counts_the_rows_in_flight_at_other_pairs_which_share_the_cores():
    """The other pairs' rows run beside the request's own work (processor sharing): they delay it by the less
    of their work and its own, never by their whole backlog in series."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    elsewhere = {(0.6, "fp32"): 8, (0.3, "fp32"): 8, dense: 50}  # its own pair's entry is rows_ahead's, not counted twice
    beside = 114 * 0.52 + 114 * 0.76  # the other pairs' work: 146 ms
    ok, ms, _ = policy.admit(dense, 1, 0, elsewhere)
    assert ok and ms == pytest.approx(16.0 + 16.0)  # its 16 ms at half speed beside them
    ok, ms, _ = policy.admit(dense, 1, 8, elsewhere)  # + 2 x 2 + 8 x 14 ahead at its own pair: 132 ms in series
    assert not ok and ms == pytest.approx(132.0 + min(132.0, beside))
    assert policy.admit(dense, 1, 8)[0]  # the same wait without the other pairs' work fits
    ok, ms, _ = policy.admit(dense, 1, 0, {(0.6, "fp32"): 1})  # less work beside it than its own: that much
    assert ok and ms == pytest.approx(16.0 + 16.0 * 0.52)


def test_a_queue_building_at_the_served_pair_overflows_to_the_fastest():
    """A request routed to dense behind rows predicted past 0.7 x the SLO is sent to the fastest allowed
    pair (the router's admission): a queue at the served pair is the first sign of a step up. Nothing
    ahead, or a short queue, stays; an unavailable fastest pair gives way to the next fastest."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    limit = policy.overflow * policy.slo_ms
    short = max(n for n in range(1, 40) if policy.request_ms(dense, 1, n) <= limit)
    assert not policy.overflows(dense, 1, 0) and not policy.overflows(dense, 1, short)
    assert policy.overflows(dense, 1, short + 1)
    # work at the other pairs shares the cores: a queue that fits alone overflows beside as much work
    half = min(n for n in range(1, 40) if 2 * policy.request_ms(dense, 1, n) > limit)
    assert not policy.overflows(dense, 1, half) and policy.overflows(dense, 1, half, {(0.1, "fp32"): short})
    assert not policy.overflows(dense, 1, 2, {(0.1, "fp32"): short})  # beside it, not in series before it
    assert policy.fastest() == (0.6, "fp32")
    policy.unavailable = {(0.6, "fp32")}
    assert policy.fastest() == (0.5, "fp32")


def test_a_surge_in_the_arrivals_lowers_the_overflows_limit_before_the_step_test_fires():
    """Arrivals at 2.5 times the estimate for half a second: about 2.9 standard deviations above it, past
    the surge's 2.5 and short of the step test's 3.5; a request with a queue ahead past 0.4 x the SLO (not
    0.7) then overflows. At the steady rate the same queue stays."""
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    queue = next(n for n in range(1, 40) if policy.request_ms(dense, 1, n) > policy.surge_overflow * policy.slo_ms)
    assert policy.request_ms(dense, 1, queue) <= policy.overflow * policy.slo_ms

    def arrivals(start: float, end: float, per_s: float) -> None:
        for t in np.arange(start, end, 1.0 / per_s):
            now[0] = t
            policy.rate.arrive(t)
            policy.decide(t)

    arrivals(0.0, 4.0, 20.0)
    assert policy.rate.surge < policy.surge_sigmas and not policy.overflows(dense, 1, queue)
    origin = policy.rate.origin
    arrivals(4.0, 4.5, 50.0)
    assert policy.surge_sigmas <= policy.rate.surge < policy.rate.sigmas_up and policy.rate.origin == origin
    assert policy.overflows(dense, 1, queue) and not policy.overflows(dense, 1, 0)


def test_admission_correction_fits_fixed_costs_and_slow_downs_from_what_admitted_requests_measured():
    now = [0.0]
    corr = slo.AdmissionCorrection(min_samples=30, clock=lambda: now[0])
    rng = np.random.default_rng(0)
    for i in range(29):
        corr.add(15.0 + 1.5 * (10 + i), 10 + i)
    assert corr.ms(100.0) == 100.0  # the identity until min_samples answers are in
    for i in range(200):
        now[0] += 0.01
        raw = float(rng.uniform(10, 120))
        corr.add(15.0 + 1.5 * raw + float(rng.uniform(0, 10)), raw)  # fixed 15 ms, 1.5x the work, noise 0-10 ms
    assert corr.k == pytest.approx(1.5, abs=0.05)
    assert corr.ms(100.0) == pytest.approx(15.0 + 150.0 + 9.0, abs=3.0)  # the p90 of the noise on top
    assert corr.ms(10.0) == pytest.approx(15.0 + 15.0 + 9.0, abs=3.0)  # a fixed cost, not a factor: small ones stay small
    fitted = corr.ms(100.0)
    now[0] += 60.0  # a quiet minute: the fit stays until new answers replace it, never the identity again
    corr.add(40.0 + 2.0 * 10.0, 10.0)  # the new load's first answer
    assert corr.ms(100.0) == pytest.approx(fitted)
    for i in range(40):  # past the horizon, min_samples newer answers: the old ones are gone
        now[0] += 0.01
        corr.add(40.0 + 2.0 * (30.0 + i), 30.0 + i)
    assert corr.k == pytest.approx(2.0) and corr.ms(100.0) == pytest.approx(40.0 + 200.0)


def test_a_slope_floor_keeps_the_admission_line_through_the_answers_quantile():
    """A closed loop of 8 clients: every admitted request finds about the same work ahead, so the fitted
    slope is noise (here clamped to 0.5). Raised to the pair's scale (1.15) the line still predicts the
    answers' p90 at their own predictions, not that plus the slopes' difference times the prediction
    (about 70 ms here, which put the typical request past the SLO's 237.5 ms and refused it)."""
    now = [0.0]
    corr = slo.AdmissionCorrection(min_samples=30, clock=lambda: now[0])
    rng = np.random.default_rng(1)
    answers = []
    for i in range(200):
        now[0] += 0.01
        raw, measured = float(rng.uniform(105, 115)), float(rng.uniform(120, 200))
        if i < 100:
            measured += 0.3 * (115 - raw)  # flat data whose slope comes out below the clamp
        corr.add(measured, raw)
        answers.append((raw, measured))
    assert corr.k == 0.5
    p90 = slo.quantile_of([m for _, m in answers], 0.9)
    assert corr.ms(110.0, 1.15) == pytest.approx(p90, abs=10.0) and corr.ms(110.0, 1.15) < 237.5
    above = sum(m > corr.ms(r, 1.15) for r, m in answers) / len(answers)
    assert 0.05 <= above <= 0.15  # the quantile it stands for
    assert corr.ms(110.0, 1.15) - corr.ms(100.0, 1.15) == pytest.approx(11.5)  # at the floor's slope
    assert corr.ms(110.0) == pytest.approx(corr.offset + 0.5 * 110.0)  # no floor: the fitted line


def test_admission_runs_queued_work_no_faster_than_the_pair_serves():
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    _batches_at_scale(policy, now, dense, 3.0, 12)  # dense serves at a third of the model's speed
    ok, ms, raw = policy.admit(dense, 1, 8)
    assert raw == pytest.approx(132.0) and ms == pytest.approx(3.0 * 132.0, rel=1e-3) and not ok


def test_admission_uses_what_admitted_requests_measured():
    now = [0.0]
    policy = _policy(lambda: now[0])
    dense = (0.0, "fp32")
    assert policy.admit(dense, 1, 8)[0]  # 2 x 2 + 8 x 14 + 16 = 132 ms modelled
    for i in range(60):  # every admitted request took twice its modelled latency, plus 20 ms
        now[0] += 0.05
        raw = 26.0 + 14.0 * (i % 10)
        policy.admitted(20.0 + 2.0 * raw, raw)
    ok, ms, raw = policy.admit(dense, 1, 8)
    assert raw == pytest.approx(132.0) and ms == pytest.approx(20.0 + 2 * 132.0, abs=1.0) and not ok


def test_oracle_is_the_densest_pair_whose_capacity_covers_the_rate_with_headroom():
    pairs = [(s, "fp32") for s in (0.0, 0.3, 0.6)]
    caps = {pairs[0]: 68.0, pairs[1]: 80.0, pairs[2]: 118.0}
    assert slo.oracle_pair(caps, 40.0, pairs) == pairs[0]
    assert slo.oracle_pair(caps, 60.0, pairs) == pairs[1]
    assert slo.oracle_pair(caps, 95.0, pairs) == pairs[2]  # none covers 1.25 x 95: the largest capacity


def _estimate_high(undo_s: float, seed: int, rate: float = 42.0, seconds: float = 60.0, **kw) -> float:
    """The 99.5th percentile of the rate estimate over a steady Poisson load (after its first window)."""
    rng = np.random.default_rng(seed)
    now = [0.0]
    est = slo.RateEstimator(undo_s=undo_s, clock=lambda: now[0], **kw)
    estimates = []
    while now[0] < seconds:
        now[0] += rng.exponential(1 / rate)
        est.arrive()
        estimates.append((now[0], est.rate()))
    return float(np.percentile([r for t, r in estimates if t > est.window_s], 99.5))


def test_a_dip_and_its_return_in_a_steady_load_is_not_a_step_up():
    """0.6x (42 rows/s), 20 seeds of 60 s: a lull the step test reads as a step down moves the origin into
    it, and the load's return then reads as a step up over the lull alone, an estimate from half a second
    of arrivals (80 requests/s for 47 in the load test's second 0.6x, dense predicted past the SLO, 0.4
    served). A step up within ``undo_s`` of a step down that is no step up over the load before the dip
    undoes the step down. With the step test's pooled variance no lull of these seeds is read as a step
    down at the default threshold, undone or not; at 2.5 standard deviations lulls are, and the undo keeps
    the estimate within 15 % of the rate at p99.5 in every seed (one seed reads 1.55x without)."""
    for undo_s in (2.0, 0.0):
        assert max(_estimate_high(undo_s, seed) for seed in range(20)) < 1.15 * 42
    undone = [_estimate_high(2.0, seed, sigmas=2.5) for seed in range(20)]
    kept = [_estimate_high(0.0, seed, sigmas=2.5) for seed in range(20)]
    assert max(undone) < 1.15 * 42 and max(kept) > 1.4 * 42, (undone, kept)


def _dip_then(after: float) -> tuple[slo.RateEstimator, float]:
    """42 rows/s for 8 s, a lull at 4/s for 1 s (read as a step down), then ``after`` rows/s for 1 s; the
    estimator and its estimate half a second into ``after``."""
    now = [0.0]
    est = slo.RateEstimator(clock=lambda: now[0])
    times = [i / 42 for i in range(8 * 42)] + [8 + i / 4 for i in range(1, 4)] + [9 + i / after for i in range(1, int(after))]
    half = 0.0
    for t in times:
        now[0] = t
        est.arrive()
        rate = est.rate()
        half = rate if t <= 9.5 else half
    return est, half


def test_the_load_back_after_a_dip_undoes_the_step_down_and_a_step_up_after_one_is_still_seen():
    """Back to the load before the dip: the step down is undone (the origin goes back before the dip).
    Well above it (1.4x after 0.6x and a lull): a step up over the load before the dip too, seen within half
    a second of its start, as without the dip."""
    back, _ = _dip_then(42)
    assert back.fell_at > 8.0 and back.origin < 8.0 and back.fell_from is None
    up, half = _dip_then(100)
    assert up.origin > 8.9 and up.fell_from is None and half > 80


def test_a_better_pair_on_a_lent_scale_is_judged_slower_until_its_own_is_measured():
    """Runs 73, 75 and 79 of the load test: at 1.4x the router moved from 0.6 to 0.5, predicted within the
    move's slack on 0.6's lent scale, and 0.5's first batches ran up to twice that (10-29 requests late
    each time). A better pair whose own scale is not current is judged ``lent_margin`` slower: where it
    meets the slack only on the lent scale, the served pair stays; after a step down (a scale lent then was
    measured at the higher load) and once its own scale is measured, it is judged on that alone."""
    now = [100.0]
    policy = _policy(lambda: now[0], dwell_s=0.0)
    here, better = (0.6, "fp32"), (0.5, "fp32")
    move = 250 * (1 - policy.margin - policy.hysteresis)
    rate = next(r for r in np.arange(50.0, 400.0, 0.5) if policy.predict(better, r, policy.lent_margin) > move)
    assert policy.predict(better, rate) <= move  # within the slack on the lent scale as it is
    policy.rate.rate = lambda now=None: rate

    def pick(fell_from=None) -> tuple:
        policy.current, policy.rate.fell_from = here, fell_from
        return policy.decide(now[0]).pair

    assert pick() == here
    assert pick(fell_from=90.0) == better  # after a step down the lent scale errs on the safe side already
    policy.served_batches(better, [(4, 25, 25 * policy.service.ms(better, 4))], now[0])  # its own: as modelled
    assert policy.scales[better].ready(now[0]) and pick() == better
    now[0] += 3.0  # its batches older than fresh_s: lent again
    assert pick() == here


def _falls(seed: int, rate: float = 1.4 * 71, seconds: float = 30.0) -> int:
    """Steps down the estimator detects in a steady Poisson load (after its first window)."""
    rng = np.random.default_rng(seed)
    now, falls, last = [0.0], 0, -math.inf
    est = slo.RateEstimator(clock=lambda: now[0])
    while now[0] < seconds:
        now[0] += rng.exponential(1 / rate)
        est.arrive()
        est.rate()
        falls += est.fell_at != last and now[0] > est.window_s
        last = est.fell_at
    return falls


def test_a_dip_of_a_steady_high_load_is_not_a_step_down():
    """Run 81 of the load test: a dip of the steady 1.4x read as a step down, and with the step limit lifted
    the router moved from 0.6 to 0.3 (20 requests late or refused). A count's own variance shrinks with a
    dip's low count (the step test with it alone read a dip in 12 of 24 replayed 1.4x phases); with the
    pooled rate's as its floor, none of 24 seeds of a steady 1.4x holds a step down."""
    assert sum(_falls(seed) for seed in range(24)) == 0


def _run_weighted(policy: slo.SloPolicy, now: list, rate: float, seconds: float, weight: float) -> list[float]:
    """Seeded Poisson arrivals of one row each costing ``weight`` rows of the nominal length; served sparsities."""
    rng, out, end = np.random.default_rng(3), [], now[0] + seconds
    while now[0] + 1.0 / rate < end:
        now[0] += rng.exponential(1.0 / rate)
        policy.rate.arrive(now[0])
        policy.note_rows(1, weight)
        out.append(policy.decide(now[0]).pair[0])
    return out


def test_short_rows_are_charged_their_padded_length_not_the_nominal_one():
    """1.4x dense's capacity in rows of the nominal length needs a sparse budget; the same row rate of rows a
    quarter as long (each a quarter of the cost) is a 0.35x load, served dense. Rows of the nominal length
    leave the weight at exactly 1 (the 128-token trace is served as before)."""
    now = [0.0]
    long = _policy(lambda: now[0])
    assert np.mean([s > 0 for s in _run_weighted(long, now, 1.4 * 71, 10.0, 1.0)[-200:]]) == 1.0
    assert long.row_weight == 1.0
    now = [0.0]
    short = _policy(lambda: now[0])
    served = _run_weighted(short, now, 1.4 * 71, 10.0, 0.25)
    assert short.row_weight == pytest.approx(0.25, abs=0.01) and np.mean([s == 0.0 for s in served[-200:]]) >= 0.99


def test_the_row_weight_of_a_fresh_policy_is_the_mean_of_the_rows_seen():
    """The starting weight 1 is a guess: a fresh server's first 20 short rows (a quarter of the nominal cost)
    set it to a quarter, not to 0.9 (20 steps of a 200-row moving average); then 6 rows of the nominal
    length move it to their plain mean with those 20."""
    policy = _policy(lambda: 0.0)
    for _ in range(20):
        policy.note_rows(1, 0.25)
    assert policy.row_weight == pytest.approx(0.25)
    policy.note_rows(6, 6.0)
    assert policy.row_weight == pytest.approx((20 * 0.25 + 6) / 26)


def test_the_row_weight_follows_the_latest_rows():
    policy = _policy(lambda: 0.0)
    for _ in range(200):
        policy.note_rows(8, 2.0)  # rows a quarter of the nominal cost
    assert policy.row_weight == pytest.approx(0.25, abs=0.01)
    policy.note_rows(400, 400.0)  # a request of more rows than it remembers: its weight alone
    assert policy.row_weight == 1.0
    policy.note_rows(0, 0.0)
    assert policy.row_weight == 1.0
