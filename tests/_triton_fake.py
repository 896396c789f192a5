"""A tiny stand-in for Triton's in-server ``triton_python_backend_utils``, to run the router outside a server.

Only the server API is faked; the router module is the real file the build writes (``<name>/1/model.py``),
its configuration the real ``config.pbtxt`` turned into the JSON Triton passes to ``initialize``, and the
budget models it forwards to are the repository's real ONNX files, run in onnxruntime.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
from google.protobuf import json_format, text_format


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE = 2, 3, 14

    def __init__(self, message: str, code: int | None = None):
        self._message, self.code = message, code

    def message(self) -> str:
        return self._message


class InferenceResponse:
    def __init__(self, output_tensors, error=None):
        self._tensors, self._error = list(output_tensors), error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self):
        return self._error

    def as_dict(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._tensors}


class Request:
    """A request as the server hands it to ``execute``: input tensors, JSON parameters, wanted outputs."""

    def __init__(self, inputs: dict, parameters: dict | None = None, outputs: tuple[str, ...] = ()):
        self.tensors = [Tensor(k, v) for k, v in inputs.items()]
        self._parameters, self._outputs = json.dumps(parameters or {}), list(outputs)

    def inputs(self) -> list[Tensor]:
        return self.tensors

    def parameters(self) -> str:
        return self._parameters

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def get_response_sender(self) -> "Sender":
        return Sender(self)


class Sender:
    """A request's response sender: keeps the one final response on the request (``request.response``)."""

    def __init__(self, request: Request):
        self.request = request

    def send(self, response: InferenceResponse, flags: int = 0) -> None:
        assert flags == FINAL and not hasattr(self.request, "response"), "one final response per request"
        self.request.response = response


FINAL = 1  # TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Server:
    """The models the router may call (BLS): ``model name -> ONNX file``, run in onnxruntime; logs each call."""

    def __init__(self, repository: Path):
        self.repository, self.calls, self._sessions = repository, [], {}
        self.barrier = None  # a threading.Barrier: calls wait until that many are in progress together
        self.fail = None  # an error message every call answers with
        self._lock = threading.Lock()

    def run(self, model: str, inputs: list[Tensor], names: list[str]) -> InferenceResponse:
        from elastic_export.targets.onnxruntime import make_session

        path = self.repository / model / "1" / "model.onnx"
        if not path.is_file():  # Triton's words for a model that is not loaded
            return InferenceResponse([], error=TritonError(f"Request for unknown model: '{model}' is not found"))
        if self.fail:
            return InferenceResponse([], error=TritonError(self.fail))
        with self._lock:
            sess = self._sessions.setdefault(model, make_session(path))
        outs = sess.run(names, {t.name(): t.as_numpy() for t in inputs})
        return InferenceResponse([Tensor(n, a) for n, a in zip(names, outs)])


def fake_pb_utils(server: Server) -> types.ModuleType:
    """The module the router imports as ``pb_utils``, bound to ``server``."""
    pb = types.ModuleType("triton_python_backend_utils")

    class InferenceRequest:
        def __init__(self, model_name: str, requested_output_names: list[str], inputs: list[Tensor], timeout: int = 0):
            self.timeout = timeout
            self.model_name, self.names, self.inputs = model_name, list(requested_output_names), inputs

        def exec(self) -> InferenceResponse:
            server.calls.append(("start", self.model_name))
            if server.barrier is not None:  # wait until that many calls are in progress at once
                server.barrier.wait(timeout=30)
            server.calls.append(("end", self.model_name))
            return server.run(self.model_name, self.inputs, self.names)

        async def async_exec(self) -> InferenceResponse:
            server.calls.append(("start", self.model_name))
            await asyncio.sleep(0)  # the next call starts before this one ends, as with a batching server
            server.calls.append(("end", self.model_name))
            return server.run(self.model_name, self.inputs, self.names)

    def by_name(tensors, name):
        return next((t for t in tensors if t.name() == name), None)

    pb.Tensor, pb.TritonError, pb.InferenceResponse, pb.InferenceRequest = Tensor, TritonError, InferenceResponse, \
        InferenceRequest
    pb.get_input_tensor_by_name = lambda request, name: by_name(request.inputs(), name)
    pb.get_output_tensor_by_name = lambda response, name: by_name(response.output_tensors(), name)
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.is_model_ready = lambda model_name, model_version="": (server.repository / model_name / "1").is_dir()
    return pb


def load_router(model_py: Path, pb_utils: types.ModuleType | None, monkeypatch) -> types.ModuleType:
    """Import ``model_py`` as Triton's Python backend does, with ``pb_utils`` as its ``triton_python_backend_utils``."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb_utils)  # None: the import fails
    spec = importlib.util.spec_from_file_location(f"router_{abs(hash(str(model_py)))}", model_py)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def model_config_json(config_pbtxt: Path) -> str:
    """The JSON Triton passes as ``args["model_config"]``: the parsed ``ModelConfig``, proto field names."""
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse(config_pbtxt.read_text(), model_config_pb2.ModelConfig())
    return json_format.MessageToJson(cfg, preserving_proto_field_name=True)


def start_router(repository: Path, name: str, monkeypatch) -> tuple[object, Server]:
    """The router model of ``repository/name``, initialised from its config, and the fake server it calls."""
    server = Server(repository)
    module = load_router(repository / name / "1" / "model.py", fake_pb_utils(server), monkeypatch)
    model = module.TritonPythonModel()
    model.initialize({"model_config": model_config_json(repository / name / "config.pbtxt"),
                      "model_name": name, "model_version": "1", "model_instance_kind": "CPU",
                      "model_repository": str(repository / name)})
    deadline = time.monotonic() + 60
    while getattr(model, "_calibrating", False):  # the adaptive policy's service times, measured through BLS
        assert time.monotonic() < deadline, "the router did not finish measuring its budgets"
        time.sleep(0.01)
    server.calls.clear()  # what the tests count: their own requests' calls
    return model, server


def execute(model, requests: list[Request], timeout_s: float = 60.0) -> list[InferenceResponse]:
    """One ``execute`` call, as the server makes it, then every request's response once all are sent."""
    assert model.execute(requests) is None  # answers go through the response senders
    deadline = time.monotonic() + timeout_s
    while not all(hasattr(r, "response") for r in requests):
        assert time.monotonic() < deadline, "the router did not answer every request"
        time.sleep(0.001)
    return [r.response for r in requests]
