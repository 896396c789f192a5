"""Serve an artifact directory: every budget loaded once, switched in O(1), chosen by a policy.

DESIGN.md §4::

    from elastic_export.runtime import ElasticRuntime
    rt = ElasticRuntime.from_dir(DIR)
    rt.run(feeds, sparsity=None)   # -> dict output name -> array, of the current (or given) budget
    rt.set_budget(s)               # switches

* **Budgets.** The dense model is sparsity ``0.0``; the manifest's budgets follow, sorted by
  sparsity. :meth:`ElasticRuntime.set_budget` takes an *exact* listed sparsity (compared after
  rounding to 6 decimals, so ``0.1`` from a JSON file matches ``0.1``); anything else is a
  :class:`UserError` naming the listed ones. No nearest-budget guessing: a caller that asks for 0.35
  must not silently get 0.3 or 0.4. Switching is O(1): a dict lookup and an assignment under a
  lock, no session is created (every session is created in :meth:`ElasticRuntime.from_dir`).
* **Outputs.** :meth:`ElasticRuntime.run` returns a ``dict`` output name -> ``numpy`` array, in
  the manifest's ``outputs`` order (``list(rt.run(f).values())`` is what ``session.run(None, f)``
  returns).
* **Modes.** ``per-budget`` (default) loads dense.onnx and every budget's ONNX: fastest per
  budget (each file is a plain dense graph of its own width), but memory grows with the number of
  budgets (weights once per budget: ~1 + Σ(1 - s) dense copies). ``elastic`` loads only
  ``elastic.onnx`` (weights once, bounded memory whatever the number of budgets) and selects the
  budget with its ``budget_index`` input; each run pays the graph's run-time ``Slice`` of the
  weights, so it is slower per call than the per-budget file, and it offers the elastic graph's
  budgets only (not the dense model, sparsity 0.0). :meth:`ElasticRuntime.memory_rss` reports the
  process's resident set for comparing the two.
* **Policies** (``rt.policy``; ``run`` without ``sparsity`` asks the policy, or uses the current
  budget when there is none):
  :class:`FixedPolicy` (one sparsity), :class:`LatencyTargetPolicy` (the lowest sparsity whose
  measured p90 latency at the request's batch size meets a target, from ``DIR/latency_profile.json``,
  see :func:`load_profile`), :class:`LoadAdaptivePolicy` (queue depth and/or arrival rate ->
  budget, with hysteresis; the server reports load with :meth:`ElasticRuntime.observe`).
* **Threads.** One lock guards the budget state (current budget, policy state); ``run`` takes it
  only to read which budget to use, so runs at different budgets proceed concurrently
  (onnxruntime's ``InferenceSession.run`` is thread-safe).
* **Backends.** ``onnxruntime`` (sessions from :mod:`elastic_export.targets.onnxruntime`,
  ``providers`` / ``config`` choose the provider) or ``tensorrt`` (the engines listed as each
  budget's ``engine`` in the manifest, run by :mod:`elastic_export.targets.tensorrt`, which must be
  importable and provide ``load_engine(path) -> object with run(feeds) -> list | dict``).

Imports neither torch nor anything that does (checked by a test): it runs on an edge box with
numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from elastic_export.errors import UserError
from elastic_export.manifest import MANIFEST, load_manifest, resolve
from elastic_export.targets.onnxruntime import PROVIDERS, Runner, SessionConfig, make_session, shared_initializers
from elastic_export.targets.profiles import Profile, compute_profile

PROFILE = "latency_profile.json"
MODES = ("per-budget", "elastic")
BACKENDS = ("onnxruntime", "tensorrt")
PRECISION_KEYS = {"fp32": "onnx", "fp16": "onnx_fp16", "int8": "onnx_int8"}  # precision -> manifest key
STATS = ("p50_ms", "p90_ms", "p99_ms")


def _key(s: float) -> float:
    return round(float(s), 6)


def _fmt(values: Iterable[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


# --- latency profile ----------------------------------------------------------------------------
@dataclass
class LatencyProfile:
    """Measured latency per batch size and sparsity (``DIR/latency_profile.json``).

    File form::

        {"backend": "onnxruntime", "provider": "cpu",
         "batches": {"1": {"0.0": {"p50_ms": 4.1, "p90_ms": 4.6, "p99_ms": 5.0}, "0.1": {...}}, "8": {...}}}

    Args:
        backend: the backend it was measured with.
        provider: the provider (``cpu``, ``cuda``, ``tensorrt``).
        batches: batch size -> sparsity -> {p50_ms, p90_ms, p99_ms}.
    """

    backend: str
    provider: str
    batches: dict[int, dict[float, dict[str, float]]]

    def batch_for(self, batch: int) -> int:
        """The profiled batch size used for a request of ``batch`` rows: the smallest profiled one
        that is >= ``batch`` (a conservative estimate), else the largest profiled one."""
        sizes = sorted(self.batches)
        return next((b for b in sizes if b >= batch), sizes[-1])

    def latency(self, batch: int, sparsity: float, stat: str = "p90_ms") -> float | None:
        """``stat`` in ms at (the profiled batch for) ``batch`` and ``sparsity``; None if not measured."""
        row = self.batches[self.batch_for(batch)].get(_key(sparsity))
        return None if row is None else row.get(stat)

    def to_json(self) -> dict:
        """The file form (keys as strings)."""
        return {"backend": self.backend, "provider": self.provider,
                "batches": {str(b): {f"{s:g}" if s else "0.0": dict(v) for s, v in sorted(rows.items())}
                            for b, rows in sorted(self.batches.items())}}


def load_profile(path: str | Path) -> LatencyProfile:
    """Read a latency profile.

    Args:
        path: the JSON file, or an artifact directory (reads ``DIR/latency_profile.json``).

    Raises:
        UserError: missing, unreadable or malformed (one line, naming the problem).
    """
    path = Path(path)
    if path.is_dir():
        path = path / PROFILE
    if not path.is_file():
        raise UserError(f"{path}: no latency profile; measure one first (elastic-export bench, or "
                        f"elastic_export.runtime.measure_profile)")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: unreadable latency profile ({e})")
    if not isinstance(raw, dict) or not isinstance(raw.get("batches"), dict) or not raw["batches"]:
        raise UserError(f"{path}: a latency profile needs a non-empty 'batches' object")
    batches: dict[int, dict[float, dict[str, float]]] = {}
    try:
        for b, rows in raw["batches"].items():
            if int(b) < 1 or not isinstance(rows, dict) or not rows:
                raise ValueError(f"batch {b!r}")
            batches[int(b)] = {}
            for s, stats in rows.items():
                if not isinstance(stats, dict):
                    raise ValueError(f"batch {b}, sparsity {s}")
                vals = {k: float(v) for k, v in stats.items() if k in STATS}
                if not vals:
                    raise ValueError(f"batch {b}, sparsity {s}: none of {', '.join(STATS)}")
                batches[int(b)][_key(float(s))] = vals
    except (TypeError, ValueError) as e:
        raise UserError(f"{path}: malformed latency profile ({e})")
    return LatencyProfile(str(raw.get("backend", "onnxruntime")), str(raw.get("provider", "cpu")), batches)


def save_profile(profile: LatencyProfile | dict, directory: str | Path) -> Path:
    """Write ``DIR/latency_profile.json`` atomically.

    Args:
        profile: a :class:`LatencyProfile` or its file form.
        directory: the artifact directory.
    """
    from elastic_export.fileio import atomic_write

    data = profile.to_json() if isinstance(profile, LatencyProfile) else profile
    path = Path(directory) / PROFILE
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2) + "\n"))
    return path


def measure_profile(rt: "ElasticRuntime", feeds_by_batch: Mapping[int, Mapping[str, np.ndarray]], repeats: int = 20,
                    warmup: int = 2) -> LatencyProfile:
    """Measure p50 / p90 / p99 latency of every budget of ``rt`` at every batch size.

    Args:
        rt: the runtime (its backend, provider and mode are what is measured).
        feeds_by_batch: batch size -> feeds with that many rows.
        repeats: timed runs per (batch, budget) (>= 1).
        warmup: untimed runs first.

    Returns:
        The profile (:func:`save_profile` writes it next to the artifacts).
    """
    if repeats < 1:
        raise UserError(f"repeats must be >= 1, got {repeats}")
    batches: dict[int, dict[float, dict[str, float]]] = {}
    for b, feeds in sorted(feeds_by_batch.items()):
        batches[int(b)] = {}
        for s in rt.sparsities:
            for _ in range(warmup):
                rt.run(feeds, sparsity=s)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                rt.run(feeds, sparsity=s)
                times.append((time.perf_counter() - t0) * 1e3)
            p50, p90, p99 = np.percentile(times, [50, 90, 99])
            batches[int(b)][s] = {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}
    return LatencyProfile(rt.backend, rt.provider, batches)


# --- policies -----------------------------------------------------------------------------------
class Policy:
    """Chooses the budget of a request. Subclasses override :meth:`select` (and :meth:`observe`)."""

    def bind(self, sparsities: Sequence[float]) -> None:
        """Called once by the runtime with its sparsities (ascending); check they fit."""

    def select(self, batch: int) -> float:
        """The sparsity for a request of ``batch`` rows."""
        raise NotImplementedError

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> None:
        """Load report from the server (ignored by policies that do not use it)."""


class FixedPolicy(Policy):
    """Always the same budget.

    Args:
        sparsity: one of the runtime's sparsities.
    """

    def __init__(self, sparsity: float) -> None:
        self.sparsity = _key(sparsity)

    def bind(self, sparsities: Sequence[float]) -> None:
        if self.sparsity not in sparsities:
            raise UserError(f"sparsity {self.sparsity:g} is not a listed budget; listed: {_fmt(sparsities)}")

    def select(self, batch: int) -> float:
        return self.sparsity


class LatencyTargetPolicy(Policy):
    """The lowest sparsity whose measured latency at the request's batch size meets a target.

    Args:
        profile: the measured profile (:func:`load_profile`).
        target_ms: the latency target in ms.
        stat: which percentile must meet it (``p90_ms`` default, ``p50_ms``, ``p99_ms``).

    A request whose batch size was not profiled uses the smallest profiled batch >= its own (else
    the largest profiled). When no budget meets the target the sparsest one is used (the best
    that can be done); :attr:`missed` counts those requests.
    """

    def __init__(self, profile: LatencyProfile, target_ms: float, stat: str = "p90_ms") -> None:
        if stat not in STATS:
            raise UserError(f"stat {stat!r}: choose from {', '.join(STATS)}")
        if not target_ms > 0:
            raise UserError(f"target_ms must be positive, got {target_ms}")
        self.profile, self.target_ms, self.stat = profile, float(target_ms), stat
        self.missed = 0
        self._choice: dict[int, float | None] = {}

    def bind(self, sparsities: Sequence[float]) -> None:
        for b in self.profile.batches:
            lacking = [s for s in sparsities if self.profile.latency(b, s, self.stat) is None]
            if lacking:
                raise UserError(f"latency profile, batch {b}: no {self.stat} for sparsity {_fmt(lacking)}; "
                                f"measure the profile again for these artifacts")
        self._choice = {}
        for b in self.profile.batches:
            ok = [s for s in sparsities if self.profile.latency(b, s, self.stat) <= self.target_ms]
            self._choice[b] = min(ok) if ok else None  # None: no budget meets the target
        self._sparsest = max(sparsities)

    def select(self, batch: int) -> float:
        s = self._choice[self.profile.batch_for(batch)]
        if s is None:
            self.missed += 1
            return self._sparsest
        return s


class LoadAdaptivePolicy(Policy):
    """Queue depth and/or arrival rate -> budget, with hysteresis so it does not flap.

    Going up (sparser): at once, by one level per observation while the queue holds ``up_depth``
    or more requests, and straight to the lowest level whose utilisation (``arrival_rate`` x
    service time) is at most ``high_utilization`` when rates and ``service_ms`` are given.
    Going down (denser): one level, only after ``down_after`` consecutive observations with the
    queue at most ``down_depth`` and (with rates) the denser level's utilisation at most
    ``low_utilization``. The gaps (``up_depth`` vs ``down_depth``, ``high`` vs ``low`` utilisation,
    the ``down_after`` dwell) are the hysteresis.

    Args:
        up_depth: queue depth that moves one level sparser.
        down_depth: queue depth at or below which the load counts as calm.
        down_after: calm observations in a row before one level denser.
        service_ms: sparsity -> mean service time in ms (e.g. a profile's p50 at batch 1); None:
            queue depth only.
        high_utilization: utilisation above which a level is too dense.
        low_utilization: utilisation the denser level must stay under to move down.
        levels: the sparsities to choose among (default: all of the runtime's).
    """

    def __init__(self, up_depth: int = 4, down_depth: int = 1, down_after: int = 16,
                 service_ms: Mapping[float, float] | None = None, high_utilization: float = 0.85,
                 low_utilization: float = 0.6, levels: Sequence[float] | None = None) -> None:
        if not (up_depth > down_depth >= 0) or down_after < 1:
            raise UserError("LoadAdaptivePolicy needs up_depth > down_depth >= 0 and down_after >= 1")
        if not (0 < low_utilization < high_utilization):
            raise UserError("LoadAdaptivePolicy needs 0 < low_utilization < high_utilization")
        self.up_depth, self.down_depth, self.down_after = up_depth, down_depth, down_after
        self.service_ms = {_key(k): float(v) for k, v in service_ms.items()} if service_ms else None
        self.high, self.low = high_utilization, low_utilization
        self.levels = sorted(_key(s) for s in levels) if levels else None
        self.level = 0
        self._calm = 0
        self.switches = 0

    def bind(self, sparsities: Sequence[float]) -> None:
        levels = self.levels or sorted(sparsities)
        bad = [s for s in levels if s not in sparsities]
        if bad:
            raise UserError(f"LoadAdaptivePolicy levels {_fmt(bad)} are not listed budgets; listed: {_fmt(sparsities)}")
        if self.service_ms is not None:
            lacking = [s for s in levels if s not in self.service_ms]
            if lacking:
                raise UserError(f"LoadAdaptivePolicy service_ms lacks sparsity {_fmt(lacking)}")
        self.levels, self.level, self._calm = levels, 0, 0

    def _utilization(self, level: int, rate: float | None) -> float | None:
        if rate is None or self.service_ms is None:
            return None
        return rate * self.service_ms[self.levels[level]] / 1e3

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> None:
        top = len(self.levels) - 1
        want = self.level
        if queue_depth >= self.up_depth:
            want = self.level + 1
        if self._utilization(self.level, arrival_rate) is not None:
            floor = next((i for i in range(top + 1) if self._utilization(i, arrival_rate) <= self.high), top)
            want = max(want, floor)
        want = min(want, top)
        if want > self.level:
            self.level, self._calm = want, 0
            self.switches += 1
            return
        u = self._utilization(self.level - 1, arrival_rate) if self.level > 0 else None
        calm = self.level > 0 and queue_depth <= self.down_depth and (u is None or u <= self.low)
        self._calm = self._calm + 1 if calm else 0
        if self._calm >= self.down_after:
            self.level, self._calm = self.level - 1, 0
            self.switches += 1

    def select(self, batch: int) -> float:
        return self.levels[self.level]


# --- the runtime --------------------------------------------------------------------------------
@dataclass
class _Budget:
    sparsity: float
    file: str  # relative to the directory
    run: Callable[[dict[str, np.ndarray]], Any]
    shared: tuple[str, ...] = ()  # initializers its session takes from the pool shared across files


class ElasticRuntime:
    """Every budget of an artifact directory, loaded once; see the module docstring.

    Build with :meth:`from_dir`.
    """

    def __init__(self, directory: Path, manifest: dict, budgets: list[_Budget], backend: str, provider: str,
                 mode: str, input_names: list[str], output_names: list[str]) -> None:
        self.directory, self.manifest = directory, manifest
        self.backend, self.provider, self.mode = backend, provider, mode
        self.input_names, self.output_names = input_names, output_names
        self._budgets = {b.sparsity: b for b in budgets}
        self.sparsities: list[float] = sorted(self._budgets)
        self._lock = threading.Lock()
        self._current = self.sparsities[0]
        self._policy: Policy | None = None

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, backend: str = "onnxruntime", providers: Sequence[str] | str | None = None,
                 config: SessionConfig | None = None, mode: str = "per-budget",
                 precision: str = "fp32") -> "ElasticRuntime":
        """Load every budget of an artifact directory once.

        Args:
            path: the artifact directory (with ``manifest.json``).
            backend: ``onnxruntime`` or ``tensorrt``.
            providers: onnxruntime provider, short (``cpu``, ``cuda``, ``tensorrt``) or full
                (``CUDAExecutionProvider``) name, or a list whose first entry is used; overrides
                ``config.provider``.
            config: session options (:class:`SessionConfig`; default CPU, onnxruntime's threads).
            mode: ``per-budget`` (dense.onnx + every budget's file) or ``elastic`` (elastic.onnx only).
            precision: ``fp32`` (the reference files), ``fp16`` (their fp16 twins, ``onnx_fp16`` in
                the manifest: for GPU providers) or ``int8`` (their int8 twins, ``onnx_int8``: for the
                CPU; per-budget mode only); onnxruntime backend only (engines carry their own).

        Raises:
            UserError: missing directory / manifest, unknown backend / mode, unavailable provider,
                no elastic graph in ``elastic`` mode, TensorRT target or engines missing.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"{directory}: no such artifact directory")
        if backend not in BACKENDS:
            raise UserError(f"backend {backend!r}: unknown; choose from {', '.join(BACKENDS)}")
        if mode not in MODES:
            raise UserError(f"mode {mode!r}: unknown; choose from {', '.join(MODES)}")
        if precision not in PRECISION_KEYS:
            raise UserError(f"precision {precision!r}: unknown; choose from {', '.join(PRECISION_KEYS)}")
        if precision != "fp32" and backend == "tensorrt":
            raise UserError(f"precision {precision} applies to the onnxruntime backend; TensorRT engines carry their own")
        if precision == "int8" and mode == "elastic":
            raise UserError("precision 'int8': the elastic graph has no int8 twin; use mode='per-budget'")
        manifest = load_manifest(directory)
        inputs = [v["name"] for v in manifest["inputs"]]
        outputs = [v["name"] for v in manifest["outputs"]]
        if backend == "tensorrt":
            budgets, provider = cls._tensorrt_budgets(directory, manifest, mode), "tensorrt"
        else:
            config = _config(providers, config)
            if config.provider == "tensorrt" and config.trt_profile is None:
                config = replace(config, trt_profile=tensorrt_ep_profile(manifest, elastic=mode == "elastic"))
            provider = config.provider
            key = PRECISION_KEYS[precision]
            budgets = (cls._elastic_budgets if mode == "elastic" else cls._ort_budgets)(
                directory, manifest, config, inputs, outputs, key)
        return cls(directory, manifest, budgets, backend, provider, mode, inputs, outputs)

    @staticmethod
    def _ort_budgets(directory: Path, manifest: dict, config: SessionConfig, inputs: list[str],
                     outputs: list[str], key: str = "onnx") -> list[_Budget]:
        entries = [(0.0, manifest["dense"].get(key))] + [(b.get("sparsity"), b.get(key)) for b in manifest["budgets"]]
        for s, rel in entries:
            if rel is None:
                raise UserError(f"{directory / MANIFEST}: budget {_sparsity(directory, s):g} lists no {key} file"
                                + (f" (precision {key[5:]!r}); export with --precision {key[5:]}"
                                   if key != "onnx" else ""))
        paths = [resolve(directory, rel) for _, rel in entries]
        shared: list[dict] = [{} for _ in paths]
        if config.share_weights and config.provider == "cpu" and all(p is not None and p.is_file() for p in paths):
            shared = shared_initializers(paths)  # weights identical across the files: held once
        out: dict[float, _Budget] = {}
        for (s, rel), path, init in zip(entries, paths, shared):
            s = _sparsity(directory, s)
            sess = make_session(path, config, initializers=init)
            out[s] = _Budget(s, rel, _ort_call(sess, config, None, outputs), tuple(sorted(init)))
        return list(out.values())

    @staticmethod
    def _elastic_budgets(directory: Path, manifest: dict, config: SessionConfig, inputs: list[str],
                         outputs: list[str], key: str = "onnx") -> list[_Budget]:
        e = manifest.get("elastic")
        if not e or not e.get("onnx"):
            raise UserError(f"{directory / MANIFEST}: no elastic graph (built with --no-elastic-graph?); "
                            f"use mode='per-budget'")
        if not e.get(key):
            raise UserError(f"{directory / MANIFEST}: the elastic graph has no {key} file; export with --precision fp16")
        sparsities = e.get("budgets") or [b.get("sparsity") for b in manifest["budgets"]]
        sess = make_session(resolve(directory, e[key]), config)
        name = e.get("budget_input", "budget_index")
        if name not in [i.name for i in sess.get_inputs()]:
            raise UserError(f"{directory / e[key]}: has no input {name!r}")
        out = []
        for i, s in enumerate(sparsities):
            index = np.array([i], dtype=np.int64)
            out.append(_Budget(_sparsity(directory, s), e[key], _ort_call(sess, config, (name, index), outputs)))
        return out

    @staticmethod
    def _tensorrt_budgets(directory: Path, manifest: dict, mode: str) -> list[_Budget]:
        if mode != "per-budget":
            raise UserError("backend 'tensorrt' runs one engine per budget; use mode='per-budget'")
        try:
            import importlib

            trt = importlib.import_module("elastic_export.targets.tensorrt")
        except ImportError as e:
            raise UserError(f"backend 'tensorrt' needs elastic_export.targets.tensorrt and TensorRT ({e}); "
                            f"use backend='onnxruntime'")
        load = getattr(trt, "load_engine", None)
        if load is None:
            raise UserError("elastic_export.targets.tensorrt has no load_engine(path); cannot run engines")
        why = getattr(trt, "tensorrt_unavailable", lambda: None)()
        if why:
            raise UserError(f"backend 'tensorrt': {why}; use backend='onnxruntime'")
        entries = [(0.0, manifest["dense"].get("engine"))] + [(b.get("sparsity"), b.get("engine"))
                                                               for b in manifest["budgets"]]
        if all(rel is None for _, rel in entries[1:]):
            raise UserError(f"{directory}: the manifest lists no TensorRT engines; "
                            f"run `elastic-export build --target tensorrt {directory}` first")
        out = []
        for s, rel in entries:
            if rel is None:
                if s == 0.0:
                    continue  # the dense model has no engine: offer the budgets only
                raise UserError(f"{directory / MANIFEST}: budget {s} lists no engine")
            engine = load(resolve(directory, rel))
            out.append(_Budget(_sparsity(directory, s), rel, _serialized(engine.run)))
        return out

    # budget state ----------------------------------------------------------------------------
    @property
    def budget(self) -> float:
        """The current sparsity (what ``run`` uses without a policy and without ``sparsity``)."""
        return self._current

    @property
    def policy(self) -> Policy | None:
        return self._policy

    def set_budget(self, sparsity: float) -> None:
        """Switch to a listed budget (O(1): no session is created) and drop any policy.

        Args:
            sparsity: exactly one of :attr:`sparsities` (0.0 is the dense model in per-budget mode).

        Raises:
            UserError: not a listed sparsity (the message lists them).
        """
        s = _key(sparsity)
        if s not in self._budgets:
            raise UserError(f"sparsity {sparsity!r} is not a listed budget; listed: {_fmt(self.sparsities)}")
        with self._lock:
            self._current = s
            self._policy = None

    def set_policy(self, policy: Policy | None) -> None:
        """Install a policy (None: back to the current budget).

        Args:
            policy: a :class:`Policy`; checked against :attr:`sparsities` now.
        """
        if policy is not None:
            policy.bind(self.sparsities)
        with self._lock:
            self._policy = policy

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> float:
        """Report the server's load to the policy; returns the sparsity a batch-1 request gets now.

        Args:
            queue_depth: requests waiting.
            arrival_rate: requests per second (None: unknown).
        """
        with self._lock:
            if self._policy is None:
                return self._current
            self._policy.observe(queue_depth, arrival_rate)
            self._current = self._policy.select(1)
            return self._current

    def choose(self, batch: int = 1) -> float:
        """The sparsity a request of ``batch`` rows gets now (policy, else the current budget)."""
        with self._lock:
            if self._policy is None:
                return self._current
            return self._policy.select(batch)

    # running ---------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], sparsity: float | None = None) -> dict[str, np.ndarray]:
        """Run one request.

        Args:
            feeds: input name -> array (the manifest's inputs; extra names are ignored).
            sparsity: a listed sparsity for this call only (the current budget is unchanged);
                None: the policy's choice, or the current budget.

        Returns:
            output name -> array, in the manifest's output order.

        Raises:
            UserError: unknown sparsity or a missing input.
        """
        return self.serve(feeds, sparsity)[1]

    def serve(self, feeds: Mapping[str, np.ndarray],
              sparsity: float | None = None) -> tuple[float, dict[str, np.ndarray]]:
        """:meth:`run`, and the sparsity of the budget that served the request (for logs and
        clients that want to know what they got while the budget switches under load)."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise UserError(f"missing input {missing[0]!r}; the model takes {', '.join(self.input_names)}")
        if sparsity is None:
            s = self.choose(_batch(feeds, self.input_names))
        else:
            s = _key(sparsity)
            if s not in self._budgets:
                raise UserError(f"sparsity {sparsity!r} is not a listed budget; listed: {_fmt(self.sparsities)}")
        got = self._budgets[s].run({n: feeds[n] for n in self.input_names})
        if isinstance(got, dict):
            return s, {n: got[n] for n in self.output_names}
        return s, dict(zip(self.output_names, got))

    def file(self, sparsity: float) -> str:
        """The file (relative to the directory) that serves ``sparsity``."""
        return self._budgets[_key(sparsity)].file

    # memory ----------------------------------------------------------------------------------
    def shared_weights(self) -> dict[float, tuple[str, ...]]:
        """Per sparsity, the initializers its session shares with the other sessions (one copy in
        memory for all; ``SessionConfig.share_weights``, per-budget mode on CPU). Empty where
        nothing is shared."""
        return {s: self._budgets[s].shared for s in self.sparsities}

    @staticmethod
    def memory_rss() -> int:
        """Resident set size of this process in bytes (Linux ``/proc/self/statm``; elsewhere the
        peak RSS from ``getrusage``). With the runtime loaded it includes every budget's weights
        and onnxruntime's arenas (plus whatever else the process holds)."""
        try:
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            import resource
            import sys

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return peak if sys.platform == "darwin" else peak * 1024


def measure_switch_cost(rt: ElasticRuntime, n: int = 20000) -> float:
    """Median cost in ms of one :meth:`ElasticRuntime.set_budget` (cycling through every budget).

    Args:
        rt: the runtime (its current budget is restored afterwards).
        n: switches timed.
    """
    prev, policy = rt.budget, rt.policy
    seq = [rt.sparsities[i % len(rt.sparsities)] for i in range(n)]
    times = np.empty(n)
    clock = time.perf_counter_ns
    for i, s in enumerate(seq):
        t0 = clock()
        rt.set_budget(s)
        times[i] = clock() - t0
    rt.set_budget(prev)
    if policy is not None:
        rt.set_policy(policy)
    return float(np.median(times)) / 1e6


# --- helpers ------------------------------------------------------------------------------------
def tensorrt_ep_profile(manifest: dict, elastic: bool = False, **ranges: int | None) -> Profile | None:
    """The shape range for onnxruntime's TensorRT EP, from the manifest (see
    :func:`elastic_export.targets.profiles.compute_profile`; default batch 1..128 tuned for 32, text
    1..N tokens tuned for N).

    Args:
        manifest: the loaded manifest.
        elastic: add the elastic graph's fixed ``budget_index`` input (shape ``[1]``).
        ranges: ``min_batch`` / ``opt_batch`` / ``max_batch`` / ``min_tokens`` / ``opt_tokens`` /
            ``max_tokens`` overrides.

    Returns:
        The profile, or None where the manifest cannot give one (the EP then picks its own ranges).
    """
    try:
        profile = compute_profile(manifest, **{k: v for k, v in ranges.items() if v is not None})
    except UserError:
        return None
    if elastic:
        profile = profile.with_input((manifest.get("elastic") or {}).get("budget_input", "budget_index"), (1,))
    return profile


def _config(providers: Sequence[str] | str | None, config: SessionConfig | None) -> SessionConfig:
    config = config or SessionConfig()
    if providers:
        first = providers if isinstance(providers, str) else providers[0]
        if isinstance(first, tuple):
            first = first[0]
        short = {v: k for k, v in PROVIDERS.items()}.get(first, first)
        config = replace(config, provider=short)
    return config


def _ort_call(sess, config: SessionConfig, extra: tuple[str, np.ndarray] | None,
              outputs: list[str]) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    """A thread-safe call of one session (a fresh IOBinding per call on GPU providers)."""
    have = [o.name for o in sess.get_outputs()]
    names = [o for o in outputs if o in have] if all(o in have for o in outputs) else have
    if not config.on_device:
        if extra is None:
            return lambda feeds: sess.run(names, feeds)
        key, value = extra
        return lambda feeds: sess.run(names, {**feeds, key: value})

    def call(feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        runner = Runner(sess, config, names)
        return runner.run(feeds if extra is None else {**feeds, extra[0]: extra[1]})

    return call


def _serialized(call: Callable[[dict[str, np.ndarray]], Any]) -> Callable[[dict[str, np.ndarray]], Any]:
    """``call`` behind its own lock: an engine runner owns one set of device buffers, so calls on
    the same budget take turns (calls on different budgets still run concurrently)."""
    lock = threading.Lock()

    def run(feeds: dict[str, np.ndarray]) -> Any:
        with lock:
            return call(feeds)

    return run


def _sparsity(directory: Path, s: Any) -> float:
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0.0 <= float(s) < 1.0:
        raise UserError(f"{directory / MANIFEST}: budget sparsity {s!r} is not a number in [0, 1)")
    return _key(s)


def _batch(feeds: Mapping[str, np.ndarray], names: list[str]) -> int:
    for n in names:
        shape = np.shape(feeds[n])
        if shape:
            return int(shape[0])
    return 1
