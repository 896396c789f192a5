"""The model-level adapter interface and its registry (keyed by model class)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from elastic_export.models.adapters.base import InputSpec

ADAPTERS: dict[type, "ModelAdapter"] = {}
REFUSED: dict[type, str] = {}  # model class -> why it is not supported (named in the error)
TOWERS: dict[type, Callable[[nn.Module, str], nn.Module]] = {}  # dual encoder -> (model, tower) -> tower
TOWER_NAMES = ("text", "vision")


class ModelAdapter:
    """How to drive one family of encoders: inputs, outputs, token count.

    Subclasses set ``label`` and ``modality`` and implement the methods below.
    """

    label: str = ""
    modality: str = ""  # "text" or "image"

    def check(self, model: nn.Module) -> None:
        """Raise ``UserError`` for a model-level option whose units cannot be sliced one by one
        (block-level options are refused by the block describers). Default: nothing to refuse."""

    def width(self, model: nn.Module) -> int:
        """Model width D."""
        raise NotImplementedError

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        """Nominal token count N used for FLOP accounting."""
        raise NotImplementedError

    def input_specs(self, model: nn.Module) -> list[InputSpec]:
        raise NotImplementedError

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def embedding_output(self, model: nn.Module, extras: dict[str, Any]) -> str | None:
        """Name of the output that is the model's embedding (what the ranking distils), or None
        for the attention-masked token mean of ``last_hidden_state``.

        Default: ``sentence_embedding``, else ``pooler_output``, when the model has it.
        """
        names = self.output_names(model, extras)
        return next((n for n in ("sentence_embedding", "pooler_output") if n in names), None)

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        """A module whose ``forward(*inputs)`` (in :meth:`input_specs` order) returns a tuple of
        outputs (in :meth:`output_names` order)."""
        raise NotImplementedError

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        """Random but valid inputs (text rows get varied padding)."""
        raise NotImplementedError


class EmbedderAdapter(ModelAdapter):
    """A text embedder with inputs ``input_ids``, ``attention_mask`` and outputs
    ``last_hidden_state``, ``sentence_embedding`` (its pooled text embedding); N = ``--seq-len``."""

    modality = "text"

    def width(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        return seq_len

    def input_specs(self, model: nn.Module) -> list[InputSpec]:
        return [InputSpec(n, "int64", ["batch", "sequence"]) for n in ("input_ids", "attention_mask")]

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        return ["last_hidden_state", "sentence_embedding"]


def register_adapter(*types: type) -> Callable[[type[ModelAdapter]], type[ModelAdapter]]:
    def deco(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        inst = cls()
        for t in types:
            ADAPTERS[t] = inst
        return cls

    return deco


def refuse_model(cls: type, why: str) -> None:
    """Make ``adapter_for`` refuse models of ``cls`` with a reason instead of "unsupported"."""
    REFUSED[cls] = why


def register_towers(*types: type) -> Callable[[Callable], Callable]:
    """Register ``fn(model, tower) -> module`` for dual encoders (CLIP, SigLIP): ``tower`` is
    ``"text"`` or ``"vision"`` and the module it returns has an adapter of its own."""

    def deco(fn: Callable[[nn.Module, str], nn.Module]) -> Callable[[nn.Module, str], nn.Module]:
        for t in types:
            TOWERS[t] = fn
        return fn

    return deco
