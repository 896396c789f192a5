"""elastic-export router for Triton's Python backend: one request, one budget model.

This file is copied verbatim into ``<repository>/<name>/1/model.py`` by ``elastic-export build
--target triton`` (:func:`elastic_export.targets.triton.build_repository`); it is also an ordinary
module of the package (``elastic_export.targets.triton_router``), linted and unit-tested. It imports
the standard library and numpy only (what every Triton container's Python has), plus Triton's
in-server ``triton_python_backend_utils`` when that exists: outside a server the budget choice and
the configuration reading work, and the model class needs the server.

Everything that differs between repositories lives in the router's ``config.pbtxt``: its
``parameters`` ``budget_models`` (JSON ``[[sparsity, model name], ...]``) and ``default_sparsity``,
and its ``input`` / ``output`` lists (forwarded to the budget model, less :data:`SPARSITY_INPUT`
and :data:`SERVED_OUTPUT`). Triton hands that config to :meth:`TritonPythonModel.initialize` as
JSON (``args["model_config"]``).

Rule: a requested sparsity within :data:`TOLERANCE` of a served budget gets that budget; otherwise
the smallest served budget whose sparsity is *at least* the requested one (more savings, never
less). A request outside [0, 1), not a number, or sparser than the sparsest served budget is
refused with :class:`BudgetError` (the router answers it with an error response). No request
(no ``sparsity`` input and no ``sparsity`` request parameter) gets the configured default.
"""

import asyncio
import json
import math
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # outside a Triton server (the builder, the tests): no model class at work
    pb_utils = None

TOLERANCE = 1e-6
PARAMETER = "sparsity"
SPARSITY_INPUT = "sparsity"
SERVED_OUTPUT = "served_sparsity"
MODELS_PARAMETER = "budget_models"
DEFAULT_PARAMETER = "default_sparsity"


class BudgetError(ValueError):
    """A requested sparsity the router cannot serve (the message goes back to the client)."""


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise BudgetError(f"{where}: {value!r} is not a number")
    try:
        s = float(value)
    except (TypeError, ValueError):
        raise BudgetError(f"{where}: {value!r} is not a number") from None
    if not math.isfinite(s):
        raise BudgetError(f"{where}: {value!r} is not a finite number")
    return s


def choose_budget(requested: Optional[float], sparsities: Sequence[float], default: float) -> float:
    """The served budget for a requested sparsity.

    Args:
        requested: the sparsity asked for (fraction of prunable FLOPs removed), or None for the
            default.
        sparsities: the served budgets' sparsities (any order; 0.0 is the dense model).
        default: the budget served when nothing is requested (one of ``sparsities``).

    Returns:
        An element of ``sparsities``: the one within :data:`TOLERANCE` of ``requested``, else the
        smallest one above it.

    Raises:
        BudgetError: ``requested`` outside [0, 1) or above the sparsest served budget, or no budgets.
    """
    served = sorted(float(s) for s in sparsities)
    if not served:
        raise BudgetError("no budgets are served")
    if requested is None:
        return float(default)
    s = _number(requested, "sparsity")
    if not 0.0 <= s < 1.0:
        raise BudgetError(f"sparsity {s:g} is outside [0, 1); served budgets: {_listing(served)}")
    for b in served:
        if abs(b - s) <= TOLERANCE:
            return b
    for b in served:
        if b >= s:
            return b
    raise BudgetError(f"sparsity {s:g} is above the sparsest served budget {served[-1]:g}; "
                      f"served budgets: {_listing(served)}")


def requested_sparsity(values: Optional[Sequence[Any]], parameters: Optional[str]) -> Optional[float]:
    """The sparsity a request asks for: its ``sparsity`` input, else its ``sparsity`` parameter.

    Args:
        values: the flattened ``sparsity`` input tensor (one value per batch row), or None when the
            request has no such input. Every row must ask for the same sparsity.
        parameters: the request's parameters as a JSON object string (Triton's
            ``request.parameters()``), or None / empty.

    Returns:
        The requested sparsity, or None when the request names none (the router's default applies).

    Raises:
        BudgetError: rows that disagree, an empty input, or a value / parameter that is not a number.
    """
    if values is not None:
        rows = [_number(v, "sparsity input") for v in values]
        if not rows:
            raise BudgetError("sparsity input is empty")
        if any(abs(r - rows[0]) > TOLERANCE for r in rows[1:]):
            raise BudgetError("sparsity input: every row of one request must ask for the same sparsity "
                              f"(got {_listing(sorted(set(rows)))}); send one request per budget")
        return rows[0]
    if not parameters:
        return None
    try:
        params = json.loads(parameters)
    except ValueError:
        raise BudgetError("request parameters are not a JSON object") from None
    if not isinstance(params, dict) or params.get(PARAMETER) is None:
        return None
    return _number(params[PARAMETER], "sparsity parameter")


def _listing(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


# --- configuration: the router's config.pbtxt, as Triton passes it (JSON) ------------------------
class RouterConfig:
    """What the router reads from its model config (``json.loads(args["model_config"])``).

    Attributes:
        models: served sparsity -> budget model name.
        sparsities: the served sparsities, ascending.
        default: the sparsity served when a request names none.
        inputs: the input names forwarded to the budget model.
        outputs: the output names the budget model answers with.
    """

    def __init__(self, model_config: Dict[str, Any]):
        params = {k: (v or {}).get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        self.models = {float(s): str(n) for s, n in _table(params.get(MODELS_PARAMETER))}
        self.sparsities = sorted(self.models)
        if not self.sparsities:
            raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r} lists no budget models")
        default = params.get(DEFAULT_PARAMETER)
        self.default = choose_budget(_number(default, DEFAULT_PARAMETER) if default else self.sparsities[0],
                                     self.sparsities, self.sparsities[0])
        self.inputs = [t["name"] for t in model_config.get("input", []) if t["name"] != SPARSITY_INPUT]
        self.outputs = [t["name"] for t in model_config.get("output", []) if t["name"] != SERVED_OUTPUT]

    def route(self, values: Optional[Sequence[Any]], parameters: Optional[str]) -> float:
        """The served sparsity of one request (see :func:`requested_sparsity`); raises :class:`BudgetError`."""
        return choose_budget(requested_sparsity(values, parameters), self.sparsities, self.default)


def _table(text: Optional[str]) -> List[List[Any]]:
    """The ``budget_models`` parameter: a JSON list of ``[sparsity, model name]`` pairs."""
    if not text:
        raise ValueError(f"config.pbtxt has no parameter {MODELS_PARAMETER!r}")
    try:
        table = json.loads(text)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r} is not JSON: {text[:80]!r}") from None
    if not isinstance(table, list) or not all(isinstance(p, list) and len(p) == 2 for p in table):
        raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r}: expected [[sparsity, model name], ...]")
    return table


# --- the router (Triton Python backend, business-logic scripting) -------------------------------
def _error(message: str) -> Any:
    code = getattr(getattr(pb_utils, "TritonError", None), "INVALID_ARG", None)
    try:
        return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)
    except TypeError:  # an older backend without error codes
        return pb_utils.TritonError(message)


class TritonPythonModel:
    """Forwards each request to the budget model its requested sparsity selects."""

    def initialize(self, args: Dict[str, str]) -> None:
        if pb_utils is None:
            raise RuntimeError("the router runs inside Triton's Python backend (triton_python_backend_utils)")
        self.config = RouterConfig(json.loads(args["model_config"]))

    async def execute(self, requests: List[Any]) -> List[Any]:
        # every request is forwarded at once, so the budget models' dynamic batchers see them together
        return list(await asyncio.gather(*(self._forward(r) for r in requests)))

    async def _forward(self, request: Any) -> Any:
        try:
            tensor = pb_utils.get_input_tensor_by_name(request, SPARSITY_INPUT)
            values = None if tensor is None else tensor.as_numpy().reshape(-1).tolist()
            params = request.parameters() if hasattr(request, "parameters") else None
            sparsity = self.config.route(values, params)
        except BudgetError as e:
            return pb_utils.InferenceResponse(output_tensors=[], error=_error(str(e)))
        inputs = [t for t in (pb_utils.get_input_tensor_by_name(request, n) for n in self.config.inputs) if t is not None]
        wanted = set(request.requested_output_names()) if hasattr(request, "requested_output_names") else set()
        names = [n for n in self.config.outputs if not wanted or n in wanted]
        forward = pb_utils.InferenceRequest(model_name=self.config.models[sparsity], requested_output_names=names,
                                            inputs=inputs)
        response = await forward.async_exec()
        if response.has_error():
            return pb_utils.InferenceResponse(output_tensors=[], error=response.error())
        tensors = [pb_utils.get_output_tensor_by_name(response, n) for n in names]
        if not wanted or SERVED_OUTPUT in wanted:
            batch = inputs[0].as_numpy().shape[0] if inputs else 1
            tensors.append(pb_utils.Tensor(SERVED_OUTPUT, np.full((batch, 1), sparsity, dtype=np.float32)))
        return pb_utils.InferenceResponse(output_tensors=[t for t in tensors if t is not None])

    def finalize(self) -> None:
        pass
