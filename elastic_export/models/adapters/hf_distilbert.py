"""Hugging Face ``DistilBertModel``: q_lin / k_lin / v_lin / out_lin attention, ffn.lin1 / lin2 MLP."""

from __future__ import annotations

from torch import nn
from transformers import DistilBertModel
from transformers.models.distilbert.modeling_distilbert import TransformerBlock

from elastic_export.models.adapters.base import UnitGroup, mlp_neurons, qkv_heads, register_block
from elastic_export.models.adapters.hf_bert import HFBertAdapter
from elastic_export.models.adapters.registry import register_adapter


@register_block(TransformerBlock)
def describe_distilbert_block(block: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    """Heads of ``block.attention`` and neurons of ``block.ffn`` (post-norm block, like BERT)."""
    attn, ffn = block.attention, block.ffn
    return (qkv_heads(attn, attn.q_lin, attn.k_lin, attn.v_lin, attn.out_lin, "n_heads", attn.attention_head_size),
            mlp_neurons(ffn, ffn.lin1, ffn.lin2))


@register_adapter(DistilBertModel)
class HFDistilBertAdapter(HFBertAdapter):
    """Hugging Face ``DistilBertModel``: inputs ``input_ids`` and ``attention_mask`` (no token
    types); outputs ``last_hidden_state`` (+ ``sentence_embedding`` from a sentence-transformers
    pooling config). Everything else as for BERT (``config.hidden_size`` maps to ``dim``)."""

    label = "Hugging Face DistilBertModel"

    def has_token_types(self, model: nn.Module) -> bool:
        return False
