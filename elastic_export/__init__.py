"""elastic-export: one ranking of every MLP neuron and attention head, sliced into one model per budget.

The public face names the few entry points; each is imported on first use, so ``import elastic_export``
stays light (no torch):

* :func:`export` / :class:`Options`: the main job (rank, slice, check, write an artifact directory);
* :func:`load_encoder`: a model by name (the embedded default, a folder, a hub id, a timm name);
* :func:`verify`: every artifact of a directory re-checked;
* :func:`evaluate`: retrieval / k-NN quality of directories;
* :class:`ElasticRuntime`: serve a directory's budgets and switch between them;
* :class:`Manifest`: a directory's manifest, typed;
* :class:`UserError`: the one error type for bad input (one line, exit code 2 on the command line).

Stages live in subpackages, bottom to top: ``core``, ``models``, ``data``, ``ranking``, ``export``
(with ``passes``), ``serving``, ``checks``, ``precision``, ``measure``, ``targets``, ``report``,
then :mod:`elastic_export.pipeline` and :mod:`elastic_export.cli`.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

from elastic_export.core.errors import UserError  # noqa: E402

_FACE = {
    "export": ("elastic_export.pipeline", "run"),
    "Options": ("elastic_export.pipeline", "Options"),
    "load_encoder": ("elastic_export.models.loader", "load_encoder"),
    "verify": ("elastic_export.checks.verify", "verify_dir"),
    "evaluate": ("elastic_export.measure.evaluation", "evaluate"),
    "ElasticRuntime": ("elastic_export.serving.runtime", "ElasticRuntime"),
    "Manifest": ("elastic_export.core.manifest", "Manifest"),
}
__all__ = ["UserError", "__version__", *_FACE]


def __getattr__(name: str) -> Any:
    if name not in _FACE:
        raise AttributeError(f"module 'elastic_export' has no attribute {name!r}")
    module, attr = _FACE[name]
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FACE))
