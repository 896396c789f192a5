"""TensorRT engines from an artifact directory: one engine per budget (and the dense model).

``build_engines(DIR)`` parses each budget's ONNX with TensorRT's ONNX parser, builds one engine
with a dynamic-batch optimisation profile (text: dynamic tokens too), writes it as
``budget_sXXX.engine`` / ``dense.engine`` next to the ONNX and records it in the manifest
(``budgets[].engine``, ``dense.engine`` and a top-level ``tensorrt`` entry). How to build is a
:class:`BuildConfig` (precision, profile ranges, workspace, timing cache, ...; checked when made, as
Polygraphy's ``CreateConfig``); :func:`plan_build` checks a directory against it before anything is
written. :func:`load_engine` returns a :class:`TrtRunner` that runs an engine with named tensors
(TensorRT >= 10 API).

**FP16.** Decided by feature checks on the imported ``tensorrt`` module, never by its version
string (Polygraphy's ``try_set_flag`` style):

* the builder config has ``BuilderFlag.FP16`` (TensorRT 10): the fp32 ONNX is built with that flag
  and TensorRT picks fp16 kernels where it wants them, except in norms, softmax and reductions,
  which are asked to stay fp32 (:func:`pin_fp32_layers`, the split the fp16 ONNX makes);
* no ``BuilderFlag.FP16`` but ``NetworkDefinitionCreationFlag.STRONGLY_TYPED`` (TensorRT 11, where
  the precision flags and per-layer precisions are gone and every network is strongly typed): the
  directory's fp16 ONNX (``onnx_fp16`` in the manifest, written by ``--precision fp16``: fp16 types
  with explicit Casts, fp32 norms / softmax / tail) is parsed, and runs in exactly the precision its
  types say.

**INT8.** Explicit quantization only: the directory's QDQ files (``onnx_int8_qdq``, written by
``--precision int8-qdq``: int8 weights per output channel, symmetric int8 activations, Q/DQ on the
weight MatMuls' inputs; :mod:`elastic_export.precision.int8_qdq`) are parsed, never the fp32 ONNX with a
calibrator (TensorRT 11 has none, and the dynamic ``*.int8.onnx`` files use onnxruntime-only ops).
Feature checks again (:func:`int8_mode`): where ``BuilderFlag.INT8`` exists (TensorRT 10) the network
is parsed as before and the flag set, so the Q/DQ layers may run int8 kernels; otherwise (TensorRT 11,
strongly typed only) the network is parsed strongly typed and the Q/DQ layers say the precision.
Layers outside the Q/DQ pairs stay fp32 in both.

**FP32** engines are built with ``BuilderFlag.TF32`` cleared unless ``tf32=True`` (``--tf32``): TensorRT
enables TF32 by default, which rounds matmul inputs to 10-bit mantissas.

**Edge devices.** This module and everything it imports (numpy, onnx via the manifest helpers,
tqdm) work without torch: copy an artifact directory to a Jetson / edge box with TensorRT and
``cuda-python`` and build there. The runner uses ``cuda-python`` (``cuda.bindings.runtime`` or the
older ``cuda.cudart``) for device memory and falls back to torch CUDA tensors only when
``cuda-python`` is absent and torch is present.

**Atomicity.** Engines are first written to temporary files in the directory; only when every
engine has been built are they renamed to their final names and the manifest rewritten
(atomically, :func:`elastic_export.core.manifest.write_manifest`). A failed build leaves the previous
engines and manifest as they were.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from elastic_export.core.errors import ERROR_CHARS, UserError, first_line
from elastic_export.core.fileio import atomic_write, existing_dir
from elastic_export.core.manifest import MANIFEST, Manifest, resolve, write_manifest
from elastic_export.core.precisions import FILE_KEYS
from elastic_export.targets.profiles import (
    DEFAULT_MAX_BATCH,
    DEFAULT_MIN_BATCH,
    DEFAULT_OPT_BATCH,
    Profile,
    Shape,
    compute_profile,
)

INSTALL_HINT = 'pip install -e ".[tensorrt]" on a machine with a CUDA GPU'
DEFAULT_WORKSPACE_GB = 4.0
TIMING_CACHE = "tensorrt.timing.cache"
DENSE_ENGINE = "dense.engine"
BUILDER_FLAG, STRONGLY_TYPED = "builder-flag", "strongly-typed"

# --- what is available ----------------------------------------------------------------------------
def import_tensorrt():
    """The ``tensorrt`` module, or a one-line :class:`UserError` naming what is missing.

    Raises:
        UserError: tensorrt is not installed, cannot be imported, or lacks the named-tensor API of
            TensorRT >= 10.
    """
    try:
        import tensorrt as trt
    except ImportError:
        raise UserError(f"TensorRT engines need the tensorrt package and a CUDA GPU: tensorrt is not installed "
                        f"({INSTALL_HINT})") from None
    except Exception as e:  # a broken install: missing libnvinfer, CUDA driver, ...
        raise UserError(f"TensorRT engines need the tensorrt package and a CUDA GPU: tensorrt cannot be imported "
                        f"({first_line(e, limit=ERROR_CHARS)})") from None
    if not (hasattr(trt, "ICudaEngine") and hasattr(trt.ICudaEngine, "get_tensor_name")
            and hasattr(trt, "IExecutionContext") and hasattr(trt.IExecutionContext, "execute_async_v3")):
        raise UserError("this tensorrt lacks the named-tensor API (get_tensor_name / execute_async_v3) of "
                        f"TensorRT >= 10; {INSTALL_HINT}")
    return trt


def _cudart():
    """cuda-python's runtime module (``cuda.bindings.runtime``, or the older ``cuda.cudart``), or None."""
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        return cudart
    except Exception:
        pass
    try:
        from cuda import cudart  # type: ignore[attr-defined]  # older cuda-python
        return cudart
    except Exception:
        return None


def cuda_device_count() -> int | None:
    """CUDA devices visible, via cuda-python, else torch when it is installed; None when neither can tell."""
    cudart = _cudart()
    if cudart is not None:
        try:
            err, count = cudart.cudaGetDeviceCount()
            return int(count) if int(err) == 0 and count is not None else 0
        except Exception:
            pass
    if _torch_present():
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    return None


def _torch_present() -> bool:
    """True when torch is importable (never imports it when ``sys.modules['torch'] is None``)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


def tensorrt_unavailable() -> str | None:
    """Why engines cannot be built or run here (one line), or None when they can."""
    try:
        import_tensorrt()
    except UserError as e:
        return str(e)
    count = cuda_device_count()
    if count == 0:
        return "TensorRT engines need a CUDA GPU: no CUDA device is visible"
    return None


# --- FP16: feature checks -------------------------------------------------------------------------
def fp16_mode(trt: Any, have_fp16_onnx: bool) -> str:
    """How this ``tensorrt`` builds fp16 engines: :data:`BUILDER_FLAG` or :data:`STRONGLY_TYPED`.

    Args:
        trt: the tensorrt module (or any object with its ``BuilderFlag`` /
            ``NetworkDefinitionCreationFlag`` attributes).
        have_fp16_onnx: whether the directory has an fp16 ONNX for the dense model and every budget.

    Returns:
        ``builder-flag`` where ``trt.BuilderFlag.FP16`` exists (TensorRT 10); else ``strongly-typed``
        where ``trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED`` exists (TensorRT 11).

    Raises:
        UserError: strongly typed is the only way but the fp16 ONNX files are missing, or neither
            feature exists.
    """
    if hasattr(getattr(trt, "BuilderFlag", None), "FP16"):
        return BUILDER_FLAG
    if hasattr(getattr(trt, "NetworkDefinitionCreationFlag", None), "STRONGLY_TYPED"):
        if not have_fp16_onnx:
            raise UserError("this TensorRT has no FP16 builder flag, so fp16 engines are built strongly typed from the "
                            "fp16 ONNX files, which this directory lacks: re-export with --precision fp16")
        return STRONGLY_TYPED
    raise UserError("this TensorRT has neither BuilderFlag.FP16 nor a STRONGLY_TYPED network flag; "
                    "cannot build fp16 engines")


def int8_mode(trt: Any) -> str:
    """How this ``tensorrt`` builds int8 engines from the QDQ files: :data:`BUILDER_FLAG` where
    ``trt.BuilderFlag.INT8`` exists (TensorRT 10), else :data:`STRONGLY_TYPED` where the network flag
    exists (TensorRT 11).

    Raises:
        UserError: neither exists.
    """
    if hasattr(getattr(trt, "BuilderFlag", None), "INT8"):
        return BUILDER_FLAG
    if hasattr(getattr(trt, "NetworkDefinitionCreationFlag", None), "STRONGLY_TYPED"):
        return STRONGLY_TYPED
    raise UserError("this TensorRT has neither BuilderFlag.INT8 nor a STRONGLY_TYPED network flag; "
                    "cannot build int8 engines")


def try_set_flag(config: Any, flags: Any, name: str) -> bool:
    """Set builder flag ``name`` on ``config`` if this TensorRT has it (Polygraphy's ``try_set_flag``).

    Args:
        config: an ``IBuilderConfig`` (anything with ``set_flag``).
        flags: ``trt.BuilderFlag`` (or None).
        name: flag name, e.g. ``FP16``.

    Returns:
        True when the flag exists and was set; False when it does not exist or setting it failed.
    """
    flag = getattr(flags, name, None)
    if flag is None:
        return False
    try:
        config.set_flag(flag)
    except Exception:  # a flag that exists but is rejected (deprecated / unsupported here)
        return False
    return True


def try_clear_flag(config: Any, flags: Any, name: str) -> bool:
    """Clear builder flag ``name`` on ``config`` if this TensorRT has it (e.g. ``TF32``, on by default).

    Returns:
        True when the flag exists and was cleared; False otherwise.
    """
    flag = getattr(flags, name, None)
    if flag is None or not hasattr(config, "clear_flag"):
        return False
    try:
        config.clear_flag(flag)
    except Exception:
        return False
    return True


FP32_LAYER_TYPES = ("NORMALIZATION", "SOFTMAX", "REDUCE")
"""Layer types kept in fp32 in builder-flag fp16 builds: the ops ``elastic_export.precision.fp16`` keeps in fp32
(norms, softmax, reductions: they accumulate, and LayerNorm after attention can overflow fp16)."""


def pin_fp32_layers(trt: Any, network: Any, config: Any) -> int:
    """Builder-flag fp16 (TensorRT 10): ask for fp32 in every norm, softmax and reduction layer.

    The strongly typed path gets the same split from the fp16 ONNX's Casts; this gives the
    ``BuilderFlag.FP16`` path the same numerics. Each layer's ``precision`` and float outputs are set
    to fp32 (a normalization layer's ``compute_precision`` too) and the config prefers those
    constraints (``PREFER_PRECISION_CONSTRAINTS``, else ``OBEY_PRECISION_CONSTRAINTS``). All by
    feature checks: a TensorRT without per-layer precision (11, always strongly typed) pins nothing.

    Args:
        trt: the tensorrt module.
        network: the parsed ``INetworkDefinition``.
        config: its ``IBuilderConfig``.

    Returns:
        How many layers were pinned (0 where this TensorRT has no per-layer precision).
    """
    kinds = getattr(trt, "LayerType", None)
    wanted = {getattr(kinds, n) for n in FP32_LAYER_TYPES if hasattr(kinds, n)}
    fp32, floats = getattr(trt, "float32", None), {getattr(trt, "float32", None), getattr(trt, "float16", None)}
    if not wanted or fp32 is None:
        return 0
    if not (try_set_flag(config, trt.BuilderFlag, "PREFER_PRECISION_CONSTRAINTS")
            or try_set_flag(config, trt.BuilderFlag, "OBEY_PRECISION_CONSTRAINTS")):
        return 0
    pinned = 0
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type not in wanted or not hasattr(layer, "precision"):
            continue
        layer.precision = fp32
        if hasattr(layer, "compute_precision"):
            layer.compute_precision = fp32
        for j in range(layer.num_outputs):
            if layer.get_output(j).dtype in floats and hasattr(layer, "set_output_type"):
                layer.set_output_type(j, fp32)
        pinned += 1
    return pinned


def network_flags(trt: Any, strongly_typed: bool) -> int:
    """Creation flags of the network: STRONGLY_TYPED when asked, EXPLICIT_BATCH where it still exists
    (required before TensorRT 10, ignored by 10, gone after)."""
    flags = 0
    ndcf = getattr(trt, "NetworkDefinitionCreationFlag", None)
    explicit = getattr(ndcf, "EXPLICIT_BATCH", None)
    if explicit is not None and not strongly_typed:
        flags |= 1 << int(explicit)
    if strongly_typed:
        flags |= 1 << int(ndcf.STRONGLY_TYPED)
    return flags


# --- what to build --------------------------------------------------------------------------------
@dataclass
class Job:
    """One engine to build.

    Args:
        key: ``dense`` or the budget's index in the manifest.
        label: ``dense`` or the sparsity, for progress messages.
        onnx: the ONNX file parsed (relative to the directory).
        engine: the engine file written (relative to the directory).
    """

    key: str | int
    label: str
    onnx: str
    engine: str


def engine_name(onnx_name: str) -> str:
    """``budget_s010.onnx`` / ``budget_s010.fp16.onnx`` / ``budget_s010.int8-qdq.onnx`` -> ``budget_s010.engine``."""
    stem = onnx_name[:-5] if onnx_name.endswith(".onnx") else onnx_name
    for suffix in (".fp16", ".int8-qdq"):
        stem = stem[: -len(suffix)] if stem.endswith(suffix) else stem
    return stem + ".engine"


# engine precision -> manifest field of the ONNX files parsed
SOURCE_KEYS = {"fp32": FILE_KEYS["fp32"], "fp16": FILE_KEYS["fp16"], "int8": FILE_KEYS["int8-qdq"]}
REEXPORT = {FILE_KEYS[p]: p for p in ("fp16", "int8-qdq")}  # the --precision that writes those files


def plan_jobs(directory: Path, manifest: Manifest, use_fp16_onnx: bool = False, dense: bool = True,
              key: str | None = None) -> list[Job]:
    """The engines to build, with their ONNX sources checked to exist.

    Args:
        directory: the artifact directory.
        manifest: its loaded manifest.
        use_fp16_onnx: parse the ``onnx_fp16`` files (strongly typed fp16) instead of ``onnx``.
        dense: also build ``dense.engine``.
        key: the manifest field of the files to parse (overrides ``use_fp16_onnx``; e.g. ``onnx_int8_qdq``).

    Raises:
        UserError: a listed ONNX file is missing (or a twin is not listed).
    """
    key = key or SOURCE_KEYS["fp16" if use_fp16_onnx else "fp32"]
    entries: list[tuple[str | int, str, Any]] = [("dense", "dense", manifest.dense)] if dense else []
    entries += [(i, f"{b.sparsity}", b) for i, b in enumerate(manifest.budgets)]
    jobs = []
    for k, label, entry in entries:
        rel = getattr(entry, key)
        if not isinstance(rel, str):
            raise UserError(f"{directory / MANIFEST}: {label} has no {key!r} file"
                            + (f" (re-export with --precision {REEXPORT[key]})" if key in REEXPORT else ""))
        path = resolve(directory, rel)
        if path is None or not path.is_file():
            raise UserError(f"{directory}: {rel} is listed in the manifest but missing")
        eng = DENSE_ENGINE if k == "dense" else engine_name(entry.onnx if isinstance(entry.onnx, str) else rel)
        jobs.append(Job(k, label, rel, eng))
    return jobs


def record_engines(directory: str | Path, manifest: Manifest, engines: Mapping[str | int, str],
                   info: dict) -> Manifest:
    """Put built engines into the manifest and write it atomically.

    Args:
        directory: the artifact directory.
        manifest: the loaded manifest (a :class:`Manifest` is updated in place; returned typed).
        engines: ``dense`` or budget index -> engine file (relative to the directory; must exist).
        info: the top-level ``tensorrt`` entry (version, precision, profiles, ...).

    Returns:
        The updated manifest. Budgets without an engine in ``engines`` get ``engine: null`` (engines
        of an earlier build would no longer match ``tensorrt``).

    Raises:
        UserError: an engine file is missing or outside the directory.
    """
    d = Path(directory)
    for key, rel in engines.items():
        path = resolve(d, rel)
        if path is None or not path.is_file():
            raise UserError(f"{d}: engine {rel} was not written")
        if key != "dense" and not (isinstance(key, int) and 0 <= key < len(manifest.budgets)):
            raise UserError(f"engine {rel}: no budget {key!r} in the manifest")
    manifest.dense.engine = engines.get("dense")
    for i, b in enumerate(manifest.budgets):
        b.engine = engines.get(i)
    manifest.tensorrt = info
    write_manifest(d, manifest)
    return manifest


# --- the build config -----------------------------------------------------------------------------
@dataclass(frozen=True)
class BuildConfig:
    """How to build a directory's engines (as Polygraphy's ``CreateConfig``): checked when made, applied to
    each engine's ``IBuilderConfig`` by :meth:`create_builder_config`, by feature checks only.

    Args:
        precision: ``fp32``, ``fp16`` or ``int8`` (from the ``int8-qdq`` files; see the module docstring).
        min_batch: smallest batch of the optimisation profile.
        opt_batch: batch TensorRT tunes for.
        max_batch: largest batch.
        min_tokens: text: fewest tokens (default 1).
        opt_tokens: text: tokens tuned for (default: manifest ``tokens``).
        max_tokens: text: most tokens (default: manifest ``tokens``).
        workspace_gb: builder workspace limit in GiB (None: TensorRT's default).
        timing_cache: timing cache file shared by all builds, read if it exists and saved after every
            engine (default: ``DIR/tensorrt.timing.cache``).
        dense: also build ``dense.engine``.
        opt_level: ``builder_optimization_level`` (0-5; None: TensorRT's default, 3), where the config
            has it. Lower builds faster with possibly slower engines.
        tf32: let fp32 layers use TF32 tensor cores (TensorRT's own default is on; off here, as in
            Polygraphy, so an fp32 engine computes in fp32).
        fp32_norms: builder-flag fp16 only: keep norms, softmax and reductions in fp32
            (:func:`pin_fp32_layers`), as the strongly typed fp16 ONNX does.

    Raises:
        UserError: a bad precision, workspace or optimisation level. The batch and token ranges need
            the manifest's token count: :meth:`profile` checks them.
    """

    precision: str = "fp32"
    min_batch: int = DEFAULT_MIN_BATCH
    opt_batch: int = DEFAULT_OPT_BATCH
    max_batch: int = DEFAULT_MAX_BATCH
    min_tokens: int | None = None
    opt_tokens: int | None = None
    max_tokens: int | None = None
    workspace_gb: float | None = DEFAULT_WORKSPACE_GB
    timing_cache: str | Path | None = None
    dense: bool = True
    opt_level: int | None = None
    tf32: bool = False
    fp32_norms: bool = True

    def __post_init__(self) -> None:
        if self.precision not in SOURCE_KEYS:
            raise UserError(f"--precision {self.precision}: choose fp32, fp16 or int8")
        if self.workspace_gb is not None and not self.workspace_gb > 0:
            raise UserError(f"--workspace-gb must be positive, got {self.workspace_gb}")
        if self.opt_level is not None and (isinstance(self.opt_level, bool) or self.opt_level not in range(6)):
            raise UserError(f"--opt-level must be 0..5, got {self.opt_level}")

    @property
    def workspace_bytes(self) -> int | None:
        """The workspace limit in bytes (None: TensorRT's default)."""
        return None if self.workspace_gb is None else int(self.workspace_gb * (1 << 30))

    def profile(self, manifest: Manifest) -> Profile:
        """The optimisation profile for ``manifest``'s inputs (raises :class:`UserError` on bad ranges)."""
        return compute_profile(manifest, min_batch=self.min_batch, opt_batch=self.opt_batch, max_batch=self.max_batch,
                               min_tokens=self.min_tokens, opt_tokens=self.opt_tokens, max_tokens=self.max_tokens)

    def cache_path(self, directory: Path) -> Path:
        """The timing cache file (``DIR/tensorrt.timing.cache`` by default); refuses a non-file there."""
        path = Path(self.timing_cache) if self.timing_cache is not None else directory / TIMING_CACHE
        if path.exists() and not path.is_file():
            raise UserError(f"--timing-cache {path}: not a file")
        return path

    def create_builder_config(self, trt: Any, builder: Any, network: Any, mode: str | None) -> tuple[Any, Any, int | None]:
        """One engine's ``IBuilderConfig``: workspace, optimisation level, TF32 and the precision flags.

        Args:
            trt: the tensorrt module.
            builder: its ``IBuilder``.
            network: the parsed network (its norms are pinned to fp32 for builder-flag fp16).
            mode: :data:`BUILDER_FLAG`, :data:`STRONGLY_TYPED` or None (fp32).

        Returns:
            ``(config, tf32_flag, pinned)``: whether this TensorRT has a TF32 flag, and how many layers
            were pinned to fp32 (None where no pinning was asked for).

        Raises:
            UserError: this TensorRT rejects the INT8 / FP16 flag its feature check found.
        """
        config = builder.create_builder_config()
        _set_workspace(trt, config, self.workspace_bytes)
        if self.opt_level is not None and hasattr(config, "builder_optimization_level"):
            config.builder_optimization_level = int(self.opt_level)
        tf32_flag = (try_set_flag if self.tf32 else try_clear_flag)(config, trt.BuilderFlag, "TF32")
        pinned = None
        if mode == BUILDER_FLAG and self.precision == "int8":
            if not try_set_flag(config, trt.BuilderFlag, "INT8"):
                raise UserError("this TensorRT rejected BuilderFlag.INT8 for the Q/DQ network")
        elif mode == BUILDER_FLAG:
            if not try_set_flag(config, trt.BuilderFlag, "FP16"):
                raise UserError("this TensorRT rejected BuilderFlag.FP16; re-export with --precision fp16 so "
                                "the strongly typed fp16 ONNX can be used")
            if self.fp32_norms:
                pinned = pin_fp32_layers(trt, network, config)
        return config, tf32_flag, pinned


def precision_mode(trt: Any, precision: str, manifest: Manifest) -> tuple[str | None, str | None]:
    """How this ``tensorrt`` builds ``precision`` and which manifest files it parses.

    Returns:
        ``(mode, source)``: :data:`BUILDER_FLAG` / :data:`STRONGLY_TYPED` (None for fp32), and the
        manifest key of the ONNX files parsed (None: ``onnx``).
    """
    if precision == "fp16":
        have16 = all(isinstance(e.onnx_fp16, str) for e in [manifest.dense, *manifest.budgets])
        mode = fp16_mode(trt, have16)
        return mode, SOURCE_KEYS["fp16"] if mode == STRONGLY_TYPED else None
    if precision == "int8":
        return int8_mode(trt), SOURCE_KEYS["int8"]
    return None, None


@dataclass
class BuildPlan:
    """A build checked before anything is written: the directory, its manifest, the config, the
    profile, the engines to build, the timing cache, and how this TensorRT builds the precision."""

    directory: Path
    manifest: Manifest
    config: BuildConfig
    profile: Profile
    jobs: list[Job]
    cache_path: Path
    trt: Any
    mode: str | None


def plan_build(directory: str | Path, config: BuildConfig) -> BuildPlan:
    """Check everything a build needs, the directory's files before TensorRT and a GPU.

    Raises:
        UserError: a bad directory, manifest, profile or timing cache; a missing ONNX file; TensorRT
            or a CUDA GPU missing; a precision this TensorRT cannot build.
    """
    d = existing_dir(directory)
    manifest = Manifest.load(d)
    profile = config.profile(manifest)
    plan_jobs(d, manifest, dense=config.dense, key=SOURCE_KEYS["int8"] if config.precision == "int8" else None)  # before TensorRT
    cache_path = config.cache_path(d)
    trt = import_tensorrt()
    if cuda_device_count() == 0:
        raise UserError("TensorRT engines need a CUDA GPU: no CUDA device is visible")
    mode, source = precision_mode(trt, config.precision, manifest)
    jobs = plan_jobs(d, manifest, dense=config.dense, key=source)
    return BuildPlan(d, manifest, config, profile, jobs, cache_path, trt, mode)


# --- building -------------------------------------------------------------------------------------
def _load_timing_cache(config: Any, data: bytes, echo: Callable[[str], None]) -> Any:
    """A timing cache from ``data`` (empty: a fresh one) set on ``config``; a stale one is replaced."""
    try:
        cache = config.create_timing_cache(data)
        if cache is not None and config.set_timing_cache(cache, ignore_mismatch=False):
            return cache
    except Exception as e:  # a cache from another TensorRT version / GPU
        echo(f"timing cache not usable ({first_line(e, limit=ERROR_CHARS)}); starting a new one")
    cache = config.create_timing_cache(b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


def _set_workspace(trt: Any, config: Any, workspace_bytes: int | None) -> None:
    if workspace_bytes is None:
        return
    if hasattr(config, "set_memory_pool_limit") and hasattr(getattr(trt, "MemoryPoolType", None), "WORKSPACE"):
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    elif hasattr(config, "max_workspace_size"):  # pragma: no cover - TensorRT < 8.4
        config.max_workspace_size = int(workspace_bytes)


def _parse(trt: Any, builder: Any, logger: Any, path: Path, strongly_typed: bool) -> Any:
    network = builder.create_network(network_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):  # from the file, so external data next to it is found
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        first = first_line(errors[0], empty="?") if errors else "?"
        raise UserError(f"{path.name}: TensorRT's ONNX parser failed: {first}")
    return network, parser


def _optimization_profile(builder: Any, network: Any, profile: Profile, job: Job) -> Any:
    """The network's inputs' (min, opt, max) shapes as a TensorRT optimisation profile."""
    trt_profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        name = network.get_input(i).name
        if name not in profile.shapes:
            raise UserError(f"{job.onnx}: input {name!r} is not in the manifest's inputs")
        trt_profile.set_shape(name, *profile.shapes[name])
    return trt_profile


@dataclass
class _BuildState:
    """What the build loop carries from one engine to the next, and records in the manifest."""

    cache_data: bytes
    cache: Any = None
    tf32_flag: Any = None  # whether this TensorRT has the TF32 flag at all
    times: dict[str, float] = field(default_factory=dict)
    pinned: dict[str, int] = field(default_factory=dict)
    written: dict[str | int, Path] = field(default_factory=dict)  # temporary engine files


def _build_one(plan: BuildPlan, builder: Any, logger: Any, job: Job, state: _BuildState,
               echo: Callable[[str], None]) -> None:
    """Parse, configure and build one engine into a temporary file; save the timing cache."""
    t0 = time.perf_counter()
    d, trt = plan.directory, plan.trt
    network, _parser = _parse(trt, builder, logger, resolve(d, job.onnx), plan.mode == STRONGLY_TYPED)
    config, state.tf32_flag, pinned = plan.config.create_builder_config(trt, builder, network, plan.mode)
    if pinned is not None:
        state.pinned[str(job.key)] = pinned
    state.cache = _load_timing_cache(config, state.cache.serialize() if state.cache is not None else state.cache_data,
                                     echo)
    config.add_optimization_profile(_optimization_profile(builder, network, plan.profile, job))
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise UserError(f"{job.onnx}: TensorRT failed to build an engine (see the log above)")
    tmp = d / f".{job.engine}.partial"
    atomic_write(tmp, lambda p: _write_bytes(p, serialized))
    state.written[job.key] = tmp
    cache_bytes = config.get_timing_cache().serialize()
    atomic_write(plan.cache_path, lambda p: _write_bytes(p, cache_bytes))
    state.times[str(job.key)] = round(time.perf_counter() - t0, 2)
    echo(f"built {job.engine} from {job.onnx} in {state.times[str(job.key)]:.1f}s")


def _tensorrt_entry(plan: BuildPlan, state: _BuildState) -> dict:
    """The manifest's top-level ``tensorrt`` entry of a finished build."""
    cfg = plan.config
    return {
        "version": getattr(plan.trt, "__version__", None),
        "precision": cfg.precision,
        "fp16_mode": plan.mode if cfg.precision == "fp16" else None,
        "int8_mode": plan.mode if cfg.precision == "int8" else None,
        "profiles": [plan.profile.to_json()],
        "workspace_bytes": cfg.workspace_bytes,
        "builder_optimization_level": cfg.opt_level,
        "tf32": bool(cfg.tf32 and state.tf32_flag),
        "fp32_layers": state.pinned or None,
        "timing_cache": _relative(plan.directory, plan.cache_path),
        "build_seconds": state.times,
    }


def build_engines(directory: str | Path, config: BuildConfig | None = None, *, progress: bool = True,
                  echo: Callable[[str], None] = lambda s: None, **options: Any) -> Manifest:
    """Build one TensorRT engine per budget (and the dense model) and record them in the manifest.

    Args:
        directory: an artifact directory (with ``manifest.json``).
        config: how to build (:class:`BuildConfig`); or give its fields as keywords (``options``:
            ``precision="fp16", max_batch=64, ...``), not both.
        progress: show a tqdm bar on stderr.
        echo: progress messages.

    Returns:
        The updated manifest.

    Raises:
        UserError: a bad directory / option, TensorRT or a GPU missing (checked before anything is
            written), or a failed parse / build (nothing of this run is left behind).
    """
    if config is None:
        existing_dir(directory)  # a missing directory is named before a bad option
        config = BuildConfig(**options)
    elif options:
        raise TypeError(f"build_engines: give config or its fields as keywords, not both ({', '.join(options)})")
    plan = plan_build(directory, config)
    logger = plan.trt.Logger(plan.trt.Logger.WARNING)
    builder = plan.trt.Builder(logger)
    if builder is None:
        raise UserError("TensorRT cannot create a builder (no usable CUDA GPU?)")
    state = _BuildState(plan.cache_path.read_bytes() if plan.cache_path.is_file() else b"")
    engines = {job.key: job.engine for job in plan.jobs}
    from tqdm import tqdm

    try:
        bar = tqdm(plan.jobs, desc="TensorRT engines", unit="engine", disable=not progress, file=sys.stderr)
        for job in bar:
            bar.set_postfix_str(job.label)
            _build_one(plan, builder, logger, job, state, echo)
        for key, tmp in state.written.items():  # every engine built: only now replace the previous ones
            os.replace(tmp, plan.directory / engines[key])
        state.written.clear()
    finally:
        for tmp in state.written.values():
            Path(tmp).unlink(missing_ok=True)
    return record_engines(plan.directory, plan.manifest, engines, _tensorrt_entry(plan, state))


def _write_bytes(path: str | Path, data: Any) -> None:
    with open(path, "wb") as f:
        f.write(data)  # IHostMemory / bytes: anything with the buffer protocol


def _relative(directory: Path, path: Path) -> str | None:
    """``path`` relative to ``directory`` when inside it (the manifest's rule), else None."""
    try:
        return str(path.resolve().relative_to(directory.resolve()))
    except ValueError:
        return None


# --- running --------------------------------------------------------------------------------------
def _check_cuda(result: Any) -> Any:
    """Unpack a cuda-python call's ``(err, *values)``; raise on an error code."""
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if int(err) != 0:
        raise RuntimeError(f"CUDA error {err!r}")
    return rest[0] if len(rest) == 1 else (rest or None)


class _CudaPythonMemory:
    """Device buffers and a stream through cuda-python."""

    def __init__(self, cudart: Any) -> None:
        self.rt = cudart
        self.stream = _check_cuda(cudart.cudaStreamCreate())
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (pointer, capacity in bytes)
        self.keep: list[np.ndarray] = []

    def stream_handle(self) -> int:
        return int(self.stream)

    def ensure(self, name: str, nbytes: int) -> int:
        ptr, cap = self.buffers.get(name, (0, -1))
        if cap < nbytes:
            if ptr:
                _check_cuda(self.rt.cudaFree(ptr))
            ptr = int(_check_cuda(self.rt.cudaMalloc(max(nbytes, 1))))
            self.buffers[name] = (ptr, max(nbytes, 1))
        return ptr

    def upload(self, name: str, array: np.ndarray) -> int:
        ptr = self.ensure(name, array.nbytes)
        self.keep.append(array)  # alive until the next synchronize
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        _check_cuda(self.rt.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes, kind, self.stream))
        return ptr

    def download(self, name: str, shape: Shape, dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        _check_cuda(self.rt.cudaMemcpyAsync(out.ctypes.data, self.buffers[name][0], out.nbytes, kind, self.stream))
        return out

    def synchronize(self) -> None:
        _check_cuda(self.rt.cudaStreamSynchronize(self.stream))
        self.keep.clear()

    def close(self) -> None:
        for ptr, _ in self.buffers.values():
            self.rt.cudaFree(ptr)
        self.buffers.clear()
        if self.stream is not None:
            self.rt.cudaStreamDestroy(self.stream)
            self.stream = None


class _TorchMemory:
    """Device buffers and a stream through torch CUDA tensors (used when cuda-python is absent)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.buffers: dict[str, Any] = {}
        self.pending: list[tuple[Any, np.ndarray]] = []

    def stream_handle(self) -> int:
        return int(self.stream.cuda_stream)

    def ensure(self, name: str, nbytes: int) -> int:
        t = self.buffers.get(name)
        if t is None or t.numel() < nbytes:
            t = self.buffers[name] = self.torch.empty(max(nbytes, 1), dtype=self.torch.uint8, device="cuda")
        return t.data_ptr()

    def upload(self, name: str, array: np.ndarray) -> int:
        self.ensure(name, array.nbytes)
        src = self.torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        with self.torch.cuda.stream(self.stream):
            self.buffers[name][: array.nbytes].copy_(src, non_blocking=False)
        return self.buffers[name].data_ptr()

    def download(self, name: str, shape: Shape, dtype: np.dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        with self.torch.cuda.stream(self.stream):
            self.torch.from_numpy(out.reshape(-1).view(np.uint8)).copy_(self.buffers[name][: out.nbytes])
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.buffers.clear()


def _memory(backend: str) -> Any:
    if backend not in ("auto", "cuda-python", "torch"):
        raise ValueError(f"backend {backend!r}: choose auto, cuda-python or torch")
    if backend in ("auto", "cuda-python"):
        cudart = _cudart()
        if cudart is not None:
            return _CudaPythonMemory(cudart)
        if backend == "cuda-python":
            raise UserError("cuda-python is not installed (pip install cuda-python)")
    if _torch_present():
        return _TorchMemory()
    raise UserError("running a TensorRT engine needs cuda-python (pip install cuda-python) or torch with CUDA")


@dataclass
class TrtRunner:
    """One deserialized engine and its execution context; runs with named tensors (TensorRT >= 10).

    Args:
        engine: the ``ICudaEngine``.
        context: its ``IExecutionContext``.
        memory: device buffers and stream (cuda-python, or torch).
        inputs: input tensor names, in engine order.
        outputs: output tensor names, in engine order.
    """

    engine: Any
    context: Any
    memory: Any
    trt: Any
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)

    def _dtype(self, name: str) -> np.dtype:
        return np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name)))

    def _prepare(self, feeds: Mapping[str, np.ndarray]) -> dict[str, Shape]:
        """Upload the inputs, set their shapes and every tensor address; returns the output shapes."""
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise UserError(f"engine input {missing[0]!r} is not in the feeds")
        for name in self.inputs:
            arr = np.ascontiguousarray(feeds[name], dtype=self._dtype(name))
            if not self.context.set_input_shape(name, tuple(arr.shape)):
                raise UserError(f"input {name} shape {tuple(arr.shape)} is outside the engine's profile")
            self.context.set_tensor_address(name, self.memory.upload(name, arr))
        shapes = {}
        for name in self.outputs:
            shape = tuple(int(v) for v in self.context.get_tensor_shape(name))
            if any(v < 0 for v in shape):
                raise UserError(f"output {name} has an unresolved shape {shape}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * self._dtype(name).itemsize
            self.context.set_tensor_address(name, self.memory.ensure(name, nbytes))
            shapes[name] = shape
        return shapes

    def _execute(self) -> None:
        if not self.context.execute_async_v3(self.memory.stream_handle()):
            raise RuntimeError("TensorRT execution failed")

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Iterable[str] | None = None) -> list[np.ndarray]:
        """Run once.

        Args:
            feeds: input name -> array (cast to the engine's input types).
            outputs: names to return (default: every output, in engine order).

        Returns:
            The outputs as numpy arrays (in the engine's output types).
        """
        shapes = self._prepare(feeds)
        self._execute()
        names = list(outputs) if outputs is not None else self.outputs
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise UserError(f"engine has no output {unknown[0]!r}")
        result = [self.memory.download(n, shapes[n], self._dtype(n)) for n in names]
        self.memory.synchronize()
        return result

    def time(self, feeds: Mapping[str, np.ndarray], iters: int = 20, warmup: int = 3,
             prepare_each: bool = False) -> list[float]:
        """Seconds per execution, each synchronised.

        Args:
            feeds: inputs.
            iters: timed runs.
            warmup: untimed runs first.
            prepare_each: False: inputs uploaded once, only the execution is timed; True: every run
                also sets the input shapes, uploads the inputs and sets the tensor addresses (the
                per-request work of a server, e.g. right after switching to this engine).
        """
        self._prepare(feeds)
        self.memory.synchronize()
        out = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            if prepare_each:
                self._prepare(feeds)
            self._execute()
            self.memory.synchronize()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        return out

    def close(self) -> None:
        """Free the device buffers (the engine and context go with the object)."""
        self.memory.close()

    def __enter__(self) -> "TrtRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load_engine(path: str | Path, backend: str = "auto") -> TrtRunner:
    """Deserialize an engine file into a :class:`TrtRunner`.

    Args:
        path: a ``.engine`` file built by :func:`build_engines` (same TensorRT version and GPU). Its
            outputs are returned in the order of the ``manifest.json`` next to it, where there is one.
        backend: device memory through ``cuda-python``, ``torch``, or ``auto`` (cuda-python first).

    Raises:
        UserError: TensorRT / CUDA missing, or the file does not deserialize.
    """
    trt = import_tensorrt()
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{path}: no such engine file")
    logger = trt.Logger(trt.Logger.ERROR)
    memory = _memory(backend)  # creates the CUDA context before TensorRT needs it
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(p.read_bytes())
    if engine is None:
        memory.close()
        raise UserError(f"{path}: TensorRT cannot deserialize it (built by another TensorRT version or GPU?)")
    context = engine.create_execution_context()
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    outputs = _manifest_order(p, [n for n in names if n not in inputs])
    runner = TrtRunner(engine, context, memory, trt, inputs, outputs)
    runner._runtime = runtime  # the runtime must outlive the engine
    return runner


def _manifest_order(engine_path: Path, outputs: list[str]) -> list[str]:
    """``outputs`` in the order of the manifest next to the engine (the ONNX output order the runtime
    zips its results with), when that manifest lists exactly these outputs; else unchanged."""
    import json

    try:
        names = [o["name"] for o in json.loads((engine_path.parent / MANIFEST).read_text())["outputs"]]
    except Exception:  # no manifest there, or not one of ours: keep the engine's order
        return outputs
    return names if sorted(names) == sorted(outputs) else outputs
