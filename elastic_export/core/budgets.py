"""Parse ``--budgets``: ``0.1..0.6`` (step 0.1), ``0.1..0.6:0.05`` and ``0.1,0.25,0.5``."""

from __future__ import annotations

import math
import re

from elastic_export.core.errors import UserError

_NUM = r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*"
_RANGE = re.compile(rf"^{_NUM}\.\.{_NUM}(?::{_NUM})?$")


def _number(text: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"bad --budgets {spec!r}: {text!r} is not a number (use e.g. 0.1..0.6 or 0.1,0.25,0.5)")
    if not math.isfinite(value):
        raise UserError(f"bad --budgets {spec!r}: {text!r} is not a finite number")
    return value


def parse_budgets(spec: str) -> list[float]:
    """Turn a budget spec into a sorted list of sparsities in [0, 1).

    Args:
        spec: ``A..B`` (step 0.1), ``A..B:STEP`` or a comma list ``a,b,c``. Each value is the
            fraction of prunable FLOPs removed; 0 means dense.

    Returns:
        Sparsities, ascending, rounded to 6 decimals.

    Raises:
        UserError: empty, malformed, duplicate or out-of-range values.
    """
    if spec is None or not str(spec).strip():
        raise UserError("empty --budgets: give sparsities like 0.1..0.6, 0.1..0.6:0.05 or 0.1,0.25,0.5")
    spec = str(spec).strip()
    m = _RANGE.match(spec)
    if m:
        lo, hi = _number(m.group(1), spec), _number(m.group(2), spec)
        step = _number(m.group(3), spec) if m.group(3) is not None else 0.1
        if step < 1e-3:
            raise UserError(f"bad --budgets {spec!r}: the step must be at least 0.001")
        if hi < lo:
            raise UserError(f"bad --budgets {spec!r}: the range end {hi} is below its start {lo}")
        for v in (lo, hi):
            if not 0.0 <= v < 1.0:
                raise UserError(
                    f"bad --budgets {spec!r}: sparsity must be in [0, 1) (fraction of prunable FLOPs removed), got {v}"
                )
        count = int(math.floor((hi - lo) / step + 1e-9)) + 1
        if count > 1000:
            raise UserError(f"bad --budgets {spec!r}: {count} budgets is too many (at most 1000)")
        values = [round(lo + i * step, 6) for i in range(count)]
    elif ".." in spec:
        raise UserError(f"bad --budgets {spec!r}: a range reads A..B or A..B:STEP, e.g. 0.1..0.6:0.05")
    else:
        parts = [p for p in spec.split(",")]
        if any(not p.strip() for p in parts):
            raise UserError(f"bad --budgets {spec!r}: empty item in the list")
        values = [round(_number(p.strip(), spec), 6) for p in parts]
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise UserError(f"bad --budgets {spec!r}: duplicate value(s) {', '.join(map(str, dupes))}")
    bad = [v for v in values if not 0.0 <= v < 1.0]
    if bad:
        raise UserError(
            f"bad --budgets {spec!r}: sparsity must be in [0, 1) (fraction of prunable FLOPs removed), got {bad[0]}"
        )
    return sorted(values)


def budget_tag(sparsity: float) -> str:
    """File-name tag of a budget, e.g. 0.25 -> ``s025``, 0.125 -> ``s0125``."""
    digits = f"{sparsity:.6f}".rstrip("0").split(".")[1] if sparsity else ""
    return "s0" + digits.ljust(2, "0") if digits else "s000"
