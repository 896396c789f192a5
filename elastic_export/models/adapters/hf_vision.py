"""Hugging Face vision encoders: ``ViTModel``, ``Dinov2Model`` (plain MLP or SwiGLU, layer scale) and
``DINOv3ViTModel`` (RoPE, register tokens, layer scale, plain or gated MLP)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Dinov2Model, DINOv3ViTModel, ViTModel
from transformers.models.dinov2.modeling_dinov2 import Dinov2Layer
from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTLayer
from transformers.models.vit.modeling_vit import ViTLayer

from elastic_export.models.adapters.base import (
    InputSpec,
    UnitGroup,
    gated_neurons,
    mlp_neurons,
    qkv_heads,
    register_block,
)
from elastic_export.models.adapters.registry import ModelAdapter, register_adapter


def _hf_heads(attn: nn.Module) -> UnitGroup:
    count_attr = "num_attention_heads" if hasattr(attn, "num_attention_heads") else "num_heads"
    return qkv_heads(attn, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, count_attr, attn.head_dim)


def _hf_neurons(mlp: nn.Module) -> UnitGroup:
    """Gated MLP (``gate_proj``, ``up_proj``, ``down_proj``: DINOv2 SwiGLU, DINOv3 gated) or plain
    (``fc1`` / ``fc2``, DINOv3: ``up_proj`` / ``down_proj``)."""
    if hasattr(mlp, "gate_proj"):
        return gated_neurons(mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    if hasattr(mlp, "up_proj"):
        return mlp_neurons(mlp, mlp.up_proj, mlp.down_proj)
    return mlp_neurons(mlp, mlp.fc1, mlp.fc2)


@register_block(ViTLayer, Dinov2Layer, DINOv3ViTLayer)
def describe_hf_vision_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    return _hf_heads(layer.attention), _hf_neurons(layer.mlp)


class _VisionExport(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor):
        out = self.model(pixel_values=pixel_values)
        if getattr(out, "pooler_output", None) is None:
            return (out.last_hidden_state,)
        return out.last_hidden_state, out.pooler_output


@register_adapter(ViTModel, Dinov2Model, DINOv3ViTModel)
class HFVisionAdapter(ModelAdapter):
    """Hugging Face ``ViTModel``, ``Dinov2Model`` and ``DINOv3ViTModel``: N = patches + class token
    + register tokens; ``pooler_output`` is the normed class token (ViT: its pooler, if any)."""

    label = "Hugging Face ViTModel / Dinov2Model / DINOv3ViTModel"
    modality = "image"

    def width(self, model: nn.Module) -> int:
        return model.config.hidden_size

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        s = model.config.image_size
        return (s, s) if isinstance(s, int) else tuple(s)

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        h, w = self.image_size(model)
        p = model.config.patch_size
        p = (p, p) if isinstance(p, int) else p
        return (h // p[0]) * (w // p[1]) + 1 + getattr(model.config, "num_register_tokens", 0)

    def input_specs(self, model: nn.Module) -> list[InputSpec]:
        h, w = self.image_size(model)
        return [InputSpec("pixel_values", "float32", ["batch", model.config.num_channels, h, w])]

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        pooled = isinstance(model, (Dinov2Model, DINOv3ViTModel)) or getattr(model, "pooler", None) is not None
        return ["last_hidden_state"] + (["pooler_output"] if pooled else [])

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        return _VisionExport(model)

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        (h, w), c = self.image_size(model), model.config.num_channels
        return {"pixel_values": torch.randn(batch, c, h, w, generator=generator)}
