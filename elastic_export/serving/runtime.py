"""Serve an artifact directory: every (budget, precision) loaded once, switched in O(1), chosen by a policy.

DESIGN.md §4::

    from elastic_export.serving.runtime import ElasticRuntime
    rt = ElasticRuntime.from_dir(DIR)
    rt.run(feeds, sparsity=None)   # -> dict output name -> array, of the current (or given) budget
    rt.set_budget(s)               # switches

* **Budgets and precisions.** The dense model is sparsity ``0.0``; the manifest's budgets follow,
  sorted by sparsity. Each is loaded at one or more precisions (``fp32``, the reference files;
  ``fp16`` and ``int8``, their twins where the directory has them): ``from_dir(...,
  precisions=("fp32", "int8"))`` loads both, ``sparsities=(0.0, 0.3)`` only those budgets.
  A served unit is a **pair** (sparsity, precision); :attr:`ElasticRuntime.pairs` lists them.
  A requested sparsity (:meth:`ElasticRuntime.set_budget`, ``run(..., sparsity=)``) is matched to the
  loaded ones at the precision asked for (default: the current one) by the served router's one rule
  (:func:`elastic_export.serving.router_budgets.choose_budget`, through :func:`match_budget`): within
  1e-6 of a loaded sparsity gets it (``0.1`` from a JSON file is ``0.1``), otherwise the smallest
  loaded sparsity at least as sparse (more savings, never less: 0.35 with 0.3 and 0.4 loaded is
  0.4, as the router serves it; :meth:`ElasticRuntime.serve` says which answered). Outside [0, 1),
  not a number, or sparser than the sparsest loaded one: a one-line :class:`UserError` naming them.
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
* **Policies** (:mod:`elastic_export.serving.policies`, re-exported here; ``rt.policy``; ``run`` without
  ``sparsity`` asks the policy, or uses the current pair when there is none):
  :class:`FixedPolicy`, :class:`LatencyTargetPolicy` (the highest-quality pair whose measured p90
  at the request's batch size meets a target, from ``DIR/latency_profile.json``:
  :mod:`elastic_export.core.latency_profile`), :class:`LoadAdaptivePolicy` (queue depth and/or
  arrival rate -> level, with hysteresis; the server reports load with :meth:`ElasticRuntime.observe`),
  :class:`SloAdaptivePolicy` (the served router's ``--policy adaptive``: its SLO policy, fed every
  request served here as an arrival). By name: :func:`make_policy` (``fixed``, ``latency``, ``load``,
  ``adaptive``).
* **Threads.** One lock guards the budget state (current pair, policy state); ``run`` takes it
  only to read which pair to use, so runs at different pairs proceed concurrently
  (onnxruntime's ``InferenceSession.run`` is thread-safe).
* **Backends** come from the registry in :mod:`elastic_export.serving.backends` (``backend=NAME``; this
  module names none): ``onnxruntime`` (sessions from :mod:`elastic_export.targets.ort_backend`,
  ``providers`` / ``config`` choose the provider) or ``tensorrt`` (the engines listed as each
  budget's ``engine`` in the manifest, :mod:`elastic_export.targets.trt_backend`, run by
  :mod:`elastic_export.targets.tensorrt`; the engines carry their own precision and are listed
  under the label ``fp32``). :meth:`ElasticRuntime.close` frees what the backend holds (engine
  device buffers).

Imports neither torch nor anything that does (checked by a test): it runs on an edge box with
numpy, onnx and onnxruntime only.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.latency_profile import (  # noqa: F401 - re-exported: the runtime's public names
    PRECISION_ORDER,
    PROFILE,
    STATS,
    LatencyProfile,
    Pair,
    fmt,
    fmt_pair,
    key,
    load_profile,
    save_profile,
)
from elastic_export.core.manifest import Manifest
from elastic_export.core.precisions import FILE_KEYS
from elastic_export.serving.backends import DEFAULT_BACKEND, Backend, RunnableBudget, get_backend, manifest_sparsity
from elastic_export.serving.policies import (  # noqa: F401 - re-exported
    POLICIES,
    FixedPolicy,
    LatencyTargetPolicy,
    LoadAdaptivePolicy,
    Policy,
    SloAdaptivePolicy,
    frontier,
    make_policy,
    match_budget,
    quality_order,
)
from elastic_export.targets.onnxruntime import SessionConfig  # noqa: F401 - re-exported: from_dir's config

MODES = ("per-budget", "elastic")
_key, _fmt = key, fmt  # the names this module used before the split


class ElasticRuntime:
    """Every (budget, precision) pair of an artifact directory, loaded once; see the module docstring.

    Build with :meth:`from_dir`.
    """

    def __init__(self, directory: Path, manifest: Manifest, budgets: list[RunnableBudget], backend: str, provider: str,
                 mode: str, input_names: list[str], output_names: list[str], precision: str = "fp32",
                 impl: Backend | None = None) -> None:
        self.directory, self.manifest = directory, manifest
        self.backend, self.provider, self.mode = backend, provider, mode
        self._impl = impl  # the backend instance that loaded the budgets (close() frees what it holds)
        self.input_names, self.output_names = input_names, output_names
        self._budgets: dict[Pair, RunnableBudget] = {b.pair: b for b in budgets}
        self.pairs: list[Pair] = sorted(self._budgets, key=lambda p: (p[0], PRECISION_ORDER.index(p[1])))
        self.sparsities: list[float] = sorted({s for s, _ in self.pairs})
        self.precisions: list[str] = [p for p in FILE_KEYS if any(q == p for _, q in self.pairs)]
        self._lock = threading.Lock()
        precision = precision if precision in self.precisions else self.precisions[0]
        self._current: Pair = next(p for p in self.pairs if p[1] == precision)
        self._policy: Policy | None = None
        self._tokenizer = None  # loaded by the first encode()

    # construction ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, backend: str = DEFAULT_BACKEND, providers: Sequence[str] | str | None = None,
                 config: Any = None, mode: str = "per-budget", precision: str | None = None,
                 precisions: Sequence[str] | str | None = None,
                 sparsities: Sequence[float] | None = None) -> "ElasticRuntime":
        """Load the budgets of an artifact directory once, at one or more precisions.

        Args:
            path: the artifact directory (with ``manifest.json``).
            backend: a registered backend (:func:`elastic_export.serving.backends.backend_names`):
                ``onnxruntime`` or ``tensorrt``.
            providers: onnxruntime provider, short (``cpu``, ``cuda``, ``tensorrt``) or full
                (``CUDAExecutionProvider``) name, or a list whose first entry is used; overrides
                ``config.provider``.
            config: the backend's options; onnxruntime: session options (:class:`SessionConfig`;
                default CPU, onnxruntime's threads).
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
        impl = get_backend(backend)
        if mode not in MODES:
            raise UserError(f"mode {mode!r}: unknown; choose from {', '.join(MODES)}")
        manifest = Manifest.load(directory)
        wanted = _precisions(manifest, mode, precision, precisions)
        impl.check_precisions(wanted, ", ".join(wanted))
        inputs = [v.name for v in manifest.inputs]
        outputs = [v.name for v in manifest.outputs]
        keep = _sparsity_filter(directory, manifest, sparsities)
        budgets, provider = impl.load_budgets(directory, manifest, mode, keep, wanted, config, providers)
        if not budgets:
            raise UserError(f"{directory}: none of sparsities {_fmt(sparsities or [])} is served in mode {mode!r}")
        return cls(directory, manifest, budgets, backend, provider, mode, inputs, outputs,
                   precision=precision or wanted[0], impl=impl)

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
        """The loaded pair that serves ``sparsity`` (None: the current one) at ``precision`` (None: the
        current one), by the router's rule (:func:`match_budget`: 0.35 with 0.3 and 0.4 loaded is
        0.4), among the sparsities loaded at that precision; UserError (one line, naming what is
        loaded) otherwise."""
        cur_s, cur_p = self._current
        s = cur_s if sparsity is None else sparsity
        p = cur_p if precision is None else precision
        if type(s) is float and (s, p) in self._budgets:  # a loaded one as given: no search
            return s, p
        if p not in self.precisions:
            raise UserError(f"precision {p!r} is not loaded; loaded: {', '.join(self.precisions)} "
                            f"(load it with ElasticRuntime.from_dir(..., precisions=...))")
        listed = [x for x, q in self.pairs if q == p]
        return match_budget(s, listed, precision=p if len(self.precisions) > 1 else None), p

    def set_budget(self, sparsity: float, precision: str | None = None) -> None:
        """Switch to a loaded pair (O(1): no session is created) and drop any policy.

        Args:
            sparsity: a sparsity, matched to :attr:`sparsities` by the router's rule (module
                docstring): a listed one, else the smallest listed one above it (0.0 is the dense model).
            precision: one of :attr:`precisions` (None: keep the current precision).

        Raises:
            UserError: a sparsity outside [0, 1), not a number or above the sparsest listed one, or a
                precision not loaded (the message lists them).
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

    def _arrive(self, batch: int, choose: bool) -> Pair | None:
        """Report a request of ``batch`` rows to the policy (:meth:`Policy.arrive`: every request, as the
        router counts every request in its arrival rate) and, when ``choose``, the pair it gets (the
        policy's, else the current one)."""
        with self._lock:
            if self._policy is not None:
                self._policy.arrive(batch)
            if not choose:
                return None
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
            sparsity: a sparsity for this call only (the current pair is unchanged), matched as
                :meth:`set_budget` matches it; None with ``precision`` None: the policy's choice, or
                the current pair.
            precision: a loaded precision for this call only (None: the current one).

        Returns:
            output name -> array, in the manifest's output order.

        Raises:
            UserError: a sparsity no loaded budget serves, a precision not loaded, or a missing input.
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
        named = sparsity is not None or precision is not None
        pair = self._resolve(sparsity, precision) if named else None
        pair = self._arrive(_batch(feeds, self.input_names), choose=not named) or pair
        got = self._budgets[pair].run({n: feeds[n] for n in self.input_names})
        if isinstance(got, dict):
            return pair, {n: got[n] for n in self.output_names}
        return pair, dict(zip(self.output_names, got))

    def encode(self, texts: Sequence[str] | str, sparsity: float | None = None,
               precision: str | None = None) -> np.ndarray:
        """Embeddings of raw ``texts`` (a text encoder's directory): tokenized with the model's own
        tokenizer (:class:`elastic_export.models.text.TextEncoder`, the ``tokenizers`` library, no torch),
        run as :meth:`run` runs (the policy's choice, or the given sparsity / precision).

        Returns:
            ``sentence_embedding`` (batch, dim) where the model has one, else the mean of
            ``last_hidden_state`` under the attention mask.

        Raises:
            UserError: not a text encoder, no tokenizer found, or no texts.
        """
        encoder = self._text_encoder()
        feeds = encoder.encode(texts)
        out = self.run(feeds, sparsity, precision)
        if "sentence_embedding" in out:
            return out["sentence_embedding"]
        if "last_hidden_state" in out and "attention_mask" in feeds:
            from elastic_export.models.text import mean_pool

            return mean_pool(out["last_hidden_state"], feeds["attention_mask"])
        raise UserError(f"{self.directory}: the model has no sentence_embedding or last_hidden_state output")

    def _text_encoder(self):
        """The directory's tokenizer (its manifest's ``preprocess`` entry, else the model's source folder), loaded once."""
        if self._tokenizer is None:
            from elastic_export.models.text import TOKENIZER_DIR, TextEncoder, tokenizer_folder

            if "input_ids" not in self.input_names:
                raise UserError(f"{self.directory}: encode() needs a text encoder; this model takes "
                                f"{', '.join(self.input_names)}")
            folder = tokenizer_folder(self.manifest, self.directory)
            if folder is None:
                raise UserError(f"{self.directory}: no tokenizer (no {TOKENIZER_DIR}/tokenizer.json, and the model's "
                                f"source folder {self.manifest.model.source!r} has none)")
            self._tokenizer = TextEncoder.from_dir(folder, self.input_names)
        return self._tokenizer

    def file(self, sparsity: float, precision: str | None = None) -> str:
        """The file (relative to the directory) that serves ``sparsity`` (matched as :meth:`set_budget`
        matches it; at ``precision``, default the current one)."""
        return self._budgets[self._resolve(sparsity, precision)].file

    def close(self) -> None:
        """Free what the backend holds beyond Python objects (TensorRT engines' device buffers); the
        runtime must not run afterwards."""
        if self._impl is not None:
            self._impl.close()

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
def _precisions(manifest: Manifest, mode: str, precision: str | None, precisions: Sequence[str] | str | None) -> list[str]:
    """The precisions to load, in :data:`FILE_KEYS` order; UserError for unknown ones."""
    if precisions == "all":
        have = manifest.precisions or ["fp32"]
        if mode == "elastic":
            have = ["fp32"] + (["fp16"] if manifest.elastic is not None and manifest.elastic.onnx_fp16 else [])
        precisions = have
    elif isinstance(precisions, str):
        precisions = [p.strip() for p in precisions.split(",")]
    asked = list(precisions) if precisions else [precision or "fp32"]
    for p in asked + ([precision] if precision else []):
        if p not in FILE_KEYS:
            raise UserError(f"precision {p!r}: unknown; choose from {', '.join(FILE_KEYS)}")
    if precision and precision not in asked:
        raise UserError(f"precision {precision!r} is not among precisions {', '.join(asked)}")
    int8 = [p for p in asked if p.startswith("int8")]
    if int8 and mode == "elastic":
        raise UserError(f"precision {int8[0]!r}: the elastic graph has no int8 twin; use mode='per-budget'")
    return [p for p in FILE_KEYS if p in asked]


def _sparsity_filter(directory: Path, manifest: Manifest, sparsities: Sequence[float] | None) -> Callable[[float], bool]:
    """``keep(s)``: whether sparsity ``s`` is to be loaded; UserError for a sparsity the manifest
    does not list."""
    if sparsities is None:
        return lambda s: True
    listed = [0.0] + [manifest_sparsity(directory, s) for s in manifest.sparsities]
    wanted = {_key(s) for s in sparsities}
    bad = sorted(wanted - set(listed))
    if bad or not wanted:
        raise UserError(f"sparsities {_fmt(bad) or '(none)'}: not listed budgets; listed: {_fmt(listed)}")
    return lambda s: s in wanted


def _batch(feeds: Mapping[str, np.ndarray], names: list[str]) -> int:
    for n in names:
        shape = np.shape(feeds[n])
        if shape:
            return int(shape[0])
    return 1
