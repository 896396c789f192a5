"""timm ``Eva`` (``eva02_*``, ``vit_*_rope_*``, timm's DINOv3 ``vit_*_dinov3``, Perception Encoder
``vit_pe_*``): pre-norm ``EvaBlock`` and post-norm ``EvaBlockPostNorm``.

Attention: ``EvaAttention`` (fused ``qkv`` whose bias is stored apart as ``q_bias`` / ``k_bias`` /
``v_bias``, or separate q/k/v) or ``AttentionRope``; RoPE, class / register tokens, layer scale
and qk-norm (one norm per head, shared by all heads) change no unit. MLP: ``Mlp``, ``SwiGLU``,
packed ``GluMlp``. The units are those of :mod:`elastic_export.models.adapters.timm_vit`.

Refused, with a one-line error, because a unit would no longer be separable:
``scale_mlp`` (a LayerNorm over all MLP hidden units: ``eva02_base/large_*``), ``scale_attn_inner``
(a norm over all heads' outputs: ``eva02_*_clip``), per-head RoPE frequencies (``rope_type='mixed'``:
``vit_*_rope_mixed_*``), grouped-query attention and gated attention.
"""

from __future__ import annotations

import types

import torch
from timm.layers import AttentionRope
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from torch import nn

from elastic_export.models.adapters.base import UnitGroup, register_block, unsupported_option
from elastic_export.models.adapters.registry import register_adapter
from elastic_export.models.adapters.timm_vit import TimmViTAdapter, timm_heads, timm_neurons

FAMILY = "timm Eva"


def _as_attention_rope(attn: nn.Module) -> None:
    """Make a sliced ``EvaAttention`` run ``AttentionRope.forward`` (the same computation; EVA's
    own forward merges heads back to the *input* width, which slicing changed): its separate
    biases join ``qkv.bias`` and the head-count attributes ``AttentionRope`` reads are set."""
    if attn.qkv is not None and attn.q_bias is not None:
        with torch.no_grad():
            bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias)).clone()
        attn.qkv.bias = nn.Parameter(bias, requires_grad=attn.q_bias.requires_grad)
        attn.q_bias = attn.k_bias = attn.v_bias = None
    attn.forward = types.MethodType(AttentionRope.forward, attn)


def _eva_heads(attn: nn.Module) -> UnitGroup:
    if not isinstance(attn, (EvaAttention, AttentionRope)):
        unsupported_option(f"attention type {type(attn).__name__}", FAMILY)

    def resize(n: int) -> None:
        attn.num_heads = attn.num_kv_heads = n
        attn.attn_dim = attn.kv_dim = n * attn.head_dim
        attn.num_kv_groups = 1
        if isinstance(attn, EvaAttention):
            _as_attention_rope(attn)

    return timm_heads(attn, FAMILY, resize)


@register_block(EvaBlock, EvaBlockPostNorm)
def describe_eva_block(block: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    return _eva_heads(block.attn), timm_neurons(block.mlp, FAMILY)


@register_adapter(Eva)
class TimmEvaAdapter(TimmViTAdapter):
    """timm ``Eva``: inputs, outputs and token count as for timm ``VisionTransformer``
    (N = patches + class + register tokens; ``pooler_output`` is timm's pre-logits)."""

    label = "timm Eva (eva02_tiny/small_*, vit_*_rope_*, vit_*_dinov3*, vit_pe_*)"

    def check(self, model: nn.Module) -> None:
        if getattr(model, "rope_mixed", False):
            unsupported_option("per-head RoPE frequencies (rope_type='mixed')", FAMILY)
