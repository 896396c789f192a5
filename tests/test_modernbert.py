"""ModernBERT specifics: fused ``Wqkv`` heads, GeGLU neurons of the fused ``Wi``, sliding-window
head cost on local layers, the padded eager export, saved directories and the CLI.

The generic checks (every pass against the hard-masked model, fp16, the elastic graph, ranking
methods) run on the ``hf-modernbert`` TINY entry (layers global, local, local; window 9 keys).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _helpers import masked_torch, max_err, run_onnx, save_sentence_transformer
from conftest import _modernbert, _perturb, tiny_encoder
from transformers.masking_utils import create_bidirectional_sliding_window_mask

from elastic_export.export.dense import export_dense
from elastic_export.models.adapters import HEADS, NEURONS
from elastic_export.models.adapters.hf_modernbert import attention_window
from elastic_export.models.inventory import build_inventory
from elastic_export.models.loader import load_encoder, wrap_module
from elastic_export.passes import slice_model
from elastic_export.ranking.file import Ranking
from elastic_export.ranking.reference import hard_mask, ranked_keep, sliced_copy
from elastic_export.ranking.scoring import METHODS


def _encoder(seq_len: int = 16, **config):
    torch.manual_seed(0)
    module = _perturb(_modernbert(**config), seed=1)
    return wrap_module(module, source="tiny:modernbert", seq_len=seq_len, extras={"pooling": "mean", "normalize": True})


def _outputs(enc, feeds, keep=None) -> list[np.ndarray]:
    """The export module's outputs, with every unit outside ``keep`` hard-masked (None: dense)."""
    if keep is None:
        keep = {(b.index, k): np.arange(b.group(k).count) for b in enc.blocks() for k in (HEADS, NEURONS)}
    with torch.no_grad(), hard_mask(enc.blocks(), keep):
        return [t.numpy() for t in enc.export_module()(*feeds.values())]


# --- unit definitions --------------------------------------------------------------------------


def test_units_and_windows():
    enc = tiny_encoder("hf-modernbert")
    blocks = enc.blocks()
    assert [b.block.attention_type for b in blocks] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [b.heads.window for b in blocks] == [None, 9, 9]
    for b in blocks:
        assert (b.heads.count, b.heads.width, b.neurons.count, b.neurons.swiglu) == (4, 8, 64, True)
        assert [(r.name.split(".")[-1], r.groups) for r in b.heads.producers] == [("Wqkv", 3)]
        assert [(r.name.split(".")[-1], r.groups) for r in b.neurons.producers] == [("Wi", 2)]
    assert [s.name for s in enc.input_specs()] == ["input_ids", "attention_mask"]
    assert enc.output_names() == ["last_hidden_state", "sentence_embedding"]


@pytest.mark.parametrize("local_attention,keys", [(8, 9), (9, 9), (128, 129)])
def test_window_is_what_the_mask_lets_a_query_read(local_attention, keys):
    """The window the inventory uses equals the most keys any query reads in the model's own
    sliding-window mask (``|q - k| <= local_attention // 2``)."""
    cfg = _modernbert(local_attention=local_attention, max_position_embeddings=300).config
    n = 2 * keys + 5
    embeds, ones = torch.zeros(1, n, cfg.hidden_size), torch.ones(1, n, dtype=torch.long)
    mask = create_bidirectional_sliding_window_mask(cfg, embeds, ones)
    readable = (mask[0, 0] == 0).sum(-1)
    assert attention_window(cfg, "sliding_attention") == keys == int(readable.max())
    assert attention_window(cfg, "full_attention") is None


def _keep_all_but(enc, layer: int, kind: str, unit: int) -> dict:
    keep = {(b.index, k): np.arange(b.group(k).count) for b in enc.blocks() for k in (HEADS, NEURONS)}
    keep[(layer, kind)] = np.delete(keep[(layer, kind)], unit)
    return keep


def test_packing_order_of_the_fused_projections():
    """Head h of layer 1 owns rows 2·D + h·d .. of ``Wqkv`` (its values in the (3, heads, d) view):
    zeroing them equals masking the head. Neuron j owns rows j and I + j of ``Wi`` (input, gate):
    zeroing either equals masking the neuron (GELU(0) = 0)."""
    enc = tiny_encoder("hf-modernbert")
    feeds = enc.sample_inputs(batch=2, seq_len=16)
    D, d, hidden = 32, 8, 64
    attn, mlp = enc.module.layers[1].attn, enc.module.layers[1].mlp
    masked_head = _outputs(enc, feeds, _keep_all_but(enc, 1, HEADS, 2))
    masked_neuron = _outputs(enc, feeds, _keep_all_but(enc, 1, NEURONS, 5))
    for linear, rows, want in ((attn.Wqkv, slice(2 * D + 2 * d, 2 * D + 3 * d), masked_head),
                               (mlp.Wi, slice(5, 6), masked_neuron), (mlp.Wi, slice(hidden + 5, hidden + 6), masked_neuron)):
        saved = linear.weight.data.clone()
        linear.weight.data[rows] = 0
        try:
            assert max_err(_outputs(enc, feeds), want) <= 1e-6
        finally:
            linear.weight.data.copy_(saved)
    assert max_err(masked_head, _outputs(enc, feeds)) > 1e-4


# --- cost --------------------------------------------------------------------------------------


def test_local_heads_cost_less_by_the_window():
    """At N = 16 a local head (K = 9 keys) costs 4·d·N·(N - K) + 3·N·(N - K) less than a global
    one; at N = 8 <= window every head costs the same."""
    inv = build_inventory(tiny_encoder("hf-modernbert"))
    N, d, K = 16, 8, 9
    full, local, local2 = (L.head_cost for L in inv.layers)
    assert full == 8 * 32 * d * N + 4 * d * N * N + 3 * N * N
    assert local == local2 == full - 4 * d * N * (N - K) - 3 * N * (N - K)
    short = build_inventory(_encoder(seq_len=8))
    assert len({L.head_cost for L in short.layers}) == 1
    assert len({L.neuron_cost for L in inv.layers}) == 1 and inv.layers[0].neuron_cost == 6 * 32 * N


# --- exactness ---------------------------------------------------------------------------------

BUDGETS = [([4, 0, 2], [0, 37, 64]), ([1, 3, 0], [64, 5, 0]), ([0, 0, 0], [0, 0, 0]), ([4, 4, 4], [64, 64, 64])]


@pytest.mark.parametrize("biases", [False, True], ids=["no-bias", "bias"])
def test_sliced_onnx_and_torch_equal_the_masked_model(biases, tmp_path):
    """Hand-picked budgets with 0 heads on a global and on a local layer and 0 neurons: the sliced
    ONNX and the torch slicer equal the hard-masked dense model (biases on or off)."""
    enc = _encoder(attention_bias=biases, mlp_bias=biases)
    assert (enc.module.layers[0].attn.Wqkv.bias is not None) == biases
    heads, neurons = METHODS["random"](enc, build_inventory(enc), seed=5)
    rk = Ranking(heads, neurons, {})
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    feeds = enc.sample_inputs(batch=3, seq_len=16)
    assert int(feeds["attention_mask"].sum()) < 3 * 16  # some rows are padded
    for h, n in BUDGETS:
        plan = SimpleNamespace(heads_per_layer=h, neurons_per_layer=n)
        want = masked_torch(enc, plan, rk, feeds)
        assert max_err(run_onnx(slice_model(dense, h, n), feeds), want) <= 1e-4, (h, n)
        sliced = sliced_copy(enc.module, enc.blocks, ranked_keep(plan, rk))
        with torch.no_grad():
            got = [t.numpy() for t in enc.export_module(sliced)(*feeds.values())]
        assert max_err(got, want) <= 1e-4, (h, n)


def test_dense_onnx_equals_the_hf_model_on_padded_rows(tmp_path):
    """The dense ONNX (dynamic batch and sequence) computes the HF model's ``last_hidden_state`` on
    a padded batch, and a padded row's real tokens equal that row run alone without padding."""
    enc = tiny_encoder("hf-modernbert")
    dense = export_dense(enc, Ranking(*METHODS["random"](enc, build_inventory(enc), seed=0), {}), tmp_path / "d.onnx")
    feeds = enc.sample_inputs(batch=4, seed=3, seq_len=20)
    lengths = feeds["attention_mask"].sum(1).tolist()
    assert min(lengths) < 20
    hidden, emb = run_onnx(dense, feeds)
    with torch.no_grad():
        ref = enc.module(**feeds).last_hidden_state.numpy()
    assert np.abs(hidden - ref).max() <= 1e-4
    for row, n in enumerate(lengths):
        alone = {k: v[row:row + 1, :n] for k, v in feeds.items()}
        h1, e1 = run_onnx(dense, alone)
        assert np.abs(h1[0] - hidden[row, :n]).max() <= 1e-4
        assert np.abs(e1[0] - emb[row]).max() <= 1e-4


def test_export_switches_to_eager_attention():
    """A model built with SDPA is exported and referenced through the padded eager attention: the
    same states at every real token (padding positions whose window holds only padding differ
    between the two implementations; the export follows eager there too)."""
    torch.manual_seed(0)
    module = _perturb(_modernbert(attn_implementation="sdpa"), seed=1)
    enc = wrap_module(module, seq_len=16)
    feeds = enc.sample_inputs(batch=3, seq_len=16)
    with torch.no_grad():
        sdpa = module(**feeds).last_hidden_state
        got = enc.export_module()(*feeds.values())[0]
        eager = module(**feeds).last_hidden_state
    assert module.config._attn_implementation == "eager"
    real = feeds["attention_mask"].bool()
    assert (got[real] - sdpa[real]).abs().max() <= 1e-5
    assert torch.equal(got, eager)


# --- saved directories and the CLI ----------------------------------------------------------------


def _save_sentence_transformer(enc, path) -> None:
    """A ``save_pretrained`` directory plus a sentence-transformers mean-pooling + normalize config."""
    save_sentence_transformer(enc, path, {"pooling_mode_mean_tokens": True})


def test_saved_directory_loads_and_matches(tmp_path):
    enc = tiny_encoder("hf-modernbert")
    _save_sentence_transformer(enc, tmp_path)
    loaded = load_encoder(str(tmp_path), seq_len=16)
    assert type(loaded.module) is type(enc.module)
    assert loaded.module.config._attn_implementation == "eager"
    assert loaded.extras == {"pooling": "mean", "normalize": True}
    assert [b.heads.window for b in loaded.blocks()] == [None, 9, 9]
    assert load_encoder(str(tmp_path)).seq_len == 72  # the model's positions (< 128)
    feeds = enc.sample_inputs(batch=3, seq_len=16)
    assert max_err(_outputs(loaded, feeds), _outputs(enc, feeds)) <= 1e-6


def test_cli_main_job_and_verify(tmp_path, capsys):
    from elastic_export.cli.main import main

    model, out = tmp_path / "model", tmp_path / "out"
    _save_sentence_transformer(tiny_encoder("hf-modernbert"), model)
    with pytest.raises(SystemExit) as done:
        main(["--model", str(model), "--budgets", "0.3,0.6", "--method", "magnitude", "--no-quick-eval", "--no-report",
              "--out", str(out)])
    assert done.value.code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert [o["name"] for o in manifest["outputs"]] == ["last_hidden_state", "sentence_embedding"]
    assert manifest["model"]["architecture"] == "ModernBertModel"
    assert len(manifest["budgets"]) == 2 and manifest["elastic"] is not None
    with pytest.raises(SystemExit) as done:
        main(["verify", str(out)])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith("checks passed")
