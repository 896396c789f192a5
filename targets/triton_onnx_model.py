"""elastic-export budget model for Triton's Python backend: one ONNX file run with onnxruntime.

``elastic-export build triton --budget-backend python`` copies this file verbatim into every budget
model's ``<model>/1/model.py``, next to the budget's ``model.onnx``: the same inputs, outputs, dims and
dynamic batching as an ``onnxruntime_onnx`` model, for servers that have only the Python backend (the
``tritonserver`` of PyPI's ``nvidia-pytriton`` wheel, which ``elastic-export serve`` runs). It imports
numpy, onnxruntime and :mod:`elastic_export.serving.length_groups` only (the builder copies that module
next to it), and builds its session here rather than through the package's session factory, so that it
also runs where elastic-export is not installed.

The requests of one ``execute`` call (what the dynamic batcher gathered) run as one batch where their
non-batch shapes agree (texts padded to one length, images of one size), else one run per shape; a
batch of texts that asks only for pooled outputs runs as groups of rows of similar length.
A run that fails answers its requests with onnxruntime's message; when every run of the call failed,
``execute`` raises instead, the one way Triton's Python backend counts requests as failed
(``nv_inference_request_failure``; an error response counts as a success).

Parameters of its ``config.pbtxt``: ``intra_op_threads`` (0: onnxruntime's default), ``allow_spinning``
(``"0"``: idle onnxruntime threads sleep, see :func:`session_options`), ``warmup_tokens`` (the free
dims of the warm-up runs at load: the manifest's nominal tokens) and ``nice`` (the stub process's
niceness increment: its compute yields the cores to the server, the router and the clients whenever they
need them, so that admission, refusals and health answers stay fast while the cores are saturated; it
takes nothing from the compute while they are idle).
"""

import json
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server: the module imports, the model needs the server
    pb_utils = None

# The serving module this file uses, which the builder copies next to it (``<model>/1/``):
SERVING_MODULES = ("length_groups",)
try:  # the package, where it is installed
    from elastic_export.serving import length_groups
except ImportError:  # a Python without it: the copy next to this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import length_groups

THREADS_PARAMETER = "intra_op_threads"
WARMUP_PARAMETER = "warmup_tokens"
SPIN_PARAMETER = "allow_spinning"
NICE_PARAMETER = "nice"
MODEL_FILE = "model.onnx"


def group_by_shape(arrays: List[Dict[str, np.ndarray]]) -> List[List[int]]:
    """Indices of the requests whose inputs share every non-batch shape, first-seen order."""
    groups: Dict[Any, List[int]] = {}
    for i, feeds in enumerate(arrays):
        key = tuple(sorted((n, a.shape[1:], str(a.dtype)) for n, a in feeds.items()))
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def session_options(params: Dict[str, str]) -> Any:
    """The session's options from the config's parameters: ``intra_op_threads``; ``allow_spinning: "0"``
    lets idle onnxruntime threads sleep (``elastic-export build triton`` writes it: the budget models of
    one server share its cores, and under load several run at once, as the router switches budgets;
    spinning threads of one then take the cores from the others)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = int(params.get(THREADS_PARAMETER) or 0)
    if params.get(SPIN_PARAMETER) == "0":
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return options


def nice_this_thread(increment: int) -> None:
    """Lower the calling thread's priority by ``increment`` (Linux: threads have niceness of their own, and
    threads it starts inherit it; elsewhere a no-op, as is an increment of 0). The router's inline runs
    use it, so that its own compute yields to the request path as the budget models' stubs do."""
    if increment > 0 and sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)


def open_session(path: str, params: Dict[str, str]) -> Any:
    """A CPU session on ``path`` with :func:`session_options` from ``params``, warmed up (:func:`warm_up`,
    free dims ``warmup_tokens``): the budget model's, and the router's own for its inline runs."""
    import onnxruntime as ort

    session = ort.InferenceSession(path, session_options(params), providers=["CPUExecutionProvider"])
    warm_up(session, int(params.get(WARMUP_PARAMETER) or 16))
    return session


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
              "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8,
              "tensor(int8)": np.int8, "tensor(double)": np.float64}


def zero_feeds(session: Any, batch: int, free: int) -> Dict[str, np.ndarray]:
    """Zeros for every input of ``session`` at ``batch`` rows, its other free dims ``free``."""
    feeds = {}
    for i in session.get_inputs():
        dims = [d if isinstance(d, int) and d > 0 else free for d in i.shape]
        if dims:
            dims[0] = batch
        feeds[i.name] = np.zeros(dims, dtype=_ORT_TYPES.get(i.type, np.float32))
    return feeds


def warm_up(session: Any, free: int) -> None:
    """Runs ``session`` on zeros at batch 1 and 8 (its other free dims ``free``: the model's nominal
    tokens), so the first requests do not pay onnxruntime's first-run allocations (a load-adaptive
    router would read that as load). Best effort: a model that needs other shapes warms up on its first
    request."""
    for batch in (1, 8):
        try:
            session.run(None, zero_feeds(session, batch, free))
        except Exception:
            pass


def least_in_turn(keys: Sequence[Any], run: Callable[[Any], Any], repeats: int,
                  clock=time.perf_counter) -> Dict[Any, float]:
    """The least ms of ``repeats`` calls ``run(key)`` per key, the keys taken in turn round by round after
    one warm-up round: what else runs meanwhile (the server loading its other models) falls on every key
    alike rather than on whichever was measured then; the least, since what slows a run is the other work
    on the cores, which the router measures as it serves (its service scale), not the model's own cost."""
    for k in keys:
        run(k)
    runs: Dict[Any, List[float]] = {k: [] for k in keys}
    for _ in range(repeats):
        for k in keys:
            t = clock()
            run(k)
            runs[k].append((clock() - t) * 1e3)
    return {k: float(min(v)) for k, v in runs.items()}


def service_times(sessions: Mapping[Any, Any], free: int, batches: Sequence[int] = (1, 8), repeats: int = 7,
                  clock=time.perf_counter) -> Dict[Any, Dict[int, float]]:
    """Per session (keyed as given), its ms at each of ``batches`` rows (free dims ``free``) by
    :func:`least_in_turn`: what the load-adaptive router's latency model starts from, measured on the
    serving machine."""
    feeds = {(k, b): zero_feeds(sess, b, free) for k, sess in sessions.items() for b in batches}
    least = least_in_turn(list(feeds), lambda kb: sessions[kb[0]].run(None, feeds[kb]), repeats, clock)
    return {k: {b: least[(k, b)] for b in batches} for k in sessions}


class TritonPythonModel:
    """Runs ``model.onnx`` of its version folder on the CPU."""

    def initialize(self, args: Dict[str, str]) -> None:
        if pb_utils is None:
            raise RuntimeError("this model runs inside Triton's Python backend (triton_python_backend_utils)")
        config = json.loads(args["model_config"])
        params = {k: (v or {}).get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        path = os.path.join(args["model_repository"], str(args["model_version"]), MODEL_FILE)
        if int(params.get(NICE_PARAMETER) or 0) > 0:
            os.nice(int(params[NICE_PARAMETER]))  # this stub process only (its onnxruntime threads included)
        self.session = open_session(path, params)
        self.inputs = [t["name"] for t in config["input"]]
        self.outputs = [t["name"] for t in config["output"]]
        self.row_outputs = length_groups.row_outputs(config)

    def execute(self, requests: List[Any]) -> List[Any]:
        feeds = [{n: pb_utils.get_input_tensor_by_name(r, n).as_numpy() for n in self.inputs} for r in requests]
        wanted = [list(r.requested_output_names()) or self.outputs for r in requests]
        responses: List[Any] = [None] * len(requests)
        groups = group_by_shape(feeds)
        failed: List[str] = []
        for group in groups:
            names = [n for n in self.outputs if any(n in wanted[i] for i in group)]
            batch = {n: np.concatenate([feeds[i][n] for i in group]) for n in self.inputs}
            try:
                results = dict(zip(names, length_groups.run_grouped(self.session.run, names, batch, self.row_outputs)))
            except Exception as e:  # onnxruntime's own message (bad token ids, shapes) back to the client
                failed.append(str(e))
                for i in group:
                    responses[i] = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e)))
                continue
            start = 0
            for i in group:
                rows = feeds[i][self.inputs[0]].shape[0]
                tensors = [pb_utils.Tensor(n, np.ascontiguousarray(results[n][start:start + rows])) for n in wanted[i]]
                responses[i] = pb_utils.InferenceResponse(output_tensors=tensors)
                start += rows
        if len(failed) == len(groups):  # every request failed: raise, so that Triton counts them as failed
            raise RuntimeError("; ".join(dict.fromkeys(failed)))
        return responses

    def finalize(self) -> None:
        self.session = None
