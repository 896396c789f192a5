"""Hugging Face ``DistilBertModel``: q_lin / k_lin / v_lin / out_lin attention, ffn.lin1 / lin2 MLP."""

from __future__ import annotations

from torch import nn
from transformers import DistilBertModel
from transformers.models.distilbert.modeling_distilbert import TransformerBlock

from elastic_export.adapters.base import (
    HEADS,
    NEURONS,
    LinearRole,
    UnitGroup,
    bias_only_forward,
    register_block,
)
from elastic_export.adapters.hf_bert import HFBertAdapter
from elastic_export.adapters.registry import register_adapter


@register_block(TransformerBlock)
def describe_distilbert_block(block: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    """Heads of ``block.attention`` and neurons of ``block.ffn`` (post-norm block, like BERT)."""
    attn, ffn = block.attention, block.ffn

    def resize(n: int) -> None:
        attn.n_heads = n  # forward infers the head count (view(..., -1, head_size))
        if n == 0:
            attn.forward = bias_only_forward(attn.out_lin)

    heads = UnitGroup(
        kind=HEADS,
        count=attn.n_heads,
        width=attn.attention_head_size,
        producers=[LinearRole(attn.q_lin, "out"), LinearRole(attn.k_lin, "out"), LinearRole(attn.v_lin, "out")],
        consumer=LinearRole(attn.out_lin, "in"),
        module=attn,
        resize=resize,
    )
    neurons = UnitGroup(
        kind=NEURONS,
        count=ffn.lin1.out_features,
        width=1,
        producers=[LinearRole(ffn.lin1, "out")],
        consumer=LinearRole(ffn.lin2, "in"),
        module=ffn,
    )
    return heads, neurons


@register_adapter(DistilBertModel)
class HFDistilBertAdapter(HFBertAdapter):
    """Hugging Face ``DistilBertModel``: inputs ``input_ids`` and ``attention_mask`` (no token
    types); outputs ``last_hidden_state`` (+ ``sentence_embedding`` from a sentence-transformers
    pooling config). Everything else as for BERT (``config.hidden_size`` maps to ``dim``)."""

    label = "Hugging Face DistilBertModel"

    def has_token_types(self, model: nn.Module) -> bool:
        return False
