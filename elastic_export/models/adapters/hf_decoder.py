"""Hugging Face decoder-only text embedders: ``Qwen3Model``, ``Qwen2Model``, ``LlamaModel``, ``MistralModel``.

Pre-norm blocks (RMSNorm), rotary position embeddings, causal attention (Mistral, and Qwen2 / Qwen3
layers of type ``sliding_attention``: a sliding window) with grouped-query heads (Qwen3: per-head
RMSNorm ``q_norm`` / ``k_norm``) and a SwiGLU MLP (``gate_proj``, ``up_proj``, ``down_proj``).

Units: an MLP neuron is its gate row + up row + down column; a *query head* is a head unit (its q
rows, its o columns). Key / value heads are shared (:class:`SharedHeads`): one stays while any query
head reading it stays. So that any ranked order of query heads can be sliced, the adapter installs
its own attention forward on each attention module, numerically Hugging Face's eager attention,
that reads key / value heads through an explicit index (``kv_index``, one kv head per query head;
``Gather`` in ONNX) instead of the contiguous ``repeat_kv`` expansion, and switches the config to
eager attention masks (the causal, padding and sliding-window mask as one additive tensor).

Outputs: ``last_hidden_state`` and ``sentence_embedding``: the final-norm state of the last real
token (the last position whose ``attention_mask`` is 1, so left and right padding both work; the
sentence-transformers ``pooling_mode_lasttoken``) or the configured sentence-transformers pooling,
L2-normalised when a ``Normalize`` module is configured.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaModel, MistralModel, Qwen2Model, Qwen3Model
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.mistral.modeling_mistral import MistralDecoderLayer
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from elastic_export.models.adapters.base import (
    HEADS,
    LinearRole,
    SharedHeads,
    UnitGroup,
    bias_only_forward,
    gated_neurons,
    register_block,
)
from elastic_export.models.adapters.hf_bert import pool_tokens
from elastic_export.models.adapters.registry import EmbedderAdapter, register_adapter

LAST_TOKEN = "lasttoken"


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face ``apply_rotary_pos_emb`` for one tensor (B, heads, N, d); cos / sin (B, N, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def _heads_of(attn: nn.Module, proj: nn.Linear, x: torch.Tensor, norm: str | None) -> torch.Tensor:
    """``proj(x)`` split into heads (B, heads, N, d), with the module's per-head norm where it has one."""
    y = proj(x).view(*x.shape[:-1], -1, attn.head_dim)
    if norm is not None and getattr(attn, norm, None) is not None:
        y = getattr(attn, norm)(y)
    return y.transpose(1, 2)


def gqa_attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None,
                          attention_mask: torch.Tensor | None = None, **kwargs):
    """Eager attention of a Llama-family attention module with key / value heads read through
    ``self.kv_index`` (None: every query head has its own). With the index
    ``arange(n_q) // (n_q // n_kv)`` this is Hugging Face's forward; returns ``(output, None)``."""
    q = _heads_of(self, self.q_proj, hidden_states, "q_norm")
    k = _heads_of(self, self.k_proj, hidden_states, "k_norm")
    v = _heads_of(self, self.v_proj, hidden_states, None)
    cos, sin = position_embeddings
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    if self.kv_index is not None:
        k, v = k.index_select(1, self.kv_index), v.index_select(1, self.kv_index)
    weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    weights = F.dropout(weights, p=float(self.attention_dropout), training=self.training)
    out = torch.matmul(weights, v).transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)
    return self.o_proj(out), None


def _install(attn: nn.Module) -> None:
    """Once per module: eager masks, the ``kv_index`` buffer (non-persistent, so the state dict
    and the fingerprint do not change) and :func:`gqa_attention_forward`."""
    if "kv_index" in attn._buffers:
        return
    attn.config._attn_implementation = "eager"
    n_q = attn.q_proj.out_features // attn.head_dim
    n_kv = attn.k_proj.out_features // attn.head_dim
    index = None if n_kv == n_q else torch.arange(n_q) // (n_q // n_kv)
    attn.register_buffer("kv_index", index, persistent=False)
    attn.forward = types.MethodType(gqa_attention_forward, attn)


def window(attn: nn.Module) -> int | None:
    """Keys per query of a sliding-window layer (Qwen2 / Qwen3: per layer type; Mistral: every layer)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(attn.config, "sliding_window", None)


def _kv_heads(attn: nn.Module) -> SharedHeads:
    def store(index: np.ndarray) -> None:
        attn.kv_index = torch.as_tensor(np.asarray(index, dtype=np.int64), device=attn.kv_index.device)

    k, v = attn.k_proj, attn.v_proj
    return SharedHeads([LinearRole(k, "out"), LinearRole(v, "out")], k.out_features // attn.head_dim,
                       attn.kv_index.cpu().numpy().copy(), store)


def decoder_heads(attn: nn.Module) -> UnitGroup:
    """Query heads of a Llama-family attention (with shared key / value heads where n_kv < n_q)."""
    _install(attn)

    def resize(n: int) -> None:
        if n == 0:
            attn.forward = bias_only_forward(attn.o_proj)

    shared = attn.kv_index is not None
    q, k, v = (LinearRole(p, "out") for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    return UnitGroup(
        kind=HEADS,
        count=attn.q_proj.out_features // attn.head_dim,
        width=attn.head_dim,
        producers=[q] if shared else [q, k, v],
        consumer=LinearRole(attn.o_proj, "in"),
        module=attn,
        resize=resize,
        window=window(attn),
        kv=_kv_heads(attn) if shared else None,
    )


@register_block(Qwen3DecoderLayer, Qwen2DecoderLayer, LlamaDecoderLayer, MistralDecoderLayer)
def describe_decoder_layer(layer: nn.Module) -> tuple[UnitGroup, UnitGroup]:
    mlp = layer.mlp
    return decoder_heads(layer.self_attn), gated_neurons(mlp, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


class _DecoderExport(nn.Module):
    def __init__(self, model: nn.Module, pooling: str, normalize: bool) -> None:
        super().__init__()
        self.model = model
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        emb = pool_tokens(hidden, attention_mask, self.pooling)
        if self.normalize:
            emb = F.normalize(emb, p=2.0, dim=-1)
        return hidden, emb


@register_adapter(Qwen3Model, Qwen2Model, LlamaModel, MistralModel)
class HFDecoderAdapter(EmbedderAdapter):
    """Decoder-only text embedders (Qwen3-Embedding and the like): inputs ``input_ids``,
    ``attention_mask``; outputs ``last_hidden_state``, ``sentence_embedding`` (last-token pooled
    unless a sentence-transformers pooling config says otherwise)."""

    label = "Hugging Face Qwen3Model / Qwen2Model / LlamaModel / MistralModel (decoder embedders)"
    def export_module(self, model: nn.Module, extras: dict[str, Any]) -> nn.Module:
        for layer in model.layers:  # eager masks and the kv_index forward before the first call
            _install(layer.self_attn)
        return _DecoderExport(model, extras.get("pooling") or LAST_TOKEN, bool(extras.get("normalize")))

    def sample_inputs(self, model: nn.Module, batch: int, seq_len: int, generator: torch.Generator) -> dict:
        """Row 0 full; then left-padded rows (as Qwen3-Embedding's tokenizer pads) alternating with
        right-padded ones."""
        cfg = model.config
        low = 1000 if cfg.vocab_size > 2000 else 1
        ids = torch.randint(low, cfg.vocab_size, (batch, seq_len), generator=generator)
        lengths = torch.randint(1, seq_len + 1, (batch,), generator=generator)
        lengths[0] = seq_len
        pos = torch.arange(seq_len)[None, :]
        right = pos < lengths[:, None]
        left = pos >= seq_len - lengths[:, None]
        mask = torch.where((torch.arange(batch) % 2 == 1)[:, None], left, right).long()
        pad = cfg.pad_token_id if isinstance(cfg.pad_token_id, int) else 0
        ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad))
        return {"input_ids": ids, "attention_mask": mask}
