"""The ranking methods by name, without importing them (no torch): ``--method NAME`` -> its scoring function.

Each entry names its function as ``"package.module:function"``, imported on first use (:func:`load`),
so the command line lists and checks method names (``elastic-export --help``) without importing torch.
:data:`elastic_export.ranking.scoring.METHODS` is a view of this registry that loads on lookup.

A scoring function takes ``(encoder, inventory, calibration, **options)`` and returns per-layer head
and neuron scores (higher = keep longer), divided by each unit's FLOP cost (:mod:`elastic_export.ranking.scoring`).
Options it does not use it ignores; the elastic ranking passes every starting method ``seed``, ``observe``
(``(batch_index, outputs, feeds)``: a method that runs the dense model over the calibration batches hands
it each batch's outputs, sparing the ranking its own dense pass) and ``projections`` (fisher's).
Adding one: a line here (or :func:`register` / ``@scoring.register_method`` from other code).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from elastic_export.core.errors import UserError

ScoringFn = Callable[..., Any]


@dataclass(frozen=True)
class Method:
    """One ranking method.

    Args:
        name: its ``--method`` name.
        target: ``"package.module:function"`` (imported on first use), or the function itself.
        needs_data: it reads calibration batches (``magnitude`` and ``random`` do not).
    """

    name: str
    target: str | ScoringFn
    needs_data: bool = True

    def load(self) -> ScoringFn:
        """The scoring function (imports its module the first time)."""
        if callable(self.target):
            return self.target
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module), function)


REGISTRY: dict[str, Method] = {}


def register(name: str, target: str | ScoringFn, *, needs_data: bool = True) -> Method:
    """Add (or replace) the method ``name``; returns its entry."""
    if isinstance(target, str) and (":" not in target or not all(target.partition(":")[::2])):
        raise ValueError(f"method {name!r}: target {target!r} is not 'package.module:function'")
    REGISTRY[name] = Method(name, target, needs_data)
    return REGISTRY[name]


def names() -> tuple[str, ...]:
    """The registered method names, sorted."""
    return tuple(sorted(REGISTRY))


def get(name: str) -> Method:
    """The entry of ``name``.

    Raises:
        UserError: no such method (the message lists the registered ones).
    """
    if name not in REGISTRY:
        raise UserError(f"--method {name}: unknown; choose from {', '.join(names())}")
    return REGISTRY[name]


def load(name: str) -> ScoringFn:
    """The scoring function of ``name`` (see :func:`get`)."""
    return get(name).load()


register("activation", "elastic_export.ranking.scoring:activation_magnitude")
register("elastic", "elastic_export.ranking.soft_ranking:elastic_ranking")
register("fisher", "elastic_export.ranking.scoring:fisher_information")
register("initial", "elastic_export.ranking.scoring:removal_damage")
register("magnitude", "elastic_export.ranking.scoring:weight_magnitude", needs_data=False)
register("random", "elastic_export.ranking.scoring:random_scores", needs_data=False)
register("variance", "elastic_export.ranking.scoring:activation_variance")
