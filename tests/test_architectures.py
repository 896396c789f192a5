"""Architecture-specific behaviour: registry coverage, CLIP / SigLIP towers, DistilBERT, DeiT, DINOv3,
timm Eva, MPNet, loading saved towers and dual-encoder directories (``--tower``).

The generic checks (inventory, torch reference, every ONNX pass against the hard-masked model) run
for every architecture through the ``tiny`` fixture; these tests pin down what differs per family.
"""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _helpers import masked_torch, max_err, run_onnx
from conftest import TINY, tiny_encoder
from onnx import numpy_helper

from elastic_export.export.dense import get_units, permuted_module
from elastic_export.models.adapters import ADAPTERS
from elastic_export.models.adapters.base import BLOCK_DESCRIBERS
from elastic_export.models.loader import load_encoder
from elastic_export.passes import slice_model


@pytest.fixture(scope="module")
def built_types():
    """Model class and block classes of every TINY entry."""
    out = {}
    for name, (builder, _) in TINY.items():
        torch.manual_seed(0)
        module = builder()
        out[name] = (type(module), {type(m) for m in module.modules()})
    return out


def test_every_adapter_has_a_tiny_model(built_types):
    """No registered adapter (keyed by model class) goes untested by the parametrised suite."""
    tested = {cls for cls, _ in built_types.values()}
    missing = sorted(cls.__name__ for cls in ADAPTERS if cls not in tested)
    assert not missing, f"adapters without a TINY entry in tests/conftest.py: {missing}"


def test_every_block_type_has_a_tiny_model(built_types):
    tested = set().union(*(blocks for _, blocks in built_types.values()))
    missing = sorted(cls.__name__ for cls in BLOCK_DESCRIBERS if cls not in tested)
    assert not missing, f"block describers without a TINY model: {missing}"


# --- CLIP text ---------------------------------------------------------------------------------


def _eos_positions(ids: torch.Tensor, eos: int) -> torch.Tensor:
    return (ids == eos).int().argmax(-1)


@pytest.mark.parametrize("name", ["hf-clip-text", "hf-clip-text-proj"])
def test_clip_text_embedding_is_the_eos_state(name):
    """``sentence_embedding`` is the model's own EOS-pooled output (projected and normalised
    where configured), read at the EOS token of every padded row; inputs are ids + mask only."""
    enc = tiny_encoder(name)
    assert [s.name for s in enc.input_specs()] == ["input_ids", "attention_mask"]
    feeds = enc.sample_inputs(batch=4, seq_len=10)
    ids, mask = feeds["input_ids"], feeds["attention_mask"]
    eos = 511  # conftest: eos_token_id 511, or legacy 2 (pools at the highest id, 511)
    assert torch.equal(_eos_positions(ids, eos), mask.sum(1) - 1), "every row ends with EOS"
    with torch.no_grad():
        hidden, emb = enc.export_module()(ids, mask)
        ref = enc.module(input_ids=ids, attention_mask=mask)
    at_eos = hidden[torch.arange(4), mask.sum(1) - 1]
    if name == "hf-clip-text":
        torch.testing.assert_close(emb, ref.pooler_output)
        torch.testing.assert_close(emb, at_eos)
    else:
        torch.testing.assert_close(emb, F.normalize(ref.text_embeds, dim=-1))
        torch.testing.assert_close(emb, F.normalize(enc.module.text_projection(at_eos), dim=-1))
        assert emb.shape == (4, 24)
    assert enc.embedding((hidden, emb), feeds) is emb


def test_clip_text_stays_causal_after_slicing(tiny_exports):
    """The sliced ONNX keeps the causal mask: a later token never changes earlier states."""
    enc = tiny_exports["hf-clip-text"].enc
    inv, rk, dense, plans = tiny_exports["hf-clip-text"].prepared(sparsities=(0.5,))
    model = slice_model(dense, plans[0].heads_per_layer, plans[0].neurons_per_layer)
    feeds = enc.sample_inputs(batch=1, seq_len=12)
    changed = {k: v.clone() for k, v in feeds.items()}
    changed["input_ids"][0, 8] = 7
    a, b = run_onnx(model, feeds)[0], run_onnx(model, changed)[0]
    np.testing.assert_allclose(a[:, :8], b[:, :8], atol=1e-5)
    assert np.abs(a[:, 8:] - b[:, 8:]).max() > 1e-3


# --- CLIP vision, DeiT -------------------------------------------------------------------------


def test_clip_vision_projection_outputs():
    enc = tiny_encoder("hf-clip-vision-proj")
    assert enc.output_names() == ["last_hidden_state", "pooler_output", "image_embeds"]
    assert enc.tokens == 16 + 1
    x = enc.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        outs = enc.export_module()(x)
        ref = enc.module(pixel_values=x)
        pooled = enc.module.vision_model(pixel_values=x).pooler_output
    torch.testing.assert_close(outs[0], ref.last_hidden_state)
    torch.testing.assert_close(outs[1], pooled)
    torch.testing.assert_close(outs[2], ref.image_embeds)
    assert enc.embedding(outs, {"pixel_values": x}) is outs[2]


def test_deit_distilled_tokens_and_logits():
    """Class + distillation token are both prefix tokens; logits average the two heads."""
    enc = tiny_encoder("timm-deit-distilled")
    assert type(enc.module).__name__ == "VisionTransformerDistilled"
    assert enc.tokens == 16 + 2
    x = enc.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        tokens, pooled, logits = enc.export_module()(x)
        torch.testing.assert_close(logits, enc.module(x))
    torch.testing.assert_close(pooled, (tokens[:, 0] + tokens[:, 1]) / 2)


# --- attention reshapes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf-distilbert", "hf-clip-text", "hf-clip-vision"])
def test_head_reshapes_carry_explicit_head_counts(name, tiny_exports):
    """These models reshape with ``view(..., -1, head_dim)``; after slicing, every split and merge
    Reshape the unit map names holds the layer's explicit head count, and the output is exact."""
    enc = tiny_exports[name].enc
    inv, rk, dense, plans = tiny_exports[name].prepared(sparsities=(0.5,))
    plan = plans[0]
    model = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
    nodes = {n.name: n for n in model.graph.node}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    checked = 0
    for i, layer in enumerate(get_units(dense)):
        k, d = plan.heads_per_layer[i], layer["heads"]["width"]
        if k == 0:
            continue
        for p in layer["heads"]["producers"]:
            assert inits[nodes[p["reshape"]].input[1]].tolist() == [0, 0, k, d]
        merge = nodes[layer["heads"]["consumer"]["reshape"]]
        assert inits[merge.input[1]].tolist() == [0, 0, k * d]
        checked += 1
    assert checked
    feeds = enc.sample_inputs(batch=2, seq_len=9)
    assert max_err(run_onnx(model, feeds), masked_torch(enc, plan, rk, feeds)) <= 1e-4


# --- loading saved towers ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf-distilbert", "hf-clip-text-proj", "hf-clip-vision-proj"])
def test_load_saved_directory(name, tmp_path):
    """A saved directory loads as the class its config names (a ``...WithProjection`` tower keeps
    its projection) and computes what the saved model computes."""
    enc = tiny_encoder(name)
    enc.module.save_pretrained(tmp_path)
    loaded = load_encoder(str(tmp_path), seq_len=16)
    assert type(loaded.module) is type(enc.module)
    assert loaded.output_names() == enc.adapter.output_names(enc.module, {})  # no sentence-transformers config
    feeds = enc.sample_inputs(batch=2, seq_len=8)
    with torch.no_grad():
        want = [t.numpy() for t in enc.module(**feeds).to_tuple()]
        got = [t.numpy() for t in loaded.module(**feeds).to_tuple()]
    assert max_err(got, want) <= 1e-5


@pytest.mark.parametrize("name,positions", [("hf-clip-text-proj", 40), ("hf-bert", 72), ("hf-mpnet", 70)])
def test_default_seq_len_fits_the_model(name, positions, tmp_path):
    """Without --seq-len, N is 128 or the model's position count where that is smaller (CLIP: 77)."""
    from elastic_export.core.errors import UserError

    tiny_encoder(name).module.save_pretrained(tmp_path)
    assert load_encoder(str(tmp_path)).seq_len == min(128, positions)
    with pytest.raises(UserError, match="beyond the model"):
        load_encoder(str(tmp_path), seq_len=positions + 1)


# --- DINOv3 (Hugging Face) ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf-dinov3", "hf-dinov3-gated"])
def test_dinov3_outputs_and_tokens(name):
    """N = 16 patches + class + 2 registers; outputs are the model's own (normed tokens, class token)."""
    enc = tiny_encoder(name)
    assert enc.tokens == 16 + 1 + 2
    assert enc.blocks()[0].neurons.swiglu == (name == "hf-dinov3-gated")
    x = enc.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        hidden, pooled = enc.export_module()(x)
        ref = enc.module(pixel_values=x)
    torch.testing.assert_close(hidden, ref.last_hidden_state)
    torch.testing.assert_close(pooled, ref.pooler_output)
    assert hidden.shape == (2, 19, 32)


# --- timm Eva ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,prefix", [("timm-eva02", 1), ("timm-eva-dinov3", 5), ("timm-eva-postnorm", 1)])
def test_eva_outputs_and_tokens(name, prefix):
    """N = patches + class + registers; the outputs are timm's features, pre-logits and logits."""
    enc = tiny_encoder(name)
    assert enc.tokens == 16 + prefix
    x = enc.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        tokens, pooled, logits = enc.export_module()(x)
        torch.testing.assert_close(tokens, enc.module.forward_features(x))
        torch.testing.assert_close(logits, enc.module(x))


def test_eva_separate_biases_are_sliced_with_their_heads(tiny_exports):
    """EVA stores the fused qkv's bias apart (q_bias, a zero k_bias buffer, v_bias): the torch slicer
    cuts each part, and the exported graph carries their concatenation as the qkv bias."""
    from elastic_export.ranking.reference import sliced_copy

    enc = tiny_exports["timm-eva02"].enc
    attn = enc.module.blocks[0].attn
    role = enc.blocks()[0].heads.producers[0]
    assert [a for _, a in role.bias_parts] == ["q_bias", "k_bias", "v_bias"] and attn.qkv.bias is None
    inv, rk, dense, plans = tiny_exports["timm-eva02"].prepared(sparsities=(0.5,))
    inits = {t.name: numpy_helper.to_array(t) for t in dense.graph.initializer}
    perm = enc.blocks(permuted_module(enc, rk))
    want = perm[0].heads.producers[0].bias.detach().numpy()
    np.testing.assert_array_equal(inits["blocks.0.attn.qkv.bias"], want)
    keep = {(i, k): np.arange(2) for i in range(3) for k in ("heads", "neurons")}
    sliced = sliced_copy(enc.module, enc.blocks, keep).blocks[0].attn
    assert sliced.qkv.weight.shape[0] == 3 * 2 * attn.head_dim and sliced.qkv.bias.shape[0] == 3 * 2 * attn.head_dim
    ids = torch.arange(2 * attn.head_dim)
    torch.testing.assert_close(sliced.qkv.bias[:2 * attn.head_dim], attn.q_bias[ids])


@pytest.mark.parametrize("name,kw,match", [
    ("eva02_base_patch14_224", {}, "MLP hidden norm"),  # SwiGLU with a LayerNorm over the hidden units
    ("eva02_base_patch16_clip_224", {"swiglu_mlp": False}, "scale_norm"),  # a norm over all heads' outputs
    ("vit_base_patch16_rope_mixed_224", {}, "rope_type='mixed'"),  # per-head RoPE frequencies
])
def test_eva_options_that_cannot_be_sliced_are_refused(name, kw, match):
    import timm

    from elastic_export.core.errors import UserError
    from elastic_export.models.loader import wrap_module

    tiny = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4, num_classes=0)
    model = timm.create_model(name, pretrained=False, **tiny, **kw)
    with pytest.raises(UserError, match=re.escape(match)):
        wrap_module(model).blocks()


# --- SigLIP ------------------------------------------------------------------------------------


def test_siglip_vision_pools_with_its_head():
    """No class token (N = patches); ``pooler_output`` is the attention-pooling head's output.
    Without the head only ``last_hidden_state`` is exported."""
    from transformers import SiglipVisionModel

    enc = tiny_encoder("hf-siglip-vision")
    assert enc.tokens == 16 and enc.output_names() == ["last_hidden_state", "pooler_output"]
    x = enc.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        hidden, pooled = enc.export_module()(x)
        ref = enc.module(pixel_values=x)
        torch.testing.assert_close(pooled, enc.module.head(hidden))
    torch.testing.assert_close(hidden, ref.last_hidden_state)
    torch.testing.assert_close(pooled, ref.pooler_output)
    cfg = enc.module.config
    cfg.vision_use_head = False
    headless = wrap_module_of(SiglipVisionModel(cfg))
    assert headless.output_names() == ["last_hidden_state"]
    assert headless.embedding(headless.export_module()(x), {"pixel_values": x}).shape == (2, 32)


def wrap_module_of(module):
    from elastic_export.models.loader import wrap_module

    return wrap_module(module)


@pytest.mark.parametrize("name", ["hf-siglip-text", "hf-siglip2-text"])
def test_siglip_text_embedding_is_the_last_position(name):
    """``sentence_embedding`` is transformers' pooler_output: ``head`` of the final-normed state at
    the last position (padding included, as transformers does); the mask is passed on."""
    enc = tiny_encoder(name)
    assert [s.name for s in enc.input_specs()] == ["input_ids", "attention_mask"]
    assert enc.output_names() == ["last_hidden_state", "sentence_embedding"]
    feeds = enc.sample_inputs(batch=3, seq_len=10)
    assert feeds["attention_mask"].min() == 0, "some rows are padded"
    with torch.no_grad():
        hidden, emb = enc.export_module()(*feeds.values())
        ref = enc.module(**feeds)
        torch.testing.assert_close(emb, enc.module.head(hidden[:, -1]))
    torch.testing.assert_close(hidden, ref.last_hidden_state)
    torch.testing.assert_close(emb, ref.pooler_output)
    assert emb.shape == (3, 24)


def test_siglip2_naflex_vision_is_refused():
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    from elastic_export.core.errors import UserError

    cfg = Siglip2VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                              patch_size=8, num_patches=16)
    with pytest.raises(UserError, match="Siglip2VisionModel is not supported: its NaFlex inputs"):
        wrap_module_of(Siglip2VisionModel(cfg))


# --- dual encoders: --tower --------------------------------------------------------------------


def _dual(kind: str):
    import transformers

    text = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=40)
    vision = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                  patch_size=8)
    torch.manual_seed(0)
    if kind == "clip":
        cfg = transformers.CLIPConfig(text_config=dict(text, bos_token_id=510, eos_token_id=511, pad_token_id=511),
                                      vision_config=vision, projection_dim=24)
        model = transformers.CLIPModel(cfg)
    else:
        cfg = transformers.SiglipConfig(text_config=dict(text, pad_token_id=1, eos_token_id=1, bos_token_id=None),
                                        vision_config=vision)
        model = transformers.SiglipModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture(scope="module", params=["clip", "siglip"])
def dual_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = _dual(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_dual_encoder_needs_tower(dual_dir):
    from elastic_export.core.errors import UserError

    kind, _, path = dual_dir
    with pytest.raises(UserError, match="choose one with --tower text or --tower vision") as e:
        load_encoder(str(path))
    assert "\n" not in str(e.value)


def test_dual_encoder_tower_outputs(dual_dir):
    """``--tower text`` / ``--tower vision`` give the tower with its projection (CLIP) or its own
    head (SigLIP): the embedding equals the full model's text / image features."""
    kind, model, path = dual_dir
    text, vision = load_encoder(str(path), tower="text"), load_encoder(str(path), tower="vision")
    want = {"clip": ("CLIPTextModelWithProjection", "CLIPVisionModelWithProjection"),
            "siglip": ("SiglipTextModel", "SiglipVisionModel")}[kind]
    assert (type(text.module).__name__, type(vision.module).__name__) == want
    assert (text.tower, vision.tower, text.modality, vision.modality) == ("text", "vision", "text", "image")
    feeds = text.sample_inputs(batch=2, seq_len=8)
    x = vision.sample_inputs(batch=2)["pixel_values"]
    with torch.no_grad():
        t_out, v_out = text.export_module()(*feeds.values()), vision.export_module()(x)
        t_ref = model.get_text_features(**feeds).pooler_output
        v_ref = model.get_image_features(pixel_values=x).pooler_output
    torch.testing.assert_close(text.embedding(t_out, feeds), t_ref)
    torch.testing.assert_close(vision.embedding(v_out, {"pixel_values": x}), v_ref)


def test_tower_on_a_single_encoder_is_refused(tmp_path):
    from elastic_export.core.errors import UserError

    tiny_encoder("hf-siglip-text").module.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="not a text \\+ vision dual encoder; drop --tower"):
        load_encoder(str(tmp_path), tower="text")
    with pytest.raises(UserError, match="a single encoder; drop --tower"):
        load_encoder("vit_tiny_patch16_224", pretrained=False, tower="vision")
    with pytest.raises(UserError, match="choose text or vision"):
        load_encoder(str(tmp_path), tower="audio")


def test_tower_through_the_cli(tmp_path, capsys):
    """The main job exports one tower (the manifest records it) and ``verify`` reloads that tower
    for its torch check; without ``--tower`` the CLI exits 2 with one line naming the flag."""
    from elastic_export.cli.main import main

    path = tmp_path / "siglip"
    _dual("siglip").save_pretrained(path)

    def cli(*args):
        with pytest.raises(SystemExit) as e:
            main(list(args))
        return e.value.code, *capsys.readouterr()

    rc, out, err = cli("inspect", "--model", str(path))
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error:") and "--tower text" in err
    out_dir = tmp_path / "out"
    rc, out, err = cli("--model", str(path), "--tower", "vision", "--budgets", "0.5", "--method", "magnitude",
                       "--out", str(out_dir), "--no-elastic-graph", "--no-report", "--no-quick-eval")
    assert rc == 0, err
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["model"]["tower"] == "vision" and manifest["model"]["architecture"] == "SiglipVisionModel"
    rc, out, err = cli("verify", str(out_dir))
    assert rc == 0, out + err
    assert "torch" in out and "skipped" not in out


# --- MPNet: one relative position bias shared by all layers, one row per head -------------------

MPNET_ORDERS = [[3, 1, 0, 2], [0, 2, 3, 1], [2, 3, 1, 0]]  # a different head order in every layer


def _mpnet_ranking(enc):
    """Heads ranked in MPNET_ORDERS, neurons by a seeded random score."""
    from elastic_export.ranking.file import Ranking

    heads = [np.argsort(order).astype(np.float32) * -1.0 for order in MPNET_ORDERS]  # rank r -> score -r
    g = np.random.default_rng(0)
    neurons = [g.random(b.neurons.count).astype(np.float32) for b in enc.blocks()]
    return Ranking(heads, neurons, {})


@pytest.mark.parametrize("kept", [[2, 2, 1], [1, 3, 2], [4, 0, 3]])
def test_mpnet_sliced_heads_read_their_own_position_bias_rows(kept, tmp_path):
    """Every layer keeps a different subset of heads, in a different order: the per-budget ONNX
    (each layer's bias-row Gather cut to its kept heads) equals the hard-masked dense model."""
    from elastic_export.export.dense import export_dense
    from elastic_export.models.adapters import HEADS, NEURONS
    from elastic_export.passes import slice_model
    from elastic_export.ranking.reference import hard_mask

    enc = tiny_encoder("hf-mpnet")
    bias = enc.module.encoder.relative_attention_bias.weight.detach()
    assert float((bias - bias.mean(1, keepdim=True)).abs().min()) > 0  # every head has its own bias
    rk = _mpnet_ranking(enc)
    assert [rk.order(HEADS, i).tolist() for i in range(3)] == MPNET_ORDERS
    dense = export_dense(enc, rk, tmp_path / "dense.onnx")
    neurons = [b.neurons.count for b in enc.blocks()]
    model = slice_model(dense, kept, neurons)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for i, k in enumerate(kept):
        if k:  # the sliced layer reads the bias rows of its kept heads, best first
            name = get_units(model)[i]["heads"]["shared_rows"][0]["index"]
            assert inits[name].tolist() == MPNET_ORDERS[i][:k]
    keep = {(i, HEADS): np.array(MPNET_ORDERS[i][:k]) for i, k in enumerate(kept)}
    keep.update({(i, NEURONS): np.arange(n) for i, n in enumerate(neurons)})
    feeds = enc.sample_inputs(batch=3, seq_len=12)
    with torch.no_grad():
        with hard_mask(enc.blocks(), keep):
            want = [t.numpy() for t in enc.export_module()(*feeds.values())]
        dense_out = [t.numpy() for t in enc.export_module()(*feeds.values())]
    got = run_onnx(model, feeds)
    assert max_err(got, want) <= 1e-4
    assert max_err(got, dense_out) > 1e-3  # the budget really differs from the dense model


def test_mpnet_without_the_bias_gather_would_be_wrong(tmp_path):
    """Negative control: the same sliced weights reading the first k bias rows (what a layer gets
    without the per-layer gather) miss the hard-masked model by far more than 1e-4."""
    from elastic_export.export.dense import permuted_module
    from elastic_export.models.adapters import HEADS, NEURONS, find_blocks
    from elastic_export.ranking.plans import BudgetPlan
    from elastic_export.ranking.reference import hard_mask, prefix_keep, sliced_copy

    enc = tiny_encoder("hf-mpnet")
    rk = _mpnet_ranking(enc)
    neurons = [b.neurons.count for b in enc.blocks()]
    plan = BudgetPlan(0.3, [2, 2, 1], neurons, 0, 1, 1, 0)
    sliced = sliced_copy(permuted_module(enc, rk), find_blocks, prefix_keep(plan))
    feeds = enc.sample_inputs(batch=2, seq_len=12)
    keep = {(i, HEADS): np.array(MPNET_ORDERS[i][:k]) for i, k in enumerate(plan.heads_per_layer)}
    keep.update({(i, NEURONS): np.arange(n) for i, n in enumerate(neurons)})
    with torch.no_grad():
        with hard_mask(enc.blocks(), keep):
            want = [t.numpy() for t in enc.export_module()(*feeds.values())]
        got = [t.numpy() for t in enc.export_module(sliced)(*feeds.values())]
        assert max_err(got, want) <= 1e-4
        for b in find_blocks(sliced):
            sa = b.heads.module
            sa.bias_heads = torch.arange(len(sa.bias_heads))
        wrong = [t.numpy() for t in enc.export_module(sliced)(*feeds.values())]
    assert max_err(wrong, want) > 1e-3


def _save_as_masked_lm_config(module, path) -> None:
    import json

    module.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["MPNetForMaskedLM"]  # as in sentence-transformers' all-mpnet-base-v2
    (path / "config.json").write_text(json.dumps(cfg))


def test_mpnet_masked_lm_config_loads_the_bare_model(tmp_path):
    """A directory whose config names MPNetForMaskedLM but whose weights are the bare model loads
    as MPNetModel with every weight (none random) and computes what the saved model computes."""
    enc = tiny_encoder("hf-mpnet")
    _save_as_masked_lm_config(enc.module, tmp_path)
    loaded = load_encoder(str(tmp_path), seq_len=16)
    assert type(loaded.module).__name__ == "MPNetModel" and loaded.module.pooler is not None
    want_sd, got_sd = enc.module.state_dict(), loaded.module.state_dict()
    assert sorted(got_sd) == sorted(want_sd) and all(torch.equal(got_sd[k], want_sd[k]) for k in want_sd)
    feeds = enc.sample_inputs(batch=2, seq_len=8)
    with torch.no_grad():
        want = [t.numpy() for t in enc.module(**feeds).to_tuple()]
        got = [t.numpy() for t in loaded.module(**feeds).to_tuple()]
    assert max_err(got, want) == 0.0


def test_mpnet_missing_weights_are_refused(tmp_path):
    """A checkpoint without some encoder weight is refused (it would load as random numbers); a
    masked-LM checkpoint (no pooler) loads as the bare model with the pooler dropped."""
    from safetensors.torch import load_file, save_file
    from transformers import MPNetForMaskedLM

    from elastic_export.core.errors import UserError

    enc = tiny_encoder("hf-mpnet")
    _save_as_masked_lm_config(enc.module, tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["encoder.layer.1.attention.attn.q.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match="lacks weights.*encoder.layer.1.attention.attn.q.weight"):
        load_encoder(str(tmp_path))
    mlm = tmp_path / "mlm"
    MPNetForMaskedLM(enc.module.config).save_pretrained(mlm)
    loaded = load_encoder(str(mlm), seq_len=16)
    assert type(loaded.module).__name__ == "MPNetModel" and loaded.module.pooler is None
