"""Ranking options without torch: the optimised ranking's hyperparameters.

The command line builds its options from here and from :mod:`elastic_export.ranking.methods` (the method
names), so ``elastic-export --help`` and the stages that never rank (``verify``, ``bench``,
``report``, ``build``) start without importing torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

DEFAULT_TARGETS = tuple(round(0.05 * i, 2) for i in range(1, 15))  # 0.05 .. 0.70, 14 targets
TARGET_STEP = 0.05  # the default targets' step; the step that extends a single target
_EPS = 1e-9


def cover_budgets(targets: Iterable[float], budgets: Iterable[float]) -> tuple[float, ...]:
    """``targets`` extended to cover the largest of ``budgets``: more targets at the step between
    the last two (:data:`TARGET_STEP` for a single target), up to and including the largest
    budget; ``targets`` unchanged when they reach it already."""
    ts, top = tuple(targets), max(budgets, default=0.0)
    if not ts or max(ts) >= top - _EPS:
        return ts
    last = max(ts)
    below = sorted(t for t in ts if t < last)
    step = round(last - below[-1], 6) if below else TARGET_STEP
    count = math.floor((top - last) / step + _EPS)
    extra = [round(last + i * step, 6) for i in range(1, count + 1)]
    return ts + tuple(t for t in extra if t < top - _EPS) + (round(top, 6),)


def targets_spec(targets: Iterable[float]) -> str:
    """``targets`` as ``--targets`` reads them: ``A..B:STEP`` when evenly spaced (3 or more), else a comma list."""
    ts = sorted(targets)
    gaps = {round(b - a, 6) for a, b in zip(ts, ts[1:])}
    if len(ts) >= 3 and len(gaps) == 1:
        return f"{ts[0]:g}..{ts[-1]:g}:{gaps.pop():g}"
    return ",".join(f"{t:g}" for t in ts)


#: the schedule that ranks budgets past the default targets (steps, targets per step, lr): on a small ViT at
#: 90 % only it held the longer ranking's k-NN (docs/results.md, benchmarks/vit_ranking.py)
DEEP_SCHEDULE = {"steps": 64, "targets_per_step": 4, "lr": 0.02}


@dataclass
class ElasticConfig:
    """Hyperparameters of the optimised ranking.

    Args:
        targets: sparsity targets optimised jointly.
        steps: gradient steps.
        lr: Adam learning rate on the (standardised) scores.
        temperature: soft-mask temperature T, in units of the scores' initial standard deviation.
        targets_per_step: targets evaluated per step (a rotating subset; all of them if >= len(targets)).
        checkpoint_every: steps between checkpoints (0: none).
        seed: batch order.
        loss: ``auto`` (cross-entropy with the calibration labels for a classifier with labelled
            data, else KL to the dense logits for classifiers, else cosine of the pooled
            embedding), ``cosine``, ``kl`` or ``ce``.
        token_weight: weight of an extra token-level term (1 - cosine of ``last_hidden_state``
            per real token); 0 disables it.
        relational_weight: weight of the similarity-structure term (embedding losses): KL between
            the softmax similarities of the pruned and of the dense embedding to the dense
            embeddings of all calibration samples (the "dense index"), at
            ``relational_temperature``. It keeps what retrieval against a dense index needs: each
            embedding's ranking of the others, not only its direction. 0 disables it.
        init: the ranking method whose scores start the optimisation (``fisher``: squared mask
            gradients, a second-order estimate of the loss increase when a unit is removed;
            ``initial``: removal damage).
        fisher_projections: random projections of each batch's embedding whose squared gradients
            make the ``fisher`` initial scores (one backward pass each).
        compute: the model's forward (and backward) passes while ranking: ``fp32``; ``bf16`` (autocast:
            matrix products in bfloat16, about twice as fast on CPUs with AVX-512 BF16 or AMX and on
            GPUs; scores, masks and losses stay fp32); ``auto``: bf16 where the device has native
            bf16 products, else fp32 (the ranking file records which ran).
        keep_schedule: never :meth:`deepened` (the command line sets it when ``--steps``,
            ``--targets-per-step`` or ``--lr`` is given).
    """

    targets: tuple[float, ...] = DEFAULT_TARGETS
    steps: int = 40
    lr: float = 0.032
    temperature: float = 0.1
    targets_per_step: int = 2
    checkpoint_every: int = 8
    seed: int = 0
    loss: str = "auto"
    token_weight: float = 0.0
    relational_weight: float = 4.0
    relational_temperature: float = 0.05
    init: str = "fisher"
    fisher_projections: int = 2
    compute: str = "auto"
    keep_schedule: bool = False

    def deepened(self, extended: bool) -> "ElasticConfig":
        """This config with :data:`DEEP_SCHEDULE` when its targets were ``extended`` past the default ones and
        its steps, targets per step and lr are the defaults; unchanged otherwise (a schedule given is kept:
        ``keep_schedule`` or other values).
        The 40 x 2 default holds the 64 x 4 ranking's quality up to 0.7; past it, on a ViT at 0.9, only the
        64 x 4 schedule held (40 x 4, 52 x 2, 64 x 2 and lr 0.02 alone did not)."""
        plain = ElasticConfig()
        if not extended or self.keep_schedule or any(getattr(self, k) != getattr(plain, k) for k in DEEP_SCHEDULE):
            return self
        return replace(self, **DEEP_SCHEDULE)
