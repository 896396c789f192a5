"""Unit inventory and FLOP accounting (DESIGN.md §1)."""

import pytest

from elastic_export.models.inventory import build_inventory, head_flops, neuron_flops
from elastic_export.models.loader import load_encoder


def test_hand_numbers_vit_b16():
    """timm ViT-B/16 at 224 px: N = 196 patches + 1 class token."""
    assert neuron_flops(768, 197) == 605_184
    assert head_flops(768, 64, 197) == 87_515_083


def test_inventory_vit_b16_matches_hand_numbers():
    enc = load_encoder("vit_base_patch16_224", pretrained=False)
    inv = build_inventory(enc)
    assert inv.tokens == 197 and inv.width == 768 and len(inv.layers) == 12
    assert {L.neuron_cost for L in inv.layers} == {605_184}
    assert {L.head_cost for L in inv.layers} == {87_515_083}
    assert inv.prunable_flops == 12 * (12 * 87_515_083 + 3072 * 605_184)
    # the usual 17.6 GMACs of ViT-B/16 = ~35.1 GFLOPs in total
    assert 34.5e9 < inv.total_flops < 35.5e9
    assert inv.total_params == sum(p.numel() for p in enc.module.parameters())


def test_swiglu_neuron_cost(tiny):
    """Unit costs by hand: sliding windows read min(N, window) keys; a grouped-query head costs its
    own q / o rows and attention plus an even share of the k / v projections (4·D·d_h·N per kv head)."""
    inv = build_inventory(tiny)
    D, N = tiny.width, tiny.tokens
    for L, b in zip(inv.layers, tiny.blocks()):
        assert L.neuron_cost == (6 if L.swiglu else 4) * D * N
        K = N if b.heads.window is None else min(N, b.heads.window)
        full = 8 * D * L.head_dim * N + 4 * L.head_dim * N * K + 3 * N * K
        kv = 4 * D * L.head_dim * N
        if L.kv_heads:
            assert (L.kv_cost, L.head_own_cost) == (kv, full - kv)
            assert L.head_cost == full - kv + kv * L.kv_heads // L.heads
        else:
            assert L.head_cost == full


def test_unit_params_add_up(tiny):
    """Removing every unit's parameters leaves exactly the non-prunable ones."""
    inv = build_inventory(tiny)
    zero = [0] * len(inv.layers)
    roles = [r for b in tiny.blocks() for g in (b.heads, b.neurons) for r in g.roles]
    prunable_linears = {id(r.linear) for r in roles}
    bias_parts = {id(getattr(m, attr)) for r in roles for m, attr in r.bias_parts}  # e.g. timm EVA q_bias
    fixed = sum(p.numel() for m in tiny.module.modules() if id(m) not in prunable_linears
                for p in m.parameters(recurse=False) if id(p) not in bias_parts)
    biases_of_consumers = sum(
        g.consumer.linear.bias.numel() for b in tiny.blocks() for g in (b.heads, b.neurons)
        if g.consumer.linear.bias is not None
    )
    assert inv.kept_params(zero, zero) == fixed + biases_of_consumers


def test_minilm_inventory(minilm):
    inv = build_inventory(minilm)
    assert len(inv.layers) == 6
    assert all(L.heads == 12 and L.neurons == 1536 and L.head_dim == 32 for L in inv.layers)
    assert inv.tokens == 32
    assert inv.layers[0].neuron_cost == 4 * 384 * 32


@pytest.mark.parametrize("seq_len", [16, 64])
def test_text_tokens_follow_seq_len(seq_len):
    enc = load_encoder(None, seq_len=seq_len)
    assert build_inventory(enc).tokens == seq_len


def test_sliding_window_head_cost():
    """A sliding-window head reads min(N, window) keys per query; a window >= N costs as global."""
    assert head_flops(64, 16, 200, window=50) == 8 * 64 * 16 * 200 + 4 * 16 * 200 * 50 + 3 * 200 * 50
    assert head_flops(64, 16, 40, window=50) == head_flops(64, 16, 40)
