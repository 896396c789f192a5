"""Hugging Face ``MPNetModel`` (e.g. sentence-transformers all-mpnet-base-v2).

The blocks are BERT-like (``attention.attn.{q,k,v,o}``, ``intermediate.dense`` / ``output.dense``),
plus a relative position bias of shape (batch, heads, N, N) that the encoder computes *once*, from
its own ``relative_attention_bias`` embedding, and adds to the attention scores of every layer. The
bias has one row per head, so a layer whose heads are permuted or sliced must read the rows of its
own heads in its own order. Each layer's self-attention therefore gets a non-persistent buffer
``bias_heads`` (initially ``arange(heads)``) and a forward pre-hook that gathers those rows of the
shared bias; the buffer is an :class:`IndexRole` of the heads (permuted and sliced with them), and in
ONNX it is the index initializer of one ``Gather(axis=1)`` per layer, which the passes cut too.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import MPNetModel
from transformers.models.mpnet.modeling_mpnet import MPNetLayer

from elastic_export.models.adapters.base import IndexRole, UnitGroup, mlp_neurons, qkv_heads, register_block
from elastic_export.models.adapters.hf_bert import HFBertAdapter
from elastic_export.models.adapters.registry import register_adapter

BIAS_HEADS = "bias_heads"


def _gather_bias_heads(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of ``MPNetSelfAttention(hidden, mask, position_bias)``: keep the bias rows
    of this layer's heads, in this layer's order (``position_bias`` given by position or name)."""
    index = getattr(module, BIAS_HEADS)
    if kwargs.get("position_bias") is not None:
        return args, {**kwargs, "position_bias": torch.index_select(kwargs["position_bias"], 1, index)}
    if len(args) < 3 or args[2] is None:
        return None
    return (*args[:2], torch.index_select(args[2], 1, index), *args[3:]), kwargs


def _bias_heads(sa: nn.Module) -> IndexRole:
    """The layer's bias-row index, installed on first use (identity: the model is unchanged)."""
    if BIAS_HEADS not in sa._buffers:
        device = sa.q.weight.device
        sa.register_buffer(BIAS_HEADS, torch.arange(sa.num_attention_heads, device=device), persistent=False)
        sa.register_forward_pre_hook(_gather_bias_heads, with_kwargs=True)
    return IndexRole(sa, BIAS_HEADS)


@register_block(MPNetLayer)
def describe_mpnet_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    """Heads of ``attention.attn`` (q / k / v / o, plus their rows of the shared position bias) and
    neurons of ``intermediate.dense`` -> ``output.dense`` (post-norm block, like BERT)."""
    sa = layer.attention.attn
    heads = qkv_heads(sa, sa.q, sa.k, sa.v, sa.o, "num_attention_heads", sa.attention_head_size)
    set_count = heads.resize

    def resize(n: int) -> None:
        set_count(n)
        sa.all_head_size = n * sa.attention_head_size  # the head-merge view reads it

    heads.resize = resize
    heads.shared_rows = [_bias_heads(sa)]
    return heads, mlp_neurons(layer.intermediate, layer.intermediate.dense, layer.output.dense)


@register_adapter(MPNetModel)
class HFMPNetAdapter(HFBertAdapter):
    """Hugging Face ``MPNetModel``: inputs ``input_ids`` and ``attention_mask`` (no token types);
    outputs ``last_hidden_state`` (+ ``sentence_embedding`` from a sentence-transformers pooling
    config), as for BERT."""

    label = "Hugging Face MPNetModel"

    def has_token_types(self, model: nn.Module) -> bool:
        return False
