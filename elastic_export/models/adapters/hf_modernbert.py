"""Hugging Face ``ModernBertModel``: fused ``Wqkv`` attention with RoPE, alternating global /
sliding-window layers, GeGLU MLP with a fused input projection ``Wi``.

Units:

* head h: its rows of ``Wqkv`` in each of the three packed (q, k, v) groups — the forward views
  the projection as ``(..., 3, heads, head_dim)`` — plus its ``head_dim`` input columns of the
  attention's ``Wo``. On a local layer a query reads the keys within ``config.sliding_window``
  (= ``local_attention // 2``) positions on either side: ``2·(local_attention // 2) + 1`` keys at
  most, the head's ``window``.
* neuron j: rows j and I + j of ``Wi`` (``input, gate = Wi(x).chunk(2)``; the output is
  ``act(input) * gate``) plus column j of the MLP's ``Wo`` — a gated neuron, cost ``6·D·N``.

The attention has no head-count attribute (it views with ``-1`` and merges with ``-1``), so only
0 heads need care: the attention then contributes ``Wo``'s bias alone. Exported and referenced
through the padded eager attention (a 4-D additive mask per layer type), never flash-attention.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import ModernBertModel
from transformers.models.modernbert.modeling_modernbert import ModernBertEncoderLayer

from elastic_export.models.adapters.base import (
    HEADS,
    NEURONS,
    LinearRole,
    UnitGroup,
    bias_only_forward,
    register_block,
)
from elastic_export.models.adapters.hf_bert import HFBertAdapter, TextExport
from elastic_export.models.adapters.registry import register_adapter


def attention_window(config: Any, layer_type: str) -> int | None:
    """Keys a query reads at most on a layer of ``layer_type``: ``2·sliding_window + 1`` on a
    ``sliding_attention`` layer (the mask keeps ``|q - k| <= sliding_window``), None on a global one."""
    if layer_type != "sliding_attention":
        return None
    return 2 * int(config.sliding_window) + 1


def _heads(layer: nn.Module) -> UnitGroup:
    attn = layer.attn

    def resize(n: int) -> None:
        if n == 0:  # a 0-wide view(..., 3, -1, head_dim) cannot be reshaped
            attn.forward = bias_only_forward(attn.Wo)

    return UnitGroup(
        kind=HEADS,
        count=attn.Wo.in_features // attn.head_dim,
        width=attn.head_dim,
        producers=[LinearRole(attn.Wqkv, "out", groups=3)],
        consumer=LinearRole(attn.Wo, "in"),
        module=attn,
        resize=resize,
        window=attention_window(layer.config, layer.attention_type),
    )


def _neurons(mlp: nn.Module) -> UnitGroup:
    return UnitGroup(
        kind=NEURONS,
        count=mlp.Wo.in_features,
        width=1,
        producers=[LinearRole(mlp.Wi, "out", groups=2)],
        consumer=LinearRole(mlp.Wo, "in"),
        module=mlp,
        swiglu=True,
    )


@register_block(ModernBertEncoderLayer)
def describe_modernbert_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    """Heads of ``layer.attn`` (fused ``Wqkv``, sliding window on local layers), GeGLU neurons of ``layer.mlp``."""
    return _heads(layer), _neurons(layer.mlp)


@register_adapter(ModernBertModel)
class HFModernBertAdapter(HFBertAdapter):
    """ModernBERT: inputs ``input_ids``, ``attention_mask`` (no token types); outputs
    ``last_hidden_state`` (+ ``sentence_embedding`` with a sentence-transformers pooling config)."""

    label = "Hugging Face ModernBertModel"

    def has_token_types(self, model: nn.Module) -> bool:
        return False

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        """The padded eager attention (switched to it when the model was built with another one):
        what the ONNX export traces and the reference computes."""
        if model.config._attn_implementation != "eager":
            model.set_attn_implementation("eager")
        return TextExport(model, False, extras.get("pooling"), bool(extras.get("normalize")))
