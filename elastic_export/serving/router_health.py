"""Budget models' health: which ones are down (routed around), how a failure reads, and readiness at load.

* :func:`classify_failure`: a budget model's error message as ``overload`` (its queue refused or timed
  out the request: the router answers 503), ``down`` (the model or its stub is gone: route around it) or
  ``failed``.
* :class:`BudgetHealth`: the budgets down since when, and the nearest one up for a budget that is down.
* :func:`wait_ready`: the router's load waits for its budget models (injected ``sleep`` and ``clock``), so
  it is never READY in front of one that is not.
* :func:`probe_feeds`: the one-row request the prober (and the calibration) sends a budget model.

Standard library and numpy only: copied next to the router's ``model.py``, as
:mod:`~elastic_export.serving.router_budgets`.
"""

import time
from typing import Any, Callable, Dict, Sequence

import numpy as np

try:
    from elastic_export.serving.router_budgets import Overload
except ImportError:  # a copy next to the router's model.py, in a Python without this package
    from router_budgets import Overload

_DOWN_MARKERS = ("not healthy", "unknown model", "not found", "not ready", "is not available", "unavailable")
_OVERLOAD_MARKERS = ("timeout", "timed out", "exceeds maximum queue size", "queue size")


def classify_failure(message: str) -> str:
    """A budget model's error: ``overload`` (its queue policy refused or timed out the request), ``down``
    (the model or its stub is gone: route around it) or ``failed``."""
    text = message.lower()
    if any(m in text for m in _OVERLOAD_MARKERS):
        return "overload"
    if any(m in text for m in _DOWN_MARKERS):
        return "down"
    return "failed"


class BudgetHealth:
    """Which budget models are down (they failed as gone), and the nearest one up for a budget."""

    def __init__(self, sparsities: Sequence[float]):
        self.sparsities = sorted(sparsities)
        self.down: Dict[float, float] = {}  # sparsity -> when it went down

    def mark_down(self, budget: float, now: float) -> bool:
        """True when it was up."""
        if budget in self.down:
            return False
        self.down[budget] = now
        return True

    def mark_up(self, budget: float) -> bool:
        return self.down.pop(budget, None) is not None

    def nearest(self, budget: float) -> float:
        """``budget`` when it is up, else the nearest one up (ties: the sparser, more savings); raises
        :class:`Overload` when none is."""
        if budget not in self.down:
            return budget
        up = [s for s in self.sparsities if s not in self.down]
        if not up:
            raise Overload("no budget model is available; retry later", "unavailable")
        return min(up, key=lambda s: (abs(s - budget), -s))


def probe_feeds(specs: Sequence[Dict[str, Any]], tokens: int = 4) -> Dict[str, np.ndarray]:
    """One row of zeros for every model input (``specs``: the router config's inputs; free dims ``tokens``)."""
    feeds = {}
    for spec in specs:
        dims = [int(d) for d in spec.get("dims", [])]
        shape = [1] + [d if d > 0 else tokens for d in dims[1:]] if dims else [1]
        feeds[spec["name"]] = np.zeros(shape, dtype=_NUMPY_TYPES.get(spec.get("data_type", ""), np.float32))
    return feeds


_NUMPY_TYPES = {"TYPE_INT64": np.int64, "TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_FP16": np.float16,
                "TYPE_BOOL": np.bool_, "TYPE_UINT8": np.uint8, "TYPE_INT8": np.int8, "TYPE_FP64": np.float64}


def wait_ready(models: Sequence[str], timeout_s: float, is_ready: Callable[[str], bool],
               sleep: Callable[[float], Any] = time.sleep, clock: Callable[[], float] = time.monotonic) -> bool:
    """Wait until every model in ``models`` is ready.

    Returns:
        True once they are; False when the server cannot tell yet (it answers "Server not ready"
        while it is still loading its startup models: then Triton's own strict readiness and
        ``--exit-on-error`` stand guard, and ``elastic-export serve`` loads the router last).

    Raises:
        RuntimeError: naming the models not ready after ``timeout_s`` (the router then fails to
            load: it is never READY in front of a budget model that is not).
    """
    deadline = clock() + timeout_s
    while True:
        try:
            missing = [m for m in models if not is_ready(m)]
        except Exception as e:  # the server is still starting: it cannot answer for any model
            if "not ready" in str(e).lower():
                return False
            raise
        if not missing:
            return True
        if clock() >= deadline:
            raise RuntimeError(f"budget models not ready after {timeout_s:g} s: {', '.join(missing)}")
        sleep(0.2)
