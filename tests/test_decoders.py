"""Decoder-only text embedders (Qwen3, Qwen2, Llama, Mistral): grouped-query heads, last-token pooling.

A query head is the unit; a key / value head stays while any query head reading it stays
(DESIGN.md §1). These tests pick rankings whose query-head order interleaves kv groups, so that
budgets drop some kv heads, keep kv heads for a single reader, and empty whole layers.
"""


import numpy as np
import pytest
import torch
from _helpers import masked_torch, max_err, run_onnx, save_sentence_transformer
from conftest import TINY, _perturb, tiny_encoder
from onnx import numpy_helper

from elastic_export.export.dense import export_dense, get_units, permuted_module
from elastic_export.models.adapters import find_blocks
from elastic_export.models.inventory import build_inventory
from elastic_export.models.loader import load_encoder
from elastic_export.passes import build_elastic_model, slice_model
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.plans import BudgetPlan, make_plans
from elastic_export.ranking.reference import prefix_keep, sliced_copy

DECODERS = ["hf-qwen3", "hf-qwen2", "hf-llama", "hf-mistral"]
# layer 0 -> kv heads (0, 0, 1, 1); the orders below read kv 1 first in layers 1 and 2
ORDERS = [[0, 1, 2, 3], [2, 3, 0, 1], [1, 2, 0, 3]]
# heads kept per layer: every kv situation (0 heads; 1 kv head for 2 readers; 2 kv heads; all)
HEAD_PLANS = [[4, 4, 4], [0, 2, 1], [0, 1, 2], [2, 3, 0], [1, 0, 4], [0, 0, 0]]


def _ranking(enc, orders=ORDERS, seed=0) -> Ranking:
    """Head scores that put each layer's heads in ``orders``; random neuron scores."""
    inv = build_inventory(enc)
    rng = np.random.default_rng(seed)
    heads = []
    for order in orders:
        s = np.zeros(len(order), dtype=np.float32)
        s[np.asarray(order)] = np.linspace(1.0, 0.5, len(order), dtype=np.float32)
        heads.append(s)
    neurons = [rng.random(L.neurons).astype(np.float32) for L in inv.layers]
    return Ranking(heads, neurons, {})


def _plan(heads: list[int], neurons: list[int]) -> BudgetPlan:
    return BudgetPlan(0.0, list(heads), list(neurons), 0, 1, 0, 0)


@pytest.mark.parametrize("name", DECODERS)
def test_forward_is_hugging_face_eager(name):
    """The installed kv_index attention computes what the untouched Hugging Face model computes
    (eager: every position; sdpa: every real token), with left and right padding."""
    torch.manual_seed(0)
    hf = _perturb(TINY[name][0](), seed=1)
    enc = tiny_encoder(name)
    feeds = enc.sample_inputs(batch=4, seq_len=12)
    mask = feeds["attention_mask"].bool()
    assert (~mask[:, 0]).any() and (~mask[:, -1]).any()  # both paddings present
    with torch.no_grad():
        sdpa = hf(**feeds).last_hidden_state
        hf.set_attn_implementation("eager")
        eager = hf(**feeds).last_hidden_state
        ours = enc.export_module()(*feeds.values())[0]
    assert float((ours - eager).abs().max()) <= 1e-6
    assert float((ours - sdpa)[mask].abs().max()) <= 1e-5


def test_gqa_budgets_are_exact_and_reshapes_explicit(tmp_path):
    """Budgets that drop kv heads and empty layers: torch sliced == hard-masked == budget ONNX ==
    elastic graph; q reshapes hold k, k/v reshapes and weights m(k), the Gathers k indices."""
    enc = tiny_encoder("hf-qwen3")
    rk = _ranking(enc)
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    units = get_units(dense)
    assert [u["heads"]["kv"]["index"] for u in units] == [[0, 0, 1, 1], [0, 0, 1, 1], [0, 1, 0, 1]]
    perm = permuted_module(enc, rk)
    feeds = enc.sample_inputs(batch=4, seq_len=11)
    neurons = [64, 40, 0]
    budgets = []
    for heads in HEAD_PLANS:
        plan = _plan(heads, neurons)
        want = masked_torch(enc, plan, rk, feeds)
        with torch.no_grad():
            sliced = [t.numpy() for t in enc.export_module(sliced_copy(perm, find_blocks, prefix_keep(plan)))(*feeds.values())]
        assert max_err(sliced, want) <= 1e-4, heads
        model = slice_model(dense, heads, neurons)
        assert max_err(run_onnx(model, feeds), want) <= 1e-4, heads
        _check_shapes(model, units, heads)
        budgets.append((heads, want))
    elastic = build_elastic_model(dense, [h for h, _ in budgets], [neurons] * len(budgets))
    import onnxruntime as ort

    sess = ort.InferenceSession(elastic.SerializeToString(), providers=["CPUExecutionProvider"])
    np_feeds = {k: v.numpy() for k, v in feeds.items()}
    for b, (heads, want) in enumerate(budgets):
        got = sess.run(None, {**np_feeds, "budget_index": np.array([b], np.int64)})
        assert max_err(got, want) <= 1e-4, heads


def _check_shapes(model, units, heads) -> None:
    nodes = {n.name: n for n in model.graph.node}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for i, layer in enumerate(units):
        k, d, kv = heads[i], layer["heads"]["width"], layer["heads"]["kv"]
        m = len(set(kv["index"][:k]))
        if k == 0:
            assert kv["indices"] not in inits and all(p["reshape"] not in nodes for p in kv["producers"])
            continue
        (q,) = layer["heads"]["producers"]
        assert inits[nodes[q["reshape"]].input[1]].tolist() == [0, 0, k, d]
        for p in kv["producers"]:
            assert inits[nodes[p["reshape"]].input[1]].tolist() == [0, 0, m, d]
            assert inits[p["weight"]].shape[p["axis"]] == m * d
        assert inits[kv["indices"]].tolist() == kv["index"][:k]
        assert all(inits[nodes[g].input[1]].tolist() == kv["index"][:k] for g in kv["gathers"])


def test_kept_flops_and_params_count_kv_heads_exactly():
    """Inventory.kept_flops / kept_params with k query heads kept add exactly the kv heads those
    heads read: checked against the sliced torch model's shapes and parameter count."""
    enc = tiny_encoder("hf-qwen3")
    inv = build_inventory(enc)
    rk = _ranking(enc)
    perm = permuted_module(enc, rk)
    orders = [rk.order("heads", i) for i in range(3)]
    D, N, d = inv.width, inv.tokens, 8
    attention = 4 * d * N * N + 3 * N * N
    neurons = [64, 40, 0]
    for heads in HEAD_PLANS:
        sliced = sliced_copy(perm, find_blocks, prefix_keep(_plan(heads, neurons)))
        flops = 0
        for k, n, layer in zip(heads, neurons, sliced.layers):
            a = layer.self_attn
            outs = a.q_proj.out_features + a.k_proj.out_features + a.v_proj.out_features + a.o_proj.in_features
            flops += 2 * D * N * outs + k * attention + 6 * D * N * n
        assert inv.kept_flops(heads, neurons, orders) == flops, heads
        assert inv.kept_params(heads, neurons, orders) == sum(p.numel() for p in sliced.parameters()), heads
    # layer 1 keeps heads 2, 3 first: both read kv head 1, so the second adds no kv cost
    L = inv.layers[1]
    assert L.head_marginals(orders[1]) == [L.head_own_cost + L.kv_cost, L.head_own_cost,
                                           L.head_own_cost + L.kv_cost, L.head_own_cost]
    assert inv.prunable_flops == inv.kept_flops([4] * 3, [64] * 3)


def test_plans_fill_budgets_with_exact_costs():
    """make_plans charges a kv head to its first kept reader: every plan's kept FLOPs are the exact
    count, within one unit of the target, and plans nest."""
    enc = tiny_encoder("hf-llama")  # one kv head for all four query heads (MQA)
    inv = build_inventory(enc)
    rk = _ranking(enc)
    orders = [rk.order("heads", i) for i in range(3)]
    plans = make_plans(rk, inv, [0.1 * s for s in range(10)])
    biggest = max(L.head_own_cost + L.kv_cost for L in inv.layers)
    for a, b in zip(plans, plans[1:]):
        assert all(x >= y for x, y in zip(a.heads_per_layer + a.neurons_per_layer, b.heads_per_layer + b.neurons_per_layer))
    for p in plans:
        assert p.kept_flops == inv.kept_flops(p.heads_per_layer, p.neurons_per_layer, orders)
        assert 0 <= (1 - p.sparsity) * inv.prunable_flops - p.kept_flops < biggest


@pytest.mark.parametrize("normalize", [False, True])
def test_last_token_pooling_left_and_right_padding(normalize, tmp_path):
    """sentence_embedding is the Hugging Face state of the last real token, for left-padded rows
    (Qwen3-Embedding's tokenizer) and right-padded ones, in torch and in the dense ONNX."""
    enc = tiny_encoder("hf-qwen3")
    enc.extras = {"pooling": "lasttoken", "normalize": normalize}
    ids = torch.randint(1, 512, (4, 9), generator=torch.Generator().manual_seed(0))
    lengths = [9, 5, 3, 7]
    right = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    left = right.flip(1)
    dense = export_dense(enc, _ranking(enc), tmp_path / "dense.onnx")
    for mask in (left, right):
        feeds = {"input_ids": ids, "attention_mask": mask}
        with torch.no_grad():
            hidden = enc.module(**feeds).last_hidden_state
            want = torch.stack([hidden[b, int(mask[b].nonzero().max())] for b in range(4)])
            if normalize:
                want = torch.nn.functional.normalize(want, dim=-1)
            got = enc.export_module()(ids, mask)[1]
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert float(np.abs(run_onnx(dense, feeds)[1] - want.numpy()).max()) <= 1e-5


def test_saved_qwen3_with_sentence_transformers_lasttoken(tmp_path):
    """A save_pretrained Qwen3Model directory with a sentence-transformers last-token pooling and
    Normalize config loads as Qwen3Model with that pooling and computes what the saved model does."""
    enc = tiny_encoder("hf-qwen3")
    save_sentence_transformer(enc, tmp_path, {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False,
                                              "pooling_mode_lasttoken": True})
    loaded = load_encoder(str(tmp_path))
    assert type(loaded.module).__name__ == "Qwen3Model" and loaded.seq_len == 72
    assert loaded.extras == {"pooling": "lasttoken", "normalize": True}
    assert loaded.output_names() == ["last_hidden_state", "sentence_embedding"]
    feeds = enc.sample_inputs(batch=3, seq_len=10)
    with torch.no_grad():
        want = enc.export_module()(*feeds.values())
        got = loaded.export_module()(*feeds.values())
    assert max_err([t.numpy() for t in got], [t.numpy() for t in want]) <= 1e-5


def test_sliding_window_heads_cost_min_n_window():
    """Mistral (every layer) and Qwen2 (layers of type sliding_attention) heads read min(N, window) keys."""
    mistral, qwen2 = tiny_encoder("hf-mistral"), tiny_encoder("hf-qwen2")
    assert [b.heads.window for b in mistral.blocks()] == [8, 8, 8]
    assert [b.heads.window for b in qwen2.blocks()] == [None, 8, 8]
    inv = build_inventory(qwen2)
    N, d = inv.tokens, 8
    own = [L.head_own_cost - 4 * inv.width * d * N for L in inv.layers]  # the attention part
    assert own == [4 * d * N * N + 3 * N * N] + [4 * d * N * 8 + 3 * N * 8] * 2


def test_multi_head_llama_has_no_shared_heads(tmp_path):
    """With as many kv heads as query heads every head owns its q, k, v rows (no Gather)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, intermediate_size=64, max_position_embeddings=72)
    from elastic_export.models.loader import wrap_module

    torch.manual_seed(0)
    enc = wrap_module(_perturb(transformers.LlamaModel(cfg), 1), seq_len=16)
    assert all(b.heads.kv is None and len(b.heads.producers) == 3 for b in enc.blocks())
    rk = _ranking(enc, orders=ORDERS[1:])
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    assert not any(n.op_type == "Gather" and "self_attn" in n.name and n.input[1].endswith("kv_index")
                   for n in dense.graph.node)
    feeds = enc.sample_inputs(batch=3, seq_len=9)
    for heads in ([0, 3], [2, 1]):
        plan = _plan(heads, [30, 64])
        assert max_err(run_onnx(slice_model(dense, heads, [30, 64]), feeds), masked_torch(enc, plan, rk, feeds)) <= 1e-4


def test_report_rebuilds_gqa_plans_from_ranking_meta():
    """The ranking file's metadata carries the kv heads, so plans rebuilt from it (the report's
    comparison of ranking files) equal the main job's exact plans."""
    from elastic_export.core.manifest import Budget, Manifest
    from elastic_export.ranking.file import make_meta
    from elastic_export.report.page import _plans_for

    enc = tiny_encoder("hf-llama")
    inv = build_inventory(enc)
    rk = _ranking(enc)
    rk.meta = make_meta(inv, "sha256:x", "random", {}, {})
    sparsities = [0.2, 0.45, 0.7]
    plans = make_plans(rk, inv, sparsities)
    heads, neurons = _plans_for(rk, Manifest(budgets=[Budget(sparsity=s) for s in sparsities]))
    assert heads == [p.heads_per_layer for p in plans] and neurons == [p.neurons_per_layer for p in plans]
