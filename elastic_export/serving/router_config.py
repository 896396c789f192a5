"""The router's configuration: its ``config.pbtxt`` as Triton passes it to ``initialize`` (JSON), read once.

Everything that differs between repositories lives there: the ``parameters`` (``budget_models``: JSON
``[[sparsity, model name], ...]``; ``default_sparsity``; ``policy``; ``slo_ms``, ``slo_quantile``,
``max_sparsity``; ``precision``; ``max_rows`` ...) and the ``input`` / ``output`` lists (forwarded to the
budget model, less the router's own tensors). The builder (:mod:`elastic_export.targets.triton`) writes
them with the names defined here; :class:`RouterConfig` reads them back, and maps the requests' named
sparsities through the one rule (:func:`elastic_export.serving.router_budgets.choose_budget`).

Standard library only (copied next to the router's ``model.py``, as :mod:`~elastic_export.serving.router_budgets`).
"""

import json
from typing import Any, Dict, List, Optional

try:
    from elastic_export.serving.length_groups import row_outputs
    from elastic_export.serving.router_budgets import choose_budget, number
except ImportError:  # a copy next to the router's model.py, in a Python without this package
    from length_groups import row_outputs
    from router_budgets import choose_budget, number

SPARSITY_INPUT = "sparsity"
TEXT_INPUT = "text"
SERVED_OUTPUT = "served_sparsity"
PRECISION_OUTPUT = "served_precision"
OWN_TENSORS = (SPARSITY_INPUT, TEXT_INPUT, SERVED_OUTPUT, PRECISION_OUTPUT)
MODELS_PARAMETER = "budget_models"
DEFAULT_PARAMETER = "default_sparsity"
POLICY_PARAMETER = "policy"
SLO_PARAMETER = "slo_ms"
PRECISION_PARAMETER = "precision"
READY_TIMEOUT_PARAMETER = "ready_timeout_s"
CONCURRENCY_PARAMETER = "max_concurrency"
INLINE_PARAMETER = "inline"  # "1": the router runs a request itself when it has nothing else in flight
QUANTILE_PARAMETER = "slo_quantile"
MAX_SPARSITY_PARAMETER = "max_sparsity"
MAX_ROWS_PARAMETER = "max_rows"  # the budget models' max_batch_size: larger requests are refused
TOKENS_PARAMETER = "warmup_tokens"  # the model's nominal tokens (the latency model's measurements)
DEFAULT_CONCURRENCY = 64
DEFAULT_QUANTILE = 0.99
DEFAULT_MAX_ROWS = 128
POLICIES = ("fixed", "adaptive")  # as elastic_export.serving.policies.ROUTER_POLICIES (the builder checks)
CHOSEN_MEMORY = 1024  # requested sparsities RouterConfig.route remembers the served budget of


class RouterConfig:
    """What the router reads from its model config (``json.loads(args["model_config"])``).

    Attributes:
        models: served sparsity -> budget model name.
        sparsities: the served sparsities, ascending.
        default: the sparsity served when a request names none (``policy: fixed``).
        policy: ``fixed`` or ``adaptive``.
        slo_ms: the latency objective of the adaptive policy (None: none).
        precision: the precision the budget models serve (``fp32`` / ``fp16``).
        inputs: the input names forwarded to the budget model.
        outputs: the output names the budget model answers with.
        row_outputs: those of one vector per row (no token axis): a batch asking only for them runs in
            groups of similar length (:mod:`~elastic_export.serving.length_groups`).
        text: whether the config declares the ``text`` input.
        ready_timeout_s: how long ``initialize`` waits for the budget models to be ready.
        max_concurrency: requests the router works on at once (its worker threads); more wait.
        inline: run a request on the budget's ``model.onnx`` in the router's own process when nothing
            else is in flight (see :class:`~elastic_export.targets.triton_router.TritonPythonModel`).
        slo_quantile: the latency quantile the SLO bounds (0.99: p99).
        max_sparsity: the adaptive policy's quality floor (None: every budget).
        max_rows: the largest request (rows) the router accepts: the budget models' ``max_batch_size``.
        tokens: the model's nominal tokens (the free dims of the latency model's measurements).
        input_specs: the forwarded inputs' config entries (name, data_type, dims).
        parameters: every parameter, as text (the inline sessions read theirs: threads, spinning,
            warm-up length, as the python budget models do).

    Raises:
        ValueError: a parameter missing or malformed (the router then fails to load).
    """

    def __init__(self, model_config: Dict[str, Any]):
        params = {k: (v or {}).get("string_value", "") for k, v in (model_config.get("parameters") or {}).items()}
        self.models = {float(s): str(n) for s, n in _table(params.get(MODELS_PARAMETER))}
        self._chosen: Dict[Any, float] = {}  # requested sparsity -> served (route's memory)
        self.sparsities = sorted(self.models)
        if not self.sparsities:
            raise ValueError(f"config.pbtxt parameter {MODELS_PARAMETER!r} lists no budget models")
        default = params.get(DEFAULT_PARAMETER)
        self.default = choose_budget(number(default, DEFAULT_PARAMETER) if default else self.sparsities[0],
                                     self.sparsities, self.sparsities[0])
        self.policy = params.get(POLICY_PARAMETER) or "fixed"
        if self.policy not in POLICIES:
            raise ValueError(f"config.pbtxt parameter {POLICY_PARAMETER!r}: {self.policy!r}, not one of {POLICIES}")
        self._read_serving(params)
        self.parameters = params
        specs = model_config.get("input", [])
        names = [t["name"] for t in specs]
        self.text = TEXT_INPUT in names
        self.inputs = [n for n in names if n not in OWN_TENSORS]
        self.input_specs = [t for t in specs if t["name"] in self.inputs]
        self.outputs = [t["name"] for t in model_config.get("output", []) if t["name"] not in OWN_TENSORS]
        self.row_outputs = row_outputs(model_config) & set(self.outputs)

    def _read_serving(self, params: Dict[str, str]) -> None:
        """The SLO, precision, limits and lengths (each parameter optional, with its default)."""
        slo = params.get(SLO_PARAMETER)
        self.slo_ms = number(slo, SLO_PARAMETER) if slo else None
        self.precision = params.get(PRECISION_PARAMETER) or "fp32"
        self.ready_timeout_s = number(params.get(READY_TIMEOUT_PARAMETER) or 300, READY_TIMEOUT_PARAMETER)
        self.max_concurrency = int(number(params.get(CONCURRENCY_PARAMETER) or DEFAULT_CONCURRENCY,
                                          CONCURRENCY_PARAMETER))
        self.inline = params.get(INLINE_PARAMETER) == "1"
        self.slo_quantile = number(params.get(QUANTILE_PARAMETER) or DEFAULT_QUANTILE, QUANTILE_PARAMETER)
        if not 0 < self.slo_quantile < 1:
            raise ValueError(f"config.pbtxt parameter {QUANTILE_PARAMETER!r}: {self.slo_quantile:g} is not in (0, 1)")
        floor = params.get(MAX_SPARSITY_PARAMETER)
        self.max_sparsity = number(floor, MAX_SPARSITY_PARAMETER) if floor else None
        self.max_rows = int(number(params.get(MAX_ROWS_PARAMETER) or DEFAULT_MAX_ROWS, MAX_ROWS_PARAMETER))
        self.tokens = int(number(params.get(TOKENS_PARAMETER) or 16, TOKENS_PARAMETER))

    def route(self, rows: Optional[List[float]], chosen: Optional[float] = None) -> List[float]:
        """The served sparsity of every row: each requested one mapped by :func:`choose_budget`, or
        ``chosen`` (the policy's pick; default: the configured default) when none is named."""
        if rows is None:
            return [self.default if chosen is None else chosen]
        first = rows[0] if rows else None
        if all(r == first for r in rows):  # one budget for every row, the usual case
            return [self._choose(first)] * len(rows)
        return [self._choose(r) for r in rows]

    def _choose(self, requested: Any) -> float:
        """:func:`choose_budget`, remembered for the values requests name (at most :data:`CHOSEN_MEMORY`)."""
        served = self._chosen.get(requested)
        if served is None:
            served = choose_budget(requested, self.sparsities, self.default)
            if len(self._chosen) < CHOSEN_MEMORY:
                self._chosen[requested] = served
        return served


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
