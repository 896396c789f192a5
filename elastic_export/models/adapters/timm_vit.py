"""timm ``VisionTransformer`` (and ``VisionTransformerDistilled``, DeiT with a distillation token):
fused qkv, class / distillation / register tokens, Mlp / SwiGLU / GluMlp, layer scale."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from elastic_export.models.adapters.base import (
    HEADS,
    NEURONS,
    InputSpec,
    LinearRole,
    UnitGroup,
    check_identity,
    register_block,
    unsupported_option,
)
from elastic_export.models.adapters.registry import ModelAdapter, register_adapter

try:  # timm is a hard dependency, but keep the import error readable
    from timm.layers import Attention as TimmAttention
    from timm.layers import GluMlp, Mlp, SwiGLU
    from timm.models.vision_transformer import Block as TimmBlock
    from timm.models.vision_transformer import VisionTransformer
except ImportError:  # pragma: no cover
    raise


def _qkv_producers(attn: nn.Module) -> list[LinearRole]:
    """The q/k/v producers of a timm attention: one fused ``qkv`` (3 packed groups; its bias may be
    stored apart as ``q_bias`` / ``k_bias`` / ``v_bias``, as in ``EvaAttention``) or separate
    ``q_proj`` / ``k_proj`` / ``v_proj``."""
    if getattr(attn, "qkv", None) is None:
        return [LinearRole(attn.q_proj, "out"), LinearRole(attn.k_proj, "out"), LinearRole(attn.v_proj, "out")]
    parts = ()
    if getattr(attn, "q_bias", None) is not None:
        parts = ((attn, "q_bias"), (attn, "k_bias"), (attn, "v_bias"))
    return [LinearRole(attn.qkv, "out", groups=3, bias_parts=parts)]


def timm_heads(attn: nn.Module, family: str = "timm ViT", resize: Callable[[int], None] | None = None) -> UnitGroup:
    """The heads of a timm attention module (``Attention``, ``AttentionRope``, ``EvaAttention``).

    Args:
        attn: the attention module.
        family: names the model family in the error for an option that cannot be sliced.
        resize: sets the head count after slicing (default: ``num_heads`` and ``attn_dim``).
    """
    if not check_identity(attn.norm):
        unsupported_option("attention scale_norm (one norm over all heads' outputs)", family)
    if getattr(attn, "gate", None) is not None:
        unsupported_option("gated attention", family)
    if getattr(attn, "num_kv_groups", 1) > 1:
        unsupported_option("grouped-query attention (num_kv_heads)", family)

    def set_heads(n: int) -> None:
        attn.num_heads = n
        attn.attn_dim = n * attn.head_dim

    return UnitGroup(
        kind=HEADS,
        count=attn.num_heads,
        width=attn.head_dim,
        producers=_qkv_producers(attn),
        consumer=LinearRole(attn.proj, "in"),
        module=attn,
        resize=resize or set_heads,
    )


def timm_neurons(mlp: nn.Module, family: str = "timm ViT") -> UnitGroup:
    if not check_identity(getattr(mlp, "norm", None)):
        unsupported_option("an MLP hidden norm (scale_mlp: one norm over all neurons)", family)
    if isinstance(mlp, SwiGLU):
        producers = [LinearRole(mlp.fc1_g, "out"), LinearRole(mlp.fc1_x, "out")]
        count, swiglu = mlp.fc2.in_features, True
    elif isinstance(mlp, GluMlp):
        producers = [LinearRole(mlp.fc1, "out", groups=2)]
        count, swiglu = mlp.fc2.in_features, True
    elif isinstance(mlp, Mlp):
        producers = [LinearRole(mlp.fc1, "out")]
        count, swiglu = mlp.fc2.in_features, False
    else:
        unsupported_option(f"MLP type {type(mlp).__name__}", family)
    for role in producers:
        if not isinstance(role.linear, nn.Linear):
            unsupported_option("a convolutional MLP", family)
    return UnitGroup(
        kind=NEURONS,
        count=count,
        width=1,
        producers=producers,
        consumer=LinearRole(mlp.fc2, "in"),
        module=mlp,
        swiglu=swiglu,
    )


@register_block(TimmBlock)
def describe_timm_block(block: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    if not isinstance(block.attn, TimmAttention):
        unsupported_option(f"attention type {type(block.attn).__name__}", "timm ViT")
    return timm_heads(block.attn), timm_neurons(block.mlp)


class _TimmExport(nn.Module):
    def __init__(self, model: nn.Module, with_logits: bool) -> None:
        super().__init__()
        self.model = model
        self.with_logits = with_logits

    def forward(self, pixel_values: torch.Tensor):
        tokens = self.model.forward_features(pixel_values)
        pooled = self.model.forward_head(tokens, pre_logits=True)
        if self.with_logits:  # forward_head, not the classifier: DeiT-distilled averages two heads
            return tokens, pooled, self.model.forward_head(tokens)
        return tokens, pooled


@register_adapter(VisionTransformer)
class TimmViTAdapter(ModelAdapter):
    """timm ``VisionTransformer`` (ViT, DeiT incl. distilled, ViT with registers, SwiGLU ViT, layer-scale ViT).

    ``VisionTransformerDistilled`` is a subclass, found through the class hierarchy: its
    ``num_prefix_tokens`` (2) counts the distillation token, and ``pooler_output`` is timm's
    pre-logits (mean of the class and distillation tokens).
    """

    label = "timm VisionTransformer (vit_*, deit_*, *_reg*, SwiGLU, layer scale)"
    modality = "image"

    def width(self, model: nn.Module) -> int:
        return model.embed_dim

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return tuple(model.patch_embed.img_size)

    def tokens(self, model: nn.Module, seq_len: int) -> int:
        return model.patch_embed.num_patches + model.num_prefix_tokens

    def input_specs(self, model: nn.Module) -> list[InputSpec]:
        h, w = self.image_size(model)
        return [InputSpec("pixel_values", "float32", ["batch", 3, h, w])]

    def _has_logits(self, model: nn.Module) -> bool:
        return getattr(model, "num_classes", 0) > 0

    def output_names(self, model: nn.Module, extras: dict[str, Any]) -> list[str]:
        names = ["last_hidden_state", "pooler_output"]
        return names + (["logits"] if self._has_logits(model) else [])

    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        return _TimmExport(model, self._has_logits(model))

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        h, w = self.image_size(model)
        return {"pixel_values": torch.randn(batch, 3, h, w, generator=generator)}
