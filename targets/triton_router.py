"""Budget choice of the Triton router model: pure Python, no Triton, no numpy.

``elastic-export build --target triton`` copies this file's text verbatim into the router's
``model.py`` (Triton's Python backend loads that one file), so it imports only the standard library
and runs on the Python of any Triton container. The tests call these functions directly.

Rule: a requested sparsity within :data:`TOLERANCE` of a served budget gets that budget; otherwise
the smallest served budget whose sparsity is *at least* the requested one (more savings, never
less). A request outside [0, 1), not a number, or sparser than the sparsest served budget is
refused with :class:`BudgetError` (the router answers it with an error response). No request
(no ``sparsity`` input and no ``sparsity`` request parameter) gets the configured default.
"""

import json
import math
from typing import Any, Optional, Sequence

TOLERANCE = 1e-6
PARAMETER = "sparsity"


class BudgetError(ValueError):
    """A requested sparsity the router cannot serve (the message goes back to the client)."""


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise BudgetError(f"{where}: {value!r} is not a number")
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(s):
        raise BudgetError(f"{where}: {value!r} is not a finite number")
    return s


def choose_budget(requested: Optional[float], sparsities: Sequence[float], default: float) -> float:
    """The served budget for a requested sparsity.

    Args:
        requested: the sparsity asked for (fraction of prunable FLOPs removed), or None for the
            default.
        sparsities: the served budgets' sparsities (any order; 0.0 is the dense model).
        default: the budget served when nothing is requested (one of ``sparsities``).

    Returns:
        An element of ``sparsities``: the one within :data:`TOLERANCE` of ``requested``, else the
        smallest one above it.

    Raises:
        BudgetError: ``requested`` outside [0, 1) or above the sparsest served budget, or no budgets.
    """
    served = sorted(float(s) for s in sparsities)
    if not served:
        raise BudgetError("no budgets are served")
    if requested is None:
        return float(default)
    s = _number(requested, "sparsity")
    if not 0.0 <= s < 1.0:
        raise BudgetError(f"sparsity {s:g} is outside [0, 1); served budgets: {_listing(served)}")
    for b in served:
        if abs(b - s) <= TOLERANCE:
            return b
    for b in served:
        if b >= s:
            return b
    raise BudgetError(f"sparsity {s:g} is above the sparsest served budget {served[-1]:g}; "
                      f"served budgets: {_listing(served)}")


def requested_sparsity(values: Optional[Sequence[Any]], parameters: Optional[str]) -> Optional[float]:
    """The sparsity a request asks for: its ``sparsity`` input, else its ``sparsity`` parameter.

    Args:
        values: the flattened ``sparsity`` input tensor (one value per batch row), or None when the
            request has no such input. Every row must ask for the same sparsity.
        parameters: the request's parameters as a JSON object string (Triton's
            ``request.parameters()``), or None / empty.

    Returns:
        The requested sparsity, or None when the request names none (the router's default applies).

    Raises:
        BudgetError: rows that disagree, an empty input, or a value / parameter that is not a number.
    """
    if values is not None:
        rows = [_number(v, "sparsity input") for v in values]
        if not rows:
            raise BudgetError("sparsity input is empty")
        if any(abs(r - rows[0]) > TOLERANCE for r in rows[1:]):
            raise BudgetError("sparsity input: every row of one request must ask for the same sparsity "
                              f"(got {_listing(sorted(set(rows)))}); send one request per budget")
        return rows[0]
    if not parameters:
        return None
    try:
        params = json.loads(parameters)
    except ValueError:
        raise BudgetError("request parameters are not a JSON object") from None
    if not isinstance(params, dict) or params.get(PARAMETER) is None:
        return None
    return _number(params[PARAMETER], "sparsity parameter")


def _listing(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)
