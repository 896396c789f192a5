"""The ``tensorrt`` backend: the TensorRT engines an artifact directory's manifest lists.

Each budget's ``engine`` (and the dense model's, where built; without it the budgets only) is
loaded with :func:`elastic_export.targets.tensorrt.load_engine`; the engines carry their own
precision and are listed under the label ``fp32``. TensorRT is imported only when this backend
checks or loads (never by the registry or the command line's option parsing). Per-budget mode only.
Registered as ``tensorrt`` in :mod:`elastic_export.serving.backends`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Sequence

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import MANIFEST, Manifest
from elastic_export.serving.backends import Backend, Loaded, RunnableBudget, manifest_sparsity, serialized

MODULE = "elastic_export.targets.tensorrt"


class TrtBackend(Backend):
    """Serialized TensorRT engines, one runner per budget (freed by :meth:`close`)."""

    supports_precisions = False

    def __init__(self) -> None:
        self._runners: list[Any] = []

    def check_available(self, config: Any = None, *, cli: bool = False) -> None:
        """Refuse (one line) when TensorRT cannot run engines here."""
        self._load_engine(cli)

    def check_precisions(self, precisions: Sequence[str], shown: str, *, cli: bool = False) -> None:
        if any(p != "fp32" for p in precisions):
            where = "--backend onnxruntime" if cli else "the onnxruntime backend"
            raise UserError(f"{'--' if cli else ''}precision {shown} applies to {where}; TensorRT engines carry their own")

    def _load_engine(self, cli: bool = False) -> Callable[[Path], Any]:
        """``load_engine`` of the TensorRT target, once it and TensorRT are known to work here."""
        try:
            trt = importlib.import_module(MODULE)
        except ImportError as e:
            raise UserError(f"--backend tensorrt: {MODULE} cannot be imported ({e})" if cli else
                            f"backend 'tensorrt' needs {MODULE} and TensorRT ({e}); use backend='onnxruntime'")
        load = getattr(trt, "load_engine", None)
        if load is None:
            raise UserError(f"{MODULE} has no load_engine(path); cannot run engines")
        why = getattr(trt, "tensorrt_unavailable", lambda: None)()
        if why:
            raise UserError(f"--backend tensorrt: {why}; {trt.INSTALL_HINT}" if cli else
                            f"backend 'tensorrt': {why}; use backend='onnxruntime'")
        return load

    def unavailable(self) -> str | None:
        """Why engines cannot run here (TensorRT or a CUDA GPU missing), or None; no torch needed."""
        try:
            return importlib.import_module(MODULE).tensorrt_unavailable()
        except ImportError as e:
            return f"{MODULE} cannot be imported ({e})"

    def run_file(self, path: Path, feeds: dict[str, Any], outputs: list[str]) -> list[Any]:
        """Run a serialized engine once (its device buffers and stream freed after)."""
        with importlib.import_module(MODULE).load_engine(path) as runner:
            missing = [o for o in outputs if o not in runner.outputs]
            if missing:
                raise UserError(f"engine has no output {missing[0]!r}")
            return list(runner.run(feeds, outputs))

    def load_budgets(self, directory: Path, manifest: Manifest, mode: str, keep: Callable[[float], bool],
                     precisions: list[str], config: Any = None, providers: Sequence[str] | str | None = None) -> Loaded:
        if mode != "per-budget":
            raise UserError("backend 'tensorrt' runs one engine per budget; use mode='per-budget'")
        load = self._load_engine()
        entries = [(0.0, manifest.dense.engine)] + [(b.sparsity, b.engine) for b in manifest.budgets]
        if all(rel is None for _, rel in entries[1:]):
            raise UserError(f"{directory}: the manifest lists no TensorRT engines; "
                            f"run `elastic-export build --target tensorrt {directory}` first")
        out = []
        for s, rel in entries:
            if rel is None:
                if s == 0.0:
                    continue  # the dense model has no engine: offer the budgets only
                raise UserError(f"{directory / MANIFEST}: budget {s} lists no engine")
            if keep(manifest_sparsity(directory, s)):
                engine = load(manifest.path(rel))
                self._runners.append(engine)
                out.append(RunnableBudget(manifest_sparsity(directory, s), rel, serialized(engine.run)))
        return Loaded(out, "tensorrt")

    def close(self) -> None:
        """Free every loaded engine's device buffers."""
        while self._runners:
            runner = self._runners.pop()
            if hasattr(runner, "close"):
                runner.close()
