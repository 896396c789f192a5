"""Serve an artifact directory: every (budget, precision) loaded once, switched in O(1), chosen by a policy.

DESIGN.md §4::

    from elastic_export.runtime import ElasticRuntime
    rt = ElasticRuntime.from_dir(DIR)
    rt.run(feeds, sparsity=None)   # -> dict output name -> array, of the current (or given) budget
    rt.set_budget(s)               # switches

* **Budgets and precisions.** The dense model is sparsity ``0.0``; the manifest's budgets follow,
  sorted by sparsity. Each is loaded at one or more precisions (``fp32``, the reference files;
  ``fp16`` and ``int8``, their twins where the directory has them): ``from_dir(...,
  precisions=("fp32", "int8"))`` loads both, ``sparsities=(0.0, 0.3)`` only those budgets.
  A served unit is a **pair** (sparsity, precision); :attr:`ElasticRuntime.pairs` lists them.
  :meth:`ElasticRuntime.set_budget` takes an *exact* listed sparsity (compared after rounding to
  6 decimals, so ``0.1`` from a JSON file matches ``0.1``) and optionally a loaded precision
  (default: the current one); anything else is a :class:`UserError` naming the listed ones. No
  nearest-budget guessing: a caller that asks for 0.35 must not silently get 0.3 or 0.4.
  Switching is O(1): a dict lookup and an assignment under a lock, no session is created (every
  session is created in :meth:`ElasticRuntime.from_dir`).
* **Outputs.** :meth:`ElasticRuntime.run` returns a ``dict`` output name -> ``numpy`` array, in
  the manifest's ``outputs`` order (``list(rt.run(f).values())`` is what ``session.run(None, f)``
  returns).
* **Modes.** ``per-budget`` (default) loads dense.onnx and every budget's ONNX (per precision):
  fastest per budget (each file is a plain dense graph of its own width), but memory grows with
  the number of files (weights once per file, less what byte-identical initializers share:
  ``SessionConfig.share_weights``). ``elastic`` loads only ``elastic.onnx`` (and
  ``elastic.fp16.onnx`` for fp16; there is no int8 elastic graph): weights once, bounded memory
  whatever the number of budgets; the budget is selected with its ``budget_index`` input, and
  each run pays the graph's run-time ``Slice`` of the weights, so it is slower per call than the
  per-budget file. The elastic graph serves the dense model too where the manifest lists its
  ``dense_index`` (directories written before that offer the budgets only).
  :meth:`ElasticRuntime.memory_rss` reports the process's resident set for comparing them.
* **Policies** (:mod:`elastic_export.policies`, re-exported here; ``rt.policy``; ``run`` without
  ``sparsity`` asks the policy, or uses the current pair when there is none):
  :class:`FixedPolicy`, :class:`LatencyTargetPolicy` (the highest-quality pair whose measured p90
  at the request's batch size meets a target, from ``DIR/latency_profile.json``:
  :mod:`elastic_export.latency_profile`), :class:`LoadAdaptivePolicy` (queue depth and/or
  arrival rate -> level, with hysteresis; the server reports load with :meth:`ElasticRuntime.observe`).
* **Threads.** One lock guards the budget state (current pair, policy state); ``run`` takes it
  only to read which pair to use, so runs at different pairs proceed concurrently
  (onnxruntime's ``InferenceSession.run`` is thread-safe).
* **Backends.** ``onnxruntime`` (sessions from :mod:`elastic_export.targets.onnxruntime`,
  ``providers`` / ``config`` choose the provider) or ``tensorrt`` (the engines listed as each
  budget's ``engine`` in the manifest, run by :mod:`elastic_export.targets.tensorrt`, which must be
  importable and provide ``load_engine(path) -> object with run(feeds) -> list | dict``; the
  engines carry their own precision and are listed under the label ``fp32``).

Imports neither torch nor anything that does (checked by a test): it runs on an edge box with
numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from elastic_export.errors import UserError
from elastic_export.latency_profile import (  # noqa: F401 - re-exported: the runtime's public names
    PRECISION_ORDER,
    PROFILE,
    STATS,
    LatencyProfile,
    Pair,
    fmt,
    fmt_pair,
    key,
    load_profile,
    measure_profile,
    save_profile,
)
from elastic_export.manifest import MANIFEST, elastic_indices, load_manifest, resolve
from elastic_export.policies import (  # noqa: F401 - re-exported
    FixedPolicy,
    LatencyTargetPolicy,
    LoadAdaptivePolicy,
    Policy,
    frontier,
    quality_order,
)
from elastic_export.precision import FILE_KEYS
from elastic_export.targets.onnxruntime import PROVIDERS, Runner, SessionConfig, make_session, shared_initializers
from elastic_export.targets.profiles import Profile, compute_profile

MODES = ("per-budget", "elastic")
BACKENDS = ("onnxruntime", "tensorrt")
PRECISION_KEYS = FILE_KEYS  # precision -> manifest key
_key, _fmt = key, fmt  # the names this module used before the split


@dataclass
class _Budget:
    sparsity: float
    file: str  # relative to the directory
    run: Callable[[dict[str, np.ndarray]], Any]
    shared: tuple[str, ...] = ()  # initializers its session takes from the pool shared across files
    precision: str = "fp32"

    @property
    def pair(self) -> Pair:
        return self.sparsity, self.precision


class ElasticRuntime:
    """Every (budget, precision) pair of an artifact directory, loaded once; see the module docstring.

    Build with :meth:`from_dir`.
    """

    def __init__(self, directory: Path, manifest: dict, budgets: list[_Budget], backend: str, provider: str,
                 mode: str, input_names: list[str], output_names: list[str], precision: str = "fp32") -> None:
        self.directory, self.manifest = directory, manifest
        self.backend, self.provider, self.mode = backend, provider, mode
        self.input_names, self.output_names = input_names, output_names
        self._budgets: dict[Pair, _Budget] = {b.pair: b for b in budgets}
        self.pairs: list[Pair] = sorted(self._budgets, key=lambda p: (p[0], PRECISION_ORDER.index(p[1])))
        self.sparsities: list[float] = sorted({s for s, _ in self.pairs})
        self.precisions: list[str] = [p for p in PRECISION_KEYS if any(q == p for _, q in self.pairs)]
        self._lock = threading.Lock()
        precision = precision if precision in self.precisions else self.precisions[0]
        self._current: Pair = next(p for p in self.pairs if p[1] == precision)
        self._policy: Policy | None = None

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, backend: str = "onnxruntime", providers: Sequence[str] | str | None = None,
                 config: SessionConfig | None = None, mode: str = "per-budget", precision: str | None = None,
                 precisions: Sequence[str] | str | None = None,
                 sparsities: Sequence[float] | None = None) -> "ElasticRuntime":
        """Load the budgets of an artifact directory once, at one or more precisions.

        Args:
            path: the artifact directory (with ``manifest.json``).
            backend: ``onnxruntime`` or ``tensorrt``.
            providers: onnxruntime provider, short (``cpu``, ``cuda``, ``tensorrt``) or full
                (``CUDAExecutionProvider``) name, or a list whose first entry is used; overrides
                ``config.provider``.
            config: session options (:class:`SessionConfig`; default CPU, onnxruntime's threads).
            mode: ``per-budget`` (dense.onnx + every budget's file) or ``elastic`` (elastic.onnx only).
            precision: the current precision after loading (default: the first loaded one). Alone
                (no ``precisions``) it is the one precision loaded, as before: ``fp32`` (the
                reference files), ``fp16`` (their fp16 twins, ``onnx_fp16`` in the manifest: for
                GPU providers) or ``int8`` (their int8 twins, ``onnx_int8``: for the CPU;
                per-budget mode only).
            precisions: the precisions to load (every pair is then switchable in O(1)); ``"all"``:
                every precision the manifest lists (in elastic mode: those the elastic graph has).
                onnxruntime backend only for anything but fp32 (engines carry their own).
            sparsities: load only these budgets (exact listed sparsities, 0.0 = dense); None: all.

        Raises:
            UserError: missing directory / manifest, unknown backend / mode / precision /
                sparsity, unavailable provider, no elastic graph in ``elastic`` mode, a precision
                the directory lacks, TensorRT target or engines missing.
        """
        directory = Path(path)
        if not directory.is_dir():
            raise UserError(f"{directory}: no such artifact directory")
        if backend not in BACKENDS:
            raise UserError(f"backend {backend!r}: unknown; choose from {', '.join(BACKENDS)}")
        if mode not in MODES:
            raise UserError(f"mode {mode!r}: unknown; choose from {', '.join(MODES)}")
        manifest = load_manifest(directory)
        wanted = _precisions(manifest, mode, precision, precisions)
        if wanted != ["fp32"] and backend == "tensorrt":
            raise UserError(f"precision {', '.join(wanted)} applies to the onnxruntime backend; "
                            f"TensorRT engines carry their own")
        inputs = [v["name"] for v in manifest["inputs"]]
        outputs = [v["name"] for v in manifest["outputs"]]
        keep = _sparsity_filter(directory, manifest, sparsities)
        if backend == "tensorrt":
            budgets, provider = cls._tensorrt_budgets(directory, manifest, mode, keep), "tensorrt"
        else:
            config = _config(providers, config)
            if config.provider == "tensorrt" and config.trt_profile is None:
                config = replace(config, trt_profile=tensorrt_ep_profile(manifest, elastic=mode == "elastic"))
            provider = config.provider
            load = cls._elastic_budgets if mode == "elastic" else cls._ort_budgets
            budgets = load(directory, manifest, config, outputs, wanted, keep)
        if not budgets:
            raise UserError(f"{directory}: none of sparsities {_fmt(sparsities or [])} is served in mode {mode!r}")
        return cls(directory, manifest, budgets, backend, provider, mode, inputs, outputs,
                   precision=precision or wanted[0])

    @staticmethod
    def _ort_budgets(directory: Path, manifest: dict, config: SessionConfig, outputs: list[str],
                     precisions: list[str], keep: Callable[[float], bool]) -> list[_Budget]:
        entries = []  # (sparsity, precision, file)
        for prec in precisions:
            k = PRECISION_KEYS[prec]
            for s, rel in [(0.0, manifest["dense"].get(k))] + [(b.get("sparsity"), b.get(k)) for b in manifest["budgets"]]:
                s = _sparsity(directory, s)
                if not keep(s):
                    continue
                if rel is None:
                    raise UserError(f"{directory / MANIFEST}: budget {s:g} lists no {k} file"
                                    + (f" (precision {prec!r}); export with --precision {prec}" if prec != "fp32" else ""))
                entries.append((s, prec, rel))
        paths = [resolve(directory, rel) for _, _, rel in entries]
        shared: list[dict] = [{} for _ in paths]
        if config.share_weights and config.provider == "cpu" and all(p is not None and p.is_file() for p in paths):
            shared = shared_initializers(paths)  # weights identical across the files (any precision): held once
        out = []
        for (s, prec, rel), path, init in zip(entries, paths, shared):
            sess = make_session(path, config, initializers=init)
            out.append(_Budget(s, rel, _ort_call(sess, config, None, outputs), tuple(sorted(init)), prec))
        return out

    @staticmethod
    def _elastic_budgets(directory: Path, manifest: dict, config: SessionConfig, outputs: list[str],
                         precisions: list[str], keep: Callable[[float], bool]) -> list[_Budget]:
        e = manifest.get("elastic")
        if not e or not e.get("onnx"):
            raise UserError(f"{directory / MANIFEST}: no elastic graph (built with --no-elastic-graph?); "
                            f"use mode='per-budget'")
        indices = [(_sparsity(directory, s), i) for s, i in elastic_indices(e, [b.get("sparsity") for b in manifest["budgets"]])]
        name = e.get("budget_input", "budget_index")
        out = []
        for prec in precisions:
            k = PRECISION_KEYS[prec]
            if not e.get(k):
                raise UserError(f"{directory / MANIFEST}: the elastic graph has no {k} file; export with --precision {prec}")
            sess = make_session(resolve(directory, e[k]), config)
            if name not in [i.name for i in sess.get_inputs()]:
                raise UserError(f"{directory / e[k]}: has no input {name!r}")
            for s, i in indices:
                if keep(s):
                    call = _ort_call(sess, config, (name, np.array([i], dtype=np.int64)), outputs)
                    out.append(_Budget(s, e[k], call, (), prec))
        return out

    @staticmethod
    def _tensorrt_budgets(directory: Path, manifest: dict, mode: str, keep: Callable[[float], bool]) -> list[_Budget]:
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
            if keep(_sparsity(directory, s)):
                engine = load(resolve(directory, rel))
                out.append(_Budget(_sparsity(directory, s), rel, _serialized(engine.run)))
        return out

    # budget state ----------------------------------------------------------------------------
    @property
    def budget(self) -> float:
        """The current sparsity (what ``run`` uses without a policy and without ``sparsity``)."""
        return self._current[0]

    @property
    def precision(self) -> str:
        """The current precision."""
        return self._current[1]

    @property
    def pair(self) -> Pair:
        """The current (sparsity, precision)."""
        return self._current

    @property
    def policy(self) -> Policy | None:
        return self._policy

    def _resolve(self, sparsity: float | None, precision: str | None) -> Pair:
        """The loaded pair for ``sparsity`` (None: the current one) at ``precision`` (None: the
        current one); UserError (one line, naming what is loaded) otherwise."""
        cur_s, cur_p = self._current
        s = cur_s if sparsity is None else _key(sparsity)
        p = cur_p if precision is None else precision
        if (s, p) in self._budgets:
            return s, p
        if p not in self.precisions:
            raise UserError(f"precision {p!r} is not loaded; loaded: {', '.join(self.precisions)} "
                            f"(load it with ElasticRuntime.from_dir(..., precisions=...))")
        listed = [x for x, q in self.pairs if q == p]
        raise UserError(f"sparsity {sparsity!r} is not a listed budget" + (f" at {p}" if len(self.precisions) > 1 else "")
                        + f"; listed: {_fmt(listed)}")

    def set_budget(self, sparsity: float, precision: str | None = None) -> None:
        """Switch to a loaded pair (O(1): no session is created) and drop any policy.

        Args:
            sparsity: exactly one of :attr:`sparsities` (0.0 is the dense model).
            precision: one of :attr:`precisions` (None: keep the current precision).

        Raises:
            UserError: not a listed sparsity, or a precision not loaded (the message lists them).
        """
        pair = self._resolve(sparsity, precision)
        with self._lock:
            self._current = pair
            self._policy = None

    def set_policy(self, policy: Policy | None) -> None:
        """Install a policy (None: back to the current pair).

        Args:
            policy: a :class:`Policy`; checked against :attr:`pairs` now.
        """
        if policy is not None:
            policy.bind_pairs(list(self.pairs), self._current[1])
        with self._lock:
            self._policy = policy

    def _select(self, batch: int) -> Pair:
        """The policy's pair (a bare sparsity means the current precision); the lock is held."""
        got = self._policy.select(batch)
        return (_key(got[0]), got[1]) if isinstance(got, tuple) else (_key(got), self._current[1])

    def observe(self, queue_depth: int, arrival_rate: float | None = None) -> float:
        """Report the server's load to the policy; returns the sparsity a batch-1 request gets now
        (:attr:`pair` has its precision too).

        Args:
            queue_depth: requests waiting.
            arrival_rate: requests per second (None: unknown).
        """
        with self._lock:
            if self._policy is None:
                return self._current[0]
            self._policy.observe(queue_depth, arrival_rate)
            self._current = self._select(1)
            return self._current[0]

    def choose_pair(self, batch: int = 1) -> Pair:
        """The (sparsity, precision) a request of ``batch`` rows gets now (policy, else the current pair)."""
        with self._lock:
            return self._current if self._policy is None else self._select(batch)

    def choose(self, batch: int = 1) -> float:
        """The sparsity a request of ``batch`` rows gets now (:meth:`choose_pair` for the precision too)."""
        return self.choose_pair(batch)[0]

    # running ---------------------------------------------------------------------------------
    def run(self, feeds: Mapping[str, np.ndarray], sparsity: float | None = None,
            precision: str | None = None) -> dict[str, np.ndarray]:
        """Run one request.

        Args:
            feeds: input name -> array (the manifest's inputs; extra names are ignored).
            sparsity: a listed sparsity for this call only (the current pair is unchanged);
                None with ``precision`` None: the policy's choice, or the current pair.
            precision: a loaded precision for this call only (None: the current one).

        Returns:
            output name -> array, in the manifest's output order.

        Raises:
            UserError: unknown sparsity, a precision not loaded, or a missing input.
        """
        return self.serve_pair(feeds, sparsity, precision)[1]

    def serve(self, feeds: Mapping[str, np.ndarray], sparsity: float | None = None,
              precision: str | None = None) -> tuple[float, dict[str, np.ndarray]]:
        """:meth:`run`, and the sparsity of the budget that served the request (for logs and
        clients that want to know what they got while the budget switches under load)."""
        (s, _), out = self.serve_pair(feeds, sparsity, precision)
        return s, out

    def serve_pair(self, feeds: Mapping[str, np.ndarray], sparsity: float | None = None,
                   precision: str | None = None) -> tuple[Pair, dict[str, np.ndarray]]:
        """:meth:`run`, and the (sparsity, precision) that served the request."""
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise UserError(f"missing input {missing[0]!r}; the model takes {', '.join(self.input_names)}")
        if sparsity is None and precision is None:
            pair = self.choose_pair(_batch(feeds, self.input_names))
        else:
            pair = self._resolve(sparsity, precision)
        got = self._budgets[pair].run({n: feeds[n] for n in self.input_names})
        if isinstance(got, dict):
            return pair, {n: got[n] for n in self.output_names}
        return pair, dict(zip(self.output_names, got))

    def file(self, sparsity: float, precision: str | None = None) -> str:
        """The file (relative to the directory) that serves ``sparsity`` (at ``precision``, default
        the current one)."""
        return self._budgets[self._resolve(sparsity, precision)].file

    # memory ----------------------------------------------------------------------------------
    def shared_weights(self, precision: str | None = None) -> dict[float, tuple[str, ...]]:
        """Per sparsity (at ``precision``, default the current one), the initializers its session
        shares with the other sessions (one copy in memory for all; ``SessionConfig.share_weights``,
        per-budget mode on CPU). Empty where nothing is shared."""
        p = precision or self._current[1]
        return {s: b.shared for (s, q), b in self._budgets.items() if q == p}

    @staticmethod
    def memory_rss() -> int:
        """Resident set size of this process in bytes (Linux ``/proc/self/statm``; elsewhere the
        peak RSS from ``getrusage``). With the runtime loaded it includes every pair's weights
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
    """Median cost in ms of one :meth:`ElasticRuntime.set_budget` (cycling through every loaded pair).

    Args:
        rt: the runtime (its current pair is restored afterwards).
        n: switches timed.
    """
    prev, policy = rt.pair, rt.policy
    seq = [rt.pairs[i % len(rt.pairs)] for i in range(n)]
    times = np.empty(n)
    clock = time.perf_counter_ns
    for i, (s, p) in enumerate(seq):
        t0 = clock()
        rt.set_budget(s, p)
        times[i] = clock() - t0
    rt.set_budget(*prev)
    if policy is not None:
        rt.set_policy(policy)
    return float(np.median(times)) / 1e6


# --- helpers ------------------------------------------------------------------------------------
def _precisions(manifest: dict, mode: str, precision: str | None, precisions: Sequence[str] | str | None) -> list[str]:
    """The precisions to load, in :data:`PRECISION_KEYS` order; UserError for unknown ones."""
    if precisions == "all":
        have = manifest.get("precisions") or ["fp32"]
        if mode == "elastic":
            have = ["fp32"] + (["fp16"] if (manifest.get("elastic") or {}).get("onnx_fp16") else [])
        precisions = have
    elif isinstance(precisions, str):
        precisions = [p.strip() for p in precisions.split(",")]
    asked = list(precisions) if precisions else [precision or "fp32"]
    for p in asked + ([precision] if precision else []):
        if p not in PRECISION_KEYS:
            raise UserError(f"precision {p!r}: unknown; choose from {', '.join(PRECISION_KEYS)}")
    if precision and precision not in asked:
        raise UserError(f"precision {precision!r} is not among precisions {', '.join(asked)}")
    int8 = [p for p in asked if p.startswith("int8")]
    if int8 and mode == "elastic":
        raise UserError(f"precision {int8[0]!r}: the elastic graph has no int8 twin; use mode='per-budget'")
    return [p for p in PRECISION_KEYS if p in asked]


def _sparsity_filter(directory: Path, manifest: dict, sparsities: Sequence[float] | None) -> Callable[[float], bool]:
    """``keep(s)``: whether sparsity ``s`` is to be loaded; UserError for a sparsity the manifest
    does not list."""
    if sparsities is None:
        return lambda s: True
    listed = [0.0] + [_sparsity(directory, b.get("sparsity")) for b in manifest["budgets"]]
    wanted = {_key(s) for s in sparsities}
    bad = sorted(wanted - set(listed))
    if bad or not wanted:
        raise UserError(f"sparsities {_fmt(bad) or '(none)'}: not listed budgets; listed: {_fmt(listed)}")
    return lambda s: s in wanted


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
