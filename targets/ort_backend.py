"""The ``onnxruntime`` backend: onnxruntime sessions over an artifact directory's ONNX files.

* ``per-budget`` mode: one session per file (dense.onnx and every budget's, per precision: the
  ``onnx`` / ``onnx_fp16`` / ``onnx_int8`` files); on CPU with ``SessionConfig.share_weights``,
  initializers byte-identical across the files are held once (:func:`shared_initializers`).
* ``elastic`` mode: one session of ``elastic.onnx`` (per precision), the budget selected with its
  ``budget_index`` input.

Sessions come from :mod:`elastic_export.targets.onnxruntime` (``providers`` / ``config`` choose the
provider; onnxruntime's TensorRT execution provider gets the manifest's shape range,
:func:`tensorrt_ep_profile`). Registered as ``onnxruntime`` in :mod:`elastic_export.serving.backends`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.manifest import BUDGET_INPUT, MANIFEST, Manifest
from elastic_export.core.precisions import FILE_KEYS
from elastic_export.serving.backends import Backend, Loaded, RunnableBudget, manifest_sparsity
from elastic_export.targets.onnxruntime import PROVIDERS, Runner, SessionConfig, check_provider, make_session, shared_initializers
from elastic_export.targets.profiles import Profile, compute_profile

Keep = Callable[[float], bool]


class OrtBackend(Backend):
    """onnxruntime sessions; ``config`` is a :class:`SessionConfig` (None: CPU, onnxruntime's threads)."""

    supports_precisions = True

    def check_available(self, config: Any = None, *, cli: bool = False) -> None:
        """On the command line, refuse a provider this onnxruntime lacks before anything is loaded
        (``from_dir`` leaves it to :func:`make_session`, which refuses it with the same words)."""
        if not cli:
            return
        try:
            check_provider(SessionConfig(provider=config.provider, threads=config.threads))
        except UserError as e:
            raise UserError(f"--provider {config.provider}: {e}")

    def load_budgets(self, directory: Path, manifest: Manifest, mode: str, keep: Keep, precisions: list[str],
                     config: Any = None, providers: Sequence[str] | str | None = None) -> Loaded:
        config = _config(providers, config)
        if config.provider == "tensorrt" and config.trt_profile is None:
            config = replace(config, trt_profile=tensorrt_ep_profile(manifest, elastic=mode == "elastic"))
        outputs = [v.name for v in manifest.outputs]
        load = _elastic_budgets if mode == "elastic" else _file_budgets
        return Loaded(load(directory, manifest, config, outputs, precisions, keep), config.provider)

    def bench_options(self, directory: Path, bench: Any) -> dict[str, Any]:
        """Every precision asked for, the bench's provider and threads, and on onnxruntime's TensorRT
        provider one engine per model covering every measured batch."""
        profile = None
        if bench.provider == "tensorrt":
            tokens = bench.seq_len
            profile = tensorrt_ep_profile(Manifest.load(directory), min_batch=min(bench.batches),
                                          opt_batch=max(bench.batches), max_batch=max(bench.batches),
                                          opt_tokens=tokens, max_tokens=tokens)
        return {**super().bench_options(directory, bench),
                "config": SessionConfig(provider=bench.provider, threads=bench.threads, opt_level="all", trt_profile=profile)}


def _file_budgets(directory: Path, manifest: Manifest, config: SessionConfig, outputs: list[str],
                  precisions: list[str], keep: Keep) -> list[RunnableBudget]:
    """Per-budget mode: one session per (budget, precision) file."""
    entries = []  # (sparsity, precision, file)
    for prec in precisions:
        k = FILE_KEYS[prec]
        for s, rel in [(0.0, manifest.dense.file(prec))] + [(b.sparsity, b.file(prec)) for b in manifest.budgets]:
            s = manifest_sparsity(directory, s)
            if not keep(s):
                continue
            if rel is None:
                raise UserError(f"{directory / MANIFEST}: budget {s:g} lists no {k} file"
                                + (f" (precision {prec!r}); export with --precision {prec}" if prec != "fp32" else ""))
            entries.append((s, prec, rel))
    paths = [manifest.path(rel) for _, _, rel in entries]
    shared: list[dict] = [{} for _ in paths]
    if config.share_weights and config.provider == "cpu" and all(p is not None and p.is_file() for p in paths):
        shared = shared_initializers(paths)  # weights identical across the files (any precision): held once
    out = []
    for (s, prec, rel), path, init in zip(entries, paths, shared):
        sess = make_session(path, config, initializers=init)
        out.append(RunnableBudget(s, rel, _ort_call(sess, config, None, outputs), tuple(sorted(init)), prec))
    return out


def _elastic_budgets(directory: Path, manifest: Manifest, config: SessionConfig, outputs: list[str],
                     precisions: list[str], keep: Keep) -> list[RunnableBudget]:
    """Elastic mode: one session of the elastic graph per precision, every budget an index into it."""
    e = manifest.elastic
    if e is None or not e.onnx:
        raise UserError(f"{directory / MANIFEST}: no elastic graph (built with --no-elastic-graph?); "
                        f"use mode='per-budget'")
    indices = [(manifest_sparsity(directory, s), i) for s, i in manifest.elastic_indices()]
    name = e.budget_input
    out = []
    for prec in precisions:
        rel = e.file(prec)
        if not rel:
            raise UserError(f"{directory / MANIFEST}: the elastic graph has no {FILE_KEYS[prec]} file; "
                            f"export with --precision {prec}")
        sess = make_session(manifest.path(rel), config)
        if name not in [i.name for i in sess.get_inputs()]:
            raise UserError(f"{directory / rel}: has no input {name!r}")
        for s, i in indices:
            if keep(s):
                call = _ort_call(sess, config, (name, np.array([i], dtype=np.int64)), outputs)
                out.append(RunnableBudget(s, rel, call, (), prec))
    return out


def tensorrt_ep_profile(manifest: Manifest, elastic: bool = False, **ranges: int | None) -> Profile | None:
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
        profile = profile.with_input(manifest.elastic.budget_input if manifest.elastic else BUDGET_INPUT, (1,))
    return profile


def _config(providers: Sequence[str] | str | None, config: SessionConfig | None) -> SessionConfig:
    """``config`` (default :class:`SessionConfig` ()) with its provider from ``providers``' first entry, if any."""
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
