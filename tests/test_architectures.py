"""Architecture-specific behaviour: registry coverage, CLIP towers, DistilBERT, DeiT, loading saved towers.

The generic checks (inventory, torch reference, every ONNX pass against the hard-masked model) run
for every architecture through the ``tiny`` fixture; these tests pin down what differs per family.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper

from _helpers import masked_torch, max_err, prepared, run_onnx
from conftest import TINY, tiny_encoder
from elastic_export.adapters import ADAPTERS
from elastic_export.adapters.base import BLOCK_DESCRIBERS
from elastic_export.export import get_units
from elastic_export.loader import load_encoder
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


def test_clip_text_stays_causal_after_slicing(tmp_path):
    """The sliced ONNX keeps the causal mask: a later token never changes earlier states."""
    enc = tiny_encoder("hf-clip-text")
    inv, rk, dense, plans = prepared(enc, tmp_path, sparsities=(0.5,))
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
def test_head_reshapes_carry_explicit_head_counts(name, tmp_path):
    """These models reshape with ``view(..., -1, head_dim)``; after slicing, every split and merge
    Reshape the unit map names holds the layer's explicit head count, and the output is exact."""
    enc = tiny_encoder(name)
    inv, rk, dense, plans = prepared(enc, tmp_path, sparsities=(0.5,))
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


@pytest.mark.parametrize("name,positions", [("hf-clip-text-proj", 40), ("hf-bert", 72)])
def test_default_seq_len_fits_the_model(name, positions, tmp_path):
    """Without --seq-len, N is 128 or the model's position count where that is smaller (CLIP: 77)."""
    from elastic_export.errors import UserError

    tiny_encoder(name).module.save_pretrained(tmp_path)
    assert load_encoder(str(tmp_path)).seq_len == min(128, positions)
    with pytest.raises(UserError, match="beyond the model"):
        load_encoder(str(tmp_path), seq_len=positions + 1)
