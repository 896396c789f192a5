"""Timing: the one loop every speed figure comes from, its statistics, and the machine they were taken on.

:func:`time_calls` times a call (``elastic-export bench``, the latency profile, the benchmarks);
:func:`latency_stats` turns timed runs into p50 / p90 / p99 / mean / min / max and throughput
(inputs / s at the p50), the fields of every speed record (:mod:`elastic_export.core.results`);
:func:`measure_profile` measures a runtime's latency profile in process; :func:`machine` is the
machine line quoted with every figure.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from elastic_export.core.errors import UserError
from elastic_export.core.latency_profile import STATS, LatencyProfile, Pair, Rows, profile_of
from elastic_export.core.manifest import Manifest, resolve


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int) -> list[float]:
    """Seconds per call of ``fn``: ``warmup`` untimed calls, then ``repeats`` timed ones.

    Args:
        fn: the call to time (one inference).
        warmup: untimed calls first.
        repeats: timed calls.

    Returns:
        ``repeats`` durations in seconds, in call order.
    """
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def latency_stats(samples: list[float], batch: int) -> dict[str, float]:
    """p50 / p90 / p99 / mean / min / max in ms and throughput (inputs / s at the p50).

    Args:
        samples: seconds per run.
        batch: inputs per run.

    Returns:
        ``{"p50_ms", "p90_ms", "p99_ms", "mean_ms", "min_ms", "max_ms", "throughput"}``.
    """
    ms = np.asarray(samples, dtype=np.float64) * 1e3
    p50, p90, p99 = (float(v) for v in np.percentile(ms, [50, 90, 99]))  # linear: p50 <= p90 <= p99
    return {"p50_ms": p50, "p90_ms": p90, "p99_ms": p99, "mean_ms": float(ms.mean()), "min_ms": float(ms.min()),
            "max_ms": float(ms.max()), "throughput": batch / (p50 / 1e3)}


def profile_stats(stats: Mapping[str, float]) -> dict[str, float]:
    """The latency profile's fields (:data:`elastic_export.core.latency_profile.STATS`) of :func:`latency_stats`."""
    return {k: float(stats[k]) for k in STATS}


def measure_profile(rt: Any, feeds_by_batch: Mapping[int, Mapping[str, np.ndarray]], repeats: int = 20,
                    warmup: int = 2, quality: Mapping[Pair, float] | None = None,
                    quality_metric: str | None = None) -> LatencyProfile:
    """Measure p50 / p90 / p99 latency of every (sparsity, precision) pair of ``rt`` at every batch size.

    Args:
        rt: the :class:`elastic_export.serving.runtime.ElasticRuntime` (its backend, provider, mode and
            loaded pairs are what is measured).
        feeds_by_batch: batch size -> feeds with that many rows.
        repeats: timed runs per (batch, pair) (>= 1).
        warmup: untimed runs first.
        quality: optional quality figure per pair, stored with the profile.
        quality_metric: the name of that figure.

    Returns:
        The profile (:func:`save_profile` writes it next to the artifacts).
    """
    if repeats < 1:
        raise UserError(f"repeats must be >= 1, got {repeats}")
    rows: dict[str, Rows] = {}
    for b, feeds in sorted(feeds_by_batch.items()):
        for s, p in rt.pairs:
            for _ in range(warmup):
                rt.run(feeds, sparsity=s, precision=p)
            times = time_calls(lambda: rt.run(feeds, sparsity=s, precision=p), warmup=0, repeats=repeats)
            rows.setdefault(p, {}).setdefault(int(b), {})[s] = profile_stats(latency_stats(times, int(b)))
    return profile_of(rt, rows, quality, quality_metric)


# the vector extensions that decide which kernels run: int8 (VNNI) and bf16 (AVX-512 BF16, AMX) products
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def machine() -> dict[str, Any]:
    """CPU model, its vector extensions that decide kernel speed (:data:`CPU_FEATURES`), core count,
    load average, onnxruntime version, platform."""
    import onnxruntime as ort

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's entries
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu, flags = info.get("model name") or platform.processor() or platform.machine(), set(info.get("flags", "").split())
    return {"cpu": cpu, "cpu_features": [f for f in CPU_FEATURES if f in flags], "logical_cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()), "onnxruntime": ort.__version__, "platform": platform.platform()}


def busy_warning(host: dict[str, Any]) -> str | None:
    """The warning to print when :func:`machine` found the CPUs more than half busy (timings noisy)."""
    load, cpus = host["load_average"][0], host["logical_cpus"] or 1
    if load > 0.5 * cpus:
        return f"warning: load average {load:.1f} on {host['logical_cpus']} CPUs; timings will be noisy"
    return None


def dense_graph(directory: Path, manifest: Manifest) -> Any:
    """The dense ONNX graph (no external weights): what :func:`sample_feeds` reads the vocabulary from.
    Loading it costs about 0.3 s for MiniLM: load it once for several batch sizes."""
    import onnx

    return onnx.load(str(resolve(directory, manifest.dense.onnx)), load_external_data=False)


def sample_feeds(directory: Path, manifest: Manifest, batch: int, seq_len: int | None,
                 dense: Any = None) -> dict[str, np.ndarray]:
    """Inputs for one timed run (``elastic_export.checks.verify.sample_inputs``) at ``seq_len`` tokens
    (default: the manifest's token count, the N its GFLOPs are computed for): what ``bench`` and the
    quick eval time. ``dense``: :func:`dense_graph`'s, when the caller has it already."""
    from elastic_export.checks.verify import sample_inputs

    dense = dense_graph(directory, manifest) if dense is None else dense
    tokens = manifest.tokens if isinstance(manifest.tokens, int) else None
    return sample_inputs(manifest, dense, batch=batch, seq_len=seq_len or tokens or 128)
