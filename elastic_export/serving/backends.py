"""The runtime's backends by name, without importing them: ``backend=NAME`` / ``--backend NAME`` -> a :class:`Backend`.

A backend turns an artifact directory into runnable budgets: :class:`RunnableBudget` rows, each a thread-safe
``run(feeds) -> list | dict`` for one (sparsity, precision). :class:`elastic_export.serving.runtime.ElasticRuntime`
(``from_dir(DIR, backend=NAME)``), ``elastic-export bench --backend NAME`` and the command line's
``--backend`` help all read this registry; none of them names a backend.

Each entry names its class as ``"package.module:Class"``, imported on first use (:func:`get_backend`),
so the command line lists backends without importing them (no torch, no TensorRT). Registered here:

* ``onnxruntime``: onnxruntime sessions over the ONNX files (:mod:`elastic_export.targets.ort_backend`);
* ``tensorrt``: the TensorRT engines the manifest lists (:mod:`elastic_export.targets.trt_backend`).

Adding one: a module with a :class:`Backend` subclass and one line here (or :func:`register_backend`
from other code, e.g. ``register_backend("name", MyBackend, help=...)``).
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from elastic_export.core.errors import UserError

DEFAULT_BACKEND = "onnxruntime"
# What runs each budget model of a Triton repository (`build triton --budget-backend`, `serve`):
# "auto" takes TensorRT engines when the manifest lists them, else onnxruntime.
TRITON_BUDGET_BACKENDS = ("auto", "onnxruntime", "python", "tensorrt")
Feeds = dict[str, Any]  # input name -> numpy array


@dataclass
class RunnableBudget:
    """One runnable (sparsity, precision) of a directory.

    Args:
        sparsity: the budget's sparsity (0.0: the dense model).
        file: the file it runs, relative to the directory.
        run: ``run(feeds) -> list of arrays (manifest output order) | dict name -> array``; thread-safe.
        shared: initializers it takes from a pool shared across files (shown by ``shared_weights``).
        precision: its label (``fp32``, ``fp16``, ``int8``).
    """

    sparsity: float
    file: str
    run: Callable[[Feeds], Any]
    shared: tuple[str, ...] = ()
    precision: str = "fp32"

    @property
    def pair(self) -> tuple[float, str]:
        return self.sparsity, self.precision


class Loaded(NamedTuple):
    """What :meth:`Backend.load_budgets` returns: the budgets, and the provider name the runtime reports."""

    budgets: list[RunnableBudget]
    provider: str


class Backend(ABC):
    """How an artifact directory is run. One instance per runtime (it may hold what :meth:`close` frees).

    Attributes:
        name: its registry name (set by :func:`get_backend`).
        supports_precisions: it loads the fp16 / int8 twins too; False: one precision per budget,
            listed as ``fp32`` (:meth:`check_precisions` refuses the others).
    """

    name: str = ""
    supports_precisions: bool = True

    def check_available(self, config: Any = None, *, cli: bool = False) -> None:
        """Refuse (one-line :class:`UserError`) when this backend cannot run here; default: it can.

        Args:
            config: the runtime's ``config`` (``from_dir``), or the :class:`elastic_export.measure.bench.BenchConfig`.
            cli: word the message for the command line (``--backend`` / ``--provider``).
        """

    def check_precisions(self, precisions: Sequence[str], shown: str, *, cli: bool = False) -> None:
        """Refuse precisions this backend cannot load (``shown``: how the caller wrote them)."""
        if not self.supports_precisions and any(p != "fp32" for p in precisions):
            raise UserError(f"{'--' if cli else ''}precision {shown}: backend {self.name!r} runs one precision per "
                            f"budget, listed as fp32")

    @abstractmethod
    def load_budgets(self, directory: Path, manifest: dict, mode: str, keep: Callable[[float], bool],
                     precisions: list[str], config: Any = None, providers: Sequence[str] | str | None = None) -> Loaded:
        """Every kept budget of ``directory`` at ``precisions``, ready to run.

        Args:
            directory: the artifact directory.
            manifest: its loaded manifest.
            mode: ``per-budget`` or ``elastic`` (a backend without an elastic form may ignore it).
            keep: ``keep(sparsity)``: whether to load that budget (0.0: the dense model).
            precisions: the precisions to load (checked by :meth:`check_precisions`).
            config: the backend's own options (``from_dir``'s ``config``), or None.
            providers: ``from_dir``'s ``providers``, or None.
        """

    def unavailable(self) -> str | None:
        """Why this backend cannot run here (one line), or None when it can; default: it can."""
        return None

    def run_file(self, path: Path, feeds: Feeds, outputs: list[str]) -> list[Any]:
        """Run one file of its own kind (the manifest field it was registered with, ``artifact=``) once:
        ``outputs`` in order. ``verify`` checks those files through this.

        Raises:
            UserError: the file does not load or lacks an output.
        """
        raise NotImplementedError(f"backend {self.name!r} runs no files of its own")

    def bench_options(self, directory: Path, bench: Any) -> dict[str, Any]:
        """``ElasticRuntime.from_dir`` keyword arguments for ``bench`` (a :class:`elastic_export.measure.bench.BenchConfig`)."""
        return {"precisions": bench.precisions() or "all"} if self.supports_precisions else {}

    def close(self) -> None:
        """Free what :meth:`load_budgets` holds beyond Python objects (device buffers); default: nothing."""


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    Args:
        name: its ``backend=`` / ``--backend`` name.
        target: ``"package.module:Class"`` (imported on first use), or the class / a factory itself.
        help: what it runs, for the command line's help (``the ONNX files``).
        artifact: the manifest field (in ``dense`` and per budget) naming files this backend builds
            and runs itself (``engine``); None: it runs the ONNX files. ``verify`` checks each such
            file with :meth:`Backend.run_file`.
    """

    name: str
    target: str | Callable[[], Backend]
    help: str = ""
    artifact: str | None = None

    def load(self) -> Backend:
        """A new instance (imports its module the first time)."""
        factory = self.target
        if isinstance(factory, str):
            module, _, cls = factory.partition(":")
            factory = getattr(importlib.import_module(module), cls)
        backend = factory()
        backend.name = self.name
        return backend


REGISTRY: dict[str, BackendEntry] = {}


def register_backend(name: str, target: str | Callable[[], Backend], *, help: str = "",
                     artifact: str | None = None) -> BackendEntry:
    """Add (or replace) the backend ``name``; returns its entry (see :class:`BackendEntry`)."""
    if isinstance(target, str) and (":" not in target or not all(target.partition(":")[::2])):
        raise ValueError(f"backend {name!r}: target {target!r} is not 'package.module:Class'")
    REGISTRY[name] = BackendEntry(name, target, help, artifact)
    return REGISTRY[name]


def artifact_backends() -> list[BackendEntry]:
    """The backends that run files of their own kind (``artifact=``), in registration order."""
    return [e for e in REGISTRY.values() if e.artifact]


def backend_names() -> tuple[str, ...]:
    """The registered backend names, in registration order."""
    return tuple(REGISTRY)


def get_backend(name: str) -> Backend:
    """A new instance of the backend ``name``.

    Raises:
        UserError: no such backend (the message lists the registered ones).
    """
    if name not in REGISTRY:
        raise UserError(f"backend {name!r}: unknown; choose from {', '.join(backend_names())}")
    return REGISTRY[name].load()


def backend_help() -> str:
    """``a (what it runs), b (...) or c (...)``: the command line's ``--backend`` help."""
    parts = [f"{e.name} ({e.help})" if e.help else e.name for e in REGISTRY.values()]
    return " or ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts)


# --- helpers for backends ---------------------------------------------------------------------
def manifest_sparsity(directory: Path, s: Any) -> float:
    """A budget's sparsity from the manifest, rounded like every runtime key; UserError unless a number in [0, 1)."""
    from elastic_export.core.latency_profile import key
    from elastic_export.core.manifest import MANIFEST

    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0:
        raise UserError(f"{directory / MANIFEST}: budget sparsity {s!r} is not a number in [0, 1)")
    return key(s)


def serialized(call: Callable[[Feeds], Any]) -> Callable[[Feeds], Any]:
    """``call`` behind its own lock: for runners that own one set of device buffers, so calls on the
    same budget take turns (calls on different budgets still run concurrently)."""
    lock = threading.Lock()

    def run(feeds: Feeds) -> Any:
        with lock:
            return call(feeds)

    return run


register_backend("onnxruntime", "elastic_export.targets.ort_backend:OrtBackend", help="the ONNX files")
register_backend("tensorrt", "elastic_export.targets.trt_backend:TrtBackend",
                 help="the manifest's engines; see `build --target tensorrt`", artifact="engine")
