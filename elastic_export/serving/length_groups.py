"""One padded batch run as a few batches of similar length: fewer padded tokens for the same rows.

Merged queries pad to the longest of them: 16 short queries of 5-30 tokens carry about 40 % padding,
which a transformer computes like real tokens. :func:`length_groups` sorts the rows by length and cuts
them where that saves the most padded tokens (halves, then halves of those), each group at least
:data:`MIN_ROWS` rows (a small batch runs each row dearer) and each cut saving at least
:data:`MIN_SAVING` of the part's padded tokens; :func:`run_grouped` runs each group trimmed to its own
longest row and puts the rows back in order. Only for outputs of one vector per row (a pooled
embedding): a token axis would differ in width per group. Standard library and numpy only (the router
imports it from its copy next to ``model.py``).
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Set

import numpy as np

MIN_ROWS = 8  # rows in a group: smaller batches cost more per row than their padding saves (measured)
MIN_SAVING = 0.15  # a cut must save this share of its part's padded tokens
MASK = "attention_mask"


def row_outputs(model_config: Mapping[str, Any]) -> Set[str]:
    """The outputs of a Triton model config (its JSON) that hold one vector per row, no token axis: ``dims`` of
    one axis, beside the batch dim where the config has no ``max_batch_size`` (its dims then hold it)."""
    batch_dim = 0 if int(model_config.get("max_batch_size") or 0) > 0 else 1
    return {t["name"] for t in model_config.get("output", []) if len(t.get("dims", [])) == 1 + batch_dim}


def padded_tokens(lengths: Sequence[int]) -> int:
    return len(lengths) * max(lengths) if len(lengths) else 0


def length_groups(lengths: Sequence[int], min_rows: int = MIN_ROWS, min_saving: float = MIN_SAVING) -> List[List[int]]:
    """Row indices in groups of similar length (module docstring): one group (every row, in order) when no
    cut saves enough; else groups of rows sorted by length."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups = _cut([int(lengths[i]) for i in order], min_rows, min_saving)
    if len(groups) == 1:
        return [list(range(len(lengths)))]
    out, start = [], 0
    for size in groups:
        out.append(order[start:start + size])
        start += size
    return out


def _cut(sorted_lengths: List[int], min_rows: int, min_saving: float) -> List[int]:
    """Group sizes of ascending ``sorted_lengths``: the best cut in two, each part cut again the same way."""
    n = len(sorted_lengths)
    whole = n * sorted_lengths[-1] if n else 0
    best, at = whole, None
    for i in range(min_rows, n - min_rows + 1):
        cost = i * sorted_lengths[i - 1] + (n - i) * sorted_lengths[-1]
        if cost < best:
            best, at = cost, i
    if at is None or whole - best < min_saving * whole:
        return [n]
    return _cut(sorted_lengths[:at], min_rows, min_saving) + _cut(sorted_lengths[at:], min_rows, min_saving)


def run_grouped(run: Callable[[List[str], Dict[str, np.ndarray]], Sequence[np.ndarray]], names: List[str],
                feeds: Mapping[str, np.ndarray], pooled: Optional[Collection[str]] = None, mask: str = MASK,
                **cut) -> List[np.ndarray]:
    """``run(names, feeds)`` for a padded batch, as :func:`length_groups` groups of its rows, each trimmed to
    its longest row (by ``feeds[mask]``), the outputs (one row each) back in the rows' order. It runs whole
    when ``names`` asks for an output not in ``pooled`` (None: every output is one row each; see
    :func:`row_outputs`) or the feeds have no mask."""
    if mask not in feeds or (pooled is not None and not set(names) <= set(pooled)):
        return list(run(names, dict(feeds)))
    lengths = np.asarray(feeds[mask]).sum(axis=1)
    groups = length_groups(lengths.tolist(), **cut)
    if len(groups) == 1:
        return list(run(names, dict(feeds)))
    width = feeds[mask].shape[1]
    outs: List[np.ndarray] = []
    for g in groups:
        rows, w = np.asarray(g), int(lengths[g].max())
        part = {k: (v[rows][:, :w] if v.ndim == 2 and v.shape[1] == width else v[rows]) for k, v in feeds.items()}
        got = run(names, part)
        if not outs:
            outs = [np.empty((len(lengths),) + a.shape[1:], dtype=a.dtype) for a in got]
        for o, a in zip(outs, got):
            o[rows] = a
    return outs
