"""onnxruntime sessions for the artifact directory: provider selection, session options, a timed runner.

* :class:`SessionConfig` says which execution provider (``cpu``, ``cuda``, ``tensorrt``) and which
  options (threads, graph optimisation level, TensorRT fp16, engine and timing cache and shape
  profile, CUDA graphs, device, memory arena).
* :func:`make_session` builds an ``onnxruntime.InferenceSession`` from a file and a config; a
  provider this onnxruntime build lacks is refused with a one-line :class:`UserError` that names
  the ones it has (checked with ``onnxruntime.get_available_providers()``).
* :func:`cpu_session` is the plain CPU session every in-package check runs on (the main job's
  output checks, ``verify``, ``eval``, the fp16 / int8 twins, the onnxruntime optimiser): the one
  other place a session is made.
* :class:`Runner` runs a session. On a GPU provider it binds the inputs on the device once
  (:meth:`Runner.bind`) and keeps the outputs there, so :meth:`Runner.run_bound` times the
  inference only, not the host/device copies; on CPU it is a plain ``session.run``.

Imports neither torch nor anything that does: the runtime must work on a box without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from elastic_export.core.errors import UserError, first_line
from elastic_export.targets.profiles import Profile

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
OPT_LEVELS = ("disable", "basic", "extended", "all")


def available_providers() -> list[str]:
    """Short names (``cpu``, ``cuda``, ``tensorrt``) of the providers this onnxruntime build has."""
    import onnxruntime as ort

    have = set(ort.get_available_providers())
    return [short for short, full in PROVIDERS.items() if full in have]


@dataclass
class SessionConfig:
    """How to build an onnxruntime session.

    Args:
        provider: ``cpu``, ``cuda`` or ``tensorrt`` (TensorRT falls back to CUDA, then CPU, for
            nodes it cannot take; CUDA falls back to CPU).
        threads: intra-op threads (0: onnxruntime's default, one per physical core).
        inter_threads: inter-op threads (0: default; only matters with parallel execution).
        opt_level: graph optimisation level: ``disable``, ``basic``, ``extended`` or ``all``.
        fp16: TensorRT provider: allow fp16 kernels (``trt_fp16_enable``).
        engine_cache_dir: TensorRT provider: cache built engines and kernel timings in this
            directory (``trt_engine_cache_*`` and ``trt_timing_cache_*``); None: no cache.
        trt_profile: TensorRT provider: the input shape range one engine covers
            (``trt_profile_{min,opt,max}_shapes``, :class:`elastic_export.targets.profiles.Profile`).
            None: the provider builds for the first shape it sees and rebuilds (seconds) whenever a
            larger one arrives. :meth:`ElasticRuntime.from_dir` fills it from the manifest.
        cuda_graphs: capture and replay CUDA graphs (CUDA: ``enable_cuda_graph``, TensorRT:
            ``trt_cuda_graph_enable``). Needs fixed input shapes and IOBinding (:class:`Runner`).
        device_id: GPU index for the CUDA / TensorRT providers.
        memory_arena: use onnxruntime's memory arena (CPU: ``enable_cpu_mem_arena``; CUDA: off
            means ``arena_extend_strategy=kSameAsRequested``, growing only by what is asked).
            Off trades some speed for a smaller resident set.
        log_severity: onnxruntime log level (0 verbose .. 4 fatal; default 3, errors only).
        spin: let idle intra-op threads spin-wait for work (onnxruntime's default). Turn it off
            when many sessions share few cores (every budget loaded at once), so idle sessions do
            not take CPU from the one that runs.
        share_weights: CPU provider, several files loaded together (the runtime's per-budget mode):
            initializers that are byte-identical across the files (embeddings, norms, layers a
            budget leaves whole) are held once and handed to every session
            (:func:`shared_initializers`).
    """

    provider: str = "cpu"
    threads: int = 0
    inter_threads: int = 0
    opt_level: str = "all"
    fp16: bool = False
    engine_cache_dir: str | None = None
    trt_profile: Profile | None = None
    cuda_graphs: bool = False
    device_id: int = 0
    memory_arena: bool = True
    log_severity: int = 3
    spin: bool = True
    share_weights: bool = True

    def check(self) -> None:
        """Refuse values that cannot work, with a one-line :class:`UserError`."""
        if self.provider not in PROVIDERS:
            raise UserError(f"provider {self.provider!r}: unknown; choose from {', '.join(PROVIDERS)}")
        if self.opt_level not in OPT_LEVELS:
            raise UserError(f"opt_level {self.opt_level!r}: unknown; choose from {', '.join(OPT_LEVELS)}")
        for name in ("threads", "inter_threads", "device_id"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise UserError(f"{name} must be a non-negative integer, got {v!r}")
        if self.cuda_graphs and self.provider == "cpu":
            raise UserError("cuda_graphs needs provider cuda or tensorrt")

    @property
    def on_device(self) -> bool:
        """True for the GPU providers (inputs and outputs live on the device)."""
        return self.provider in ("cuda", "tensorrt")

    def providers(self) -> list[tuple[str, dict[str, Any]]]:
        """The ``providers`` argument of ``InferenceSession``: (name, options) pairs, best first."""
        cuda: dict[str, Any] = {"device_id": self.device_id}
        if not self.memory_arena:
            cuda["arena_extend_strategy"] = "kSameAsRequested"
        if self.cuda_graphs and self.provider == "cuda":
            cuda["enable_cuda_graph"] = "1"
        out: list[tuple[str, dict[str, Any]]] = []
        if self.provider == "tensorrt":
            trt: dict[str, Any] = {"device_id": self.device_id, "trt_fp16_enable": bool(self.fp16)}
            if self.engine_cache_dir:
                Path(self.engine_cache_dir).mkdir(parents=True, exist_ok=True)
                trt.update(trt_engine_cache_enable=True, trt_engine_cache_path=str(self.engine_cache_dir),
                           trt_timing_cache_enable=True, trt_timing_cache_path=str(self.engine_cache_dir))
            if self.trt_profile is not None:
                trt.update(self.trt_profile.ort_tensorrt_options())
            if self.cuda_graphs:
                trt["trt_cuda_graph_enable"] = True
            out.append((PROVIDERS["tensorrt"], trt))
        if self.provider in ("cuda", "tensorrt"):
            out.append((PROVIDERS["cuda"], cuda))
        out.append((PROVIDERS["cpu"], {}))
        return out

    def session_options(self):
        """An ``onnxruntime.SessionOptions`` with the threads, optimisation level and arena set."""
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = self.inter_threads
        so.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
        }[self.opt_level]
        so.enable_cpu_mem_arena = bool(self.memory_arena)
        so.log_severity_level = self.log_severity
        if not self.spin:
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        return so


def check_provider(config: SessionConfig) -> None:
    """Refuse a config whose provider this onnxruntime build does not have (one-line UserError)."""
    config.check()
    have = available_providers()
    if config.provider not in have:
        raise UserError(f"onnxruntime provider {config.provider!r} ({PROVIDERS[config.provider]}) is not available "
                        f"in this onnxruntime build; available: {', '.join(have) or 'none'}")


def make_session(path: str | Path, config: SessionConfig | None = None, initializers: Mapping[str, Any] | None = None):
    """An ``onnxruntime.InferenceSession`` for one ONNX file.

    Args:
        path: the ONNX file.
        config: provider and options (default: :class:`SessionConfig` (), CPU).
        initializers: name -> ``OrtValue`` used instead of the file's own initializer of that name
            (``SessionOptions.add_initializer``; see :func:`shared_initializers`). The session
            keeps a reference, so they live as long as it does.

    Returns:
        The session (thread-safe for ``run``).

    Raises:
        UserError: the provider is not in this onnxruntime build (the message names the available
            ones), a config value is invalid, or the file is missing / cannot be loaded.
    """
    import onnxruntime as ort

    config = config or SessionConfig()
    check_provider(config)
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such ONNX file")
    options = config.session_options()
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    try:
        sess = ort.InferenceSession(str(path), options, providers=config.providers())
    except Exception as e:  # onnxruntime raises its own exception types
        raise UserError(f"{path}: onnxruntime cannot load it ({first_line(e)[:300]})")
    sess.shared_initializers = dict(initializers or {})  # onnxruntime needs them alive as long as the session
    return sess


def cpu_session(model: Any, threads: int | None = None, options: Any = None):
    """A plain onnxruntime CPU session (``CPUExecutionProvider``, onnxruntime's default options).

    Args:
        model: an ONNX file (``str`` / ``Path``), its serialized bytes, or an ``onnx.ModelProto``. A
            model whose weights are over :data:`elastic_export.core.onnx_io.INLINE_LIMIT` cannot be
            serialized in one protobuf: it goes through a scratch file with external data, removed
            with the session.
        threads: intra-op threads (None: onnxruntime's default, or what ``options`` says).
        options: an ``onnxruntime.SessionOptions`` (None: the defaults).

    Returns:
        The session. onnxruntime's own exceptions pass through: each caller words its failure.
    """
    import onnxruntime as ort

    if threads is not None:
        options = options or ort.SessionOptions()
        options.intra_op_num_threads = threads
    scratch = None
    if hasattr(model, "SerializeToString"):  # an onnx.ModelProto (onnx itself is imported only here)
        from elastic_export.core import onnx_io

        if onnx_io.weight_bytes(model) >= onnx_io.INLINE_LIMIT:
            import tempfile

            scratch = tempfile.TemporaryDirectory(prefix="elastic-verify-")  # over 2 GiB: through a file
            onnx_io.save(model, Path(scratch.name) / "model.onnx", external=True)
            model = Path(scratch.name) / "model.onnx"
        else:
            model = model.SerializeToString()
    sess = ort.InferenceSession(model if isinstance(model, bytes) else str(model), options,
                                providers=[PROVIDERS["cpu"]])
    if scratch is not None:
        sess._scratch = scratch  # removed with the session
    return sess


SHARE_MIN_BYTES = 1 << 16
SHARE_MIN_TOTAL = 8 << 20
PREPACKED_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "MatMulInteger", "QLinearMatMul",
                           "QLinearConv", "Attention", "LSTM", "GRU", "RNN"})
"""Ops whose weight inputs onnxruntime's CPU kernels pre-pack into a private layout (then dropping the
initializer): sharing those would add one copy, not save any, so they are not shared."""


def shared_initializers(paths: Sequence[str | Path], min_bytes: int = SHARE_MIN_BYTES,
                        min_total: int = SHARE_MIN_TOTAL) -> list[dict[str, Any]]:
    """The initializers that several ONNX files hold byte for byte, one ``OrtValue`` each.

    Budget files are slices of one dense model: its embeddings, norms and biases are identical
    across files. Handing every session the same ``OrtValue`` for them (:func:`make_session`'s
    ``initializers``) keeps one copy in memory instead of one per file: a text encoder's vocabulary
    embedding is most of a small model (MiniLM: 45 MB of 90). Weights read by matrix products
    (:data:`PREPACKED_OPS`) are left out: onnxruntime pre-packs them per session anyway.

    Args:
        paths: the ONNX files (inline initializers are compared; external-data ones are left alone).
        min_bytes: smaller initializers are not worth sharing.
        min_total: when the first file's shareable initializers add up to less than this, nothing
            is shared and the other files are not read (a ViT has no large embedding table: reading
            and hashing every file would only slow the load down).

    Returns:
        One dict per path, in order: initializer name -> the shared ``OrtValue`` for that file's
        tensor; only tensors that at least two files hold identically (name, type, shape, bytes).
    """
    import onnxruntime as ort

    count: dict[tuple, int] = {}
    values: dict[tuple, Any] = {}
    per_file: list[dict[str, tuple]] = []
    first_total = 0
    for path in paths:
        keys: dict[str, tuple] = {}
        per_file.append(keys)
        candidates = _share_candidates(path, min_bytes)
        if candidates is None:  # not ONNX: shares nothing; make_session reports it
            continue
        for key, load, size in candidates:
            keys[key[0]] = key
            count[key] = count.get(key, 0) + 1
            if count[key] == 2:  # a second file has it: keep one copy, from this file
                values[key] = ort.OrtValue.ortvalue_from_numpy(load())
            if len(per_file) == 1:
                first_total += size
        del candidates
        if len(per_file) == 1 and first_total < min_total:
            return [{} for _ in paths]
    return [{name: values[key] for name, key in keys.items() if key in values} for keys in per_file]


def _share_candidates(path: str | Path, min_bytes: int) -> list[tuple[tuple, Callable[[], Any], int]] | None:
    """The initializers of one ONNX file that :func:`shared_initializers` may share: (key: name, type,
    shape, digest of the bytes; a loader of the tensor; its size in bytes) each; None when the file is not
    ONNX. The file is mapped, not parsed (:mod:`elastic_export.core.onnx_scan`): only the bytes of these
    tensors are read (hashed in place), and read again only for the tensors another file holds too."""
    import hashlib

    import onnx

    from elastic_export.core.onnx_scan import MappedModel, ScanError

    try:
        mapped = MappedModel(path)
    except (OSError, ScanError, UnicodeDecodeError):
        return None  # not ONNX (or unreadable: make_session reports it)
    out = []
    with mapped:
        packed = {i for n in mapped.scan.nodes if n.op_type in PREPACKED_OPS for i in n.input}
        for t in mapped.scan.initializers:
            if t.name in packed or t.raw is None or t.raw[1] == 0:
                continue
            try:
                size = int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            except Exception:  # a type numpy has no dtype for: leave it
                continue
            if size < max(min_bytes, 1):
                continue
            view = mapped.raw(t)
            digest = hashlib.sha1(view, usedforsecurity=False).digest()
            view.release()
            out.append(((t.name, t.data_type, tuple(t.dims), digest), partial(_load_initializer, mapped.path, t), size))
    return out


def _load_initializer(path: Path, t) -> np.ndarray:
    """The array of the scanned initializer ``t`` of ``path`` (its raw bytes read again)."""
    from onnx import TensorProto, numpy_helper

    with open(path, "rb") as f:
        f.seek(t.raw[0])
        raw = f.read(t.raw[1])
    return numpy_helper.to_array(TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, raw_data=raw))


class Runner:
    """Runs one session; on GPU providers through IOBinding so host/device copies are not timed.

    Use :meth:`run` for a plain call, or :meth:`bind` once + :meth:`run_bound` (the part to time)
    + :meth:`outputs` to copy the results to the host. On CPU, ``bind`` keeps the feeds and
    ``run_bound`` is ``session.run``.

    Args:
        session: an ``onnxruntime.InferenceSession``.
        config: the config the session was made with (provider and device id).
        output_names: the outputs to fetch (default: all of the session's, in order).

    Not thread-safe once bound (one binding per runner); ``session.run`` itself is, so use one
    runner per thread, or :meth:`run` with a fresh runner.
    """

    def __init__(self, session, config: SessionConfig | None = None, output_names: Sequence[str] | None = None) -> None:
        self.session = session
        self.config = config or SessionConfig()
        self.output_names = list(output_names) if output_names else [o.name for o in session.get_outputs()]
        self.input_names = [i.name for i in session.get_inputs()]
        self._feeds: dict[str, np.ndarray] | None = None
        self._binding = None
        self._outputs: list[np.ndarray] | None = None

    def bind(self, feeds: dict[str, np.ndarray]) -> None:
        """Put the inputs where the session reads them (the device on GPU providers).

        Args:
            feeds: name -> array for every session input (extra names are ignored).

        Raises:
            UserError: an input the session needs is missing.
        """
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise UserError(f"missing input {missing[0]!r}; the model takes {', '.join(self.input_names)}")
        feeds = {n: np.ascontiguousarray(feeds[n]) for n in self.input_names}
        if not self.config.on_device:
            self._feeds = feeds
            return
        import onnxruntime as ort

        binding = self.session.io_binding()
        dev = self.config.device_id
        for name, value in feeds.items():
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value, "cuda", dev))
        for name in self.output_names:
            binding.bind_output(name, "cuda", dev)
        self._binding = binding

    def run_bound(self) -> None:
        """Run on the bound inputs (no host/device copies on GPU providers)."""
        if self._binding is not None:
            self._binding.synchronize_inputs()
            self.session.run_with_iobinding(self._binding)
            self._binding.synchronize_outputs()
        elif self._feeds is not None:
            self._outputs = self.session.run(self.output_names, self._feeds)
        else:
            raise RuntimeError("Runner.run_bound before Runner.bind")

    def outputs(self) -> list[np.ndarray]:
        """The outputs of the last :meth:`run_bound`, on the host, in ``output_names`` order."""
        if self._binding is not None:
            return list(self._binding.copy_outputs_to_cpu())
        if self._outputs is None:
            raise RuntimeError("Runner.outputs before Runner.run_bound")
        return self._outputs

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """bind + run_bound + outputs: the outputs in ``output_names`` order, on the host.

        Args:
            feeds: name -> array for every session input.
        """
        self.bind(feeds)
        self.run_bound()
        return self.outputs()
