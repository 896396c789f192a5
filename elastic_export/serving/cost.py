"""What a request costs by its padded shape, in the latency model's unit: rows of the nominal length.

The router's service times are measured at the model's nominal tokens N (128 for text). A batch of
``rows`` padded to ``length`` tokens costs ``rows x weight(length)`` such rows: a short query a fraction
of one, a long document more than one. The weight is measured on the serving machine (one batch size at a
few lengths, :func:`fit_length_cost`): piecewise linear between the measured lengths, below the
shortest the shortest's weight (fixed costs), above the longest the last segment's slope (attention's
quadratic term shows in the measured points; past them it is not extrapolated). Without measurements,
:func:`linear_cost` (cost proportional to tokens, at least ``floor`` of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, Tuple

MEASURED_LENGTHS = (8, 32)  # lengths measured beside the nominal one (queries are mostly this short)


@dataclass(frozen=True)
class LengthCost:
    """A row's cost by its padded length relative to a row of ``nominal`` tokens.

    Attributes:
        nominal: the length the service times are measured at (weight 1).
        points: ``(length, weight)`` pairs, ascending lengths, ``(nominal, 1.0)`` among them.
    """

    nominal: int
    points: Tuple[Tuple[int, float], ...]

    def weight(self, length: int) -> float:
        """The cost of one row padded to ``length`` tokens, in rows of the nominal length."""
        pts = self.points
        if length == self.nominal:
            return 1.0  # exactly: the nominal-length traffic is served as if rows had no weight
        if length <= pts[0][0]:
            return pts[0][1]
        if len(pts) == 1:
            return pts[0][1] * length / pts[0][0]
        for (l0, w0), (l1, w1) in zip(pts, pts[1:]):
            if length <= l1:
                return w0 + (w1 - w0) * (length - l0) / (l1 - l0)
        (l0, w0), (l1, w1) = pts[-2], pts[-1]
        return w1 + (w1 - w0) * (length - l1) / (l1 - l0)

    def work(self, rows: int, length: int) -> float:
        """What ``rows`` rows padded to ``length`` tokens cost, in rows of the nominal length."""
        return rows * self.weight(length)

    def request_work(self, rows: int, shapes: Sequence[Sequence[int]]) -> float:
        """What a request of ``rows`` rows costs, its padded length read from its inputs' ``shapes``."""
        return self.work(rows, padded_length(shapes))


def linear_cost(nominal: int, floor: int = 8) -> LengthCost:
    """Cost proportional to the tokens, at least ``floor`` of them (no measurement at hand)."""
    floor = min(floor, nominal)
    return LengthCost(nominal, ((floor, floor / nominal), (nominal, 1.0)))


def fit_length_cost(nominal: int, ms_by_length: Mapping[int, float]) -> LengthCost:
    """The weights from one batch size's measured ms at several lengths (``nominal`` among them); weights
    never fall as the length grows (a noisy shorter measurement is taken at the longer one's weight)."""
    if nominal not in ms_by_length or ms_by_length[nominal] <= 0:
        raise ValueError(f"no positive measurement at the nominal length {nominal}: {dict(ms_by_length)}")
    base = ms_by_length[nominal]
    lengths = sorted(ms_by_length)
    weights = [max(ms_by_length[n], 1e-9) / base for n in lengths]
    for i in range(len(weights) - 2, -1, -1):  # monotone: a shorter row never costs more than a longer one
        weights[i] = min(weights[i], weights[i + 1])
    return LengthCost(nominal, tuple(zip(lengths, weights)))


def padded_length(shapes: Sequence[Sequence[int]]) -> int:
    """The padded token length of a request from its inputs' shapes (the second dim of the first input
    that has one; 1 when none has)."""
    for shape in shapes:
        if len(shape) >= 2:
            return max(int(shape[1]), 1)
    return 1
