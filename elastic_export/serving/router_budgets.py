"""The one rule for matching a requested sparsity to a served budget, and the router's request parameters.

Rule (:func:`choose_budget`): a requested sparsity within :data:`TOLERANCE` of a served budget gets that
budget; otherwise the smallest served budget whose sparsity is *at least* the requested one (more
savings, never less). A request outside [0, 1), not a number, or sparser than the sparsest served budget
is refused with :class:`BudgetError`, one line naming the value and the served budgets. The router
(:mod:`elastic_export.targets.triton_router`), its configured default (:mod:`elastic_export.serving.
router_config`), the builder's ``--triton-default-sparsity`` and the search model's early check all call
it, so a budget means the same everywhere a request can name one.

Standard library only: the builder copies this file next to the router's ``model.py``
(:data:`elastic_export.targets.triton_router.SERVING_MODULES`), where a Triton Python backend without
this package imports it.
"""

import json
import math
from typing import Any, List, Optional, Sequence

TOLERANCE = 1e-6  # a requested sparsity this close to a served one is that one
PARAMETER = "sparsity"  # request parameter: the sparsity every row asks for
QUEUED_PARAMETER = "queued_ms"  # request parameter: the ms its oldest row waited before it was sent


class BudgetError(ValueError):
    """A request the router cannot serve (the message goes back to the client: HTTP 400)."""


class Overload(Exception):
    """A request refused because it cannot be answered within the SLO, or no budget model is up (HTTP 503 /
    gRPC UNAVAILABLE: retryable); ``reason`` labels the refusal in the metrics."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def number(value: Any, where: str) -> float:
    """``value`` as a finite float; :class:`BudgetError` naming ``where`` otherwise (booleans included)."""
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
    s = number(requested, "sparsity")
    if not 0.0 <= s < 1.0:
        raise BudgetError(f"sparsity {s:g} is outside [0, 1); served budgets: {listing(served)}")
    for b in served:
        if abs(b - s) <= TOLERANCE:
            return b
    for b in served:
        if b >= s:
            return b
    raise BudgetError(f"sparsity {s:g} is above the sparsest served budget {served[-1]:g}; "
                      f"served budgets: {listing(served)}")


def row_sparsities(values: Optional[Sequence[Any]], parameters: Optional[str], batch: int) -> Optional[List[float]]:
    """The sparsity each row asks for: the ``sparsity`` input, else the ``sparsity`` parameter.

    Args:
        values: the flattened ``sparsity`` input (one value for every row, or one per row), or None
            when the request has no such input.
        parameters: the request's parameters as a JSON object string (``request.parameters()``).
        batch: the request's batch size.

    Returns:
        One sparsity per row, or None when the request names none (the policy / default applies).

    Raises:
        BudgetError: an input of another length, or a value / parameter that is not a number.
    """
    if values is not None:
        rows = [number(v, "sparsity input") for v in values]
        if len(rows) == 1:
            return rows * batch
        if len(rows) != batch:
            raise BudgetError(f"sparsity input has {len(rows)} values for a batch of {batch}; send shape [1, 1] "
                              f"(one budget for every row) or [{batch}, 1] (one per row)")
        return rows
    if not parameters:
        return None
    try:
        params = json.loads(parameters)
    except ValueError:
        raise BudgetError("request parameters are not a JSON object") from None
    if not isinstance(params, dict) or params.get(PARAMETER) is None:
        return None
    return [number(params[PARAMETER], "sparsity parameter")] * batch


def queued_ms(parameters: Optional[str]) -> float:
    """How long the request's oldest row waited before it was sent (ms; the API's ``queued_ms`` parameter,
    :mod:`elastic_export.serving.coalesce`); 0 when absent or not a non-negative number."""
    if not parameters or QUEUED_PARAMETER not in parameters:
        return 0.0
    try:
        value = float(json.loads(parameters).get(QUEUED_PARAMETER))
    except (ValueError, TypeError, AttributeError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def listing(values: Sequence[float]) -> str:
    """``0, 0.25, 0.5``: budgets as a message names them."""
    return ", ".join(f"{v:g}" for v in values)
