"""FP16 artifacts (``elastic_export.precision.fp16``, ``--precision fp16``).

Every fp16 model here is a real mixed-precision ONNX file: checked by ``onnx.checker`` (full check),
run by onnxruntime's CPU execution provider (it has fp16 kernels for every op the recipe leaves in
fp16), and compared with the fp32 model and the hard-masked torch model within DESIGN.md's fp16
tolerance (1e-2 relative on the final output).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from _helpers import masked_torch, minilm_small_export, run_onnx

from elastic_export.checks.compare import relative_error
from elastic_export.core.errors import UserError
from elastic_export.export.dense import UNITS_KEY
from elastic_export.models.inventory import build_inventory
from elastic_export.passes import slice_model
from elastic_export.precision.fp16 import FP16_RTOL, FP32_OPS, PRECISION_KEY, fp16_name, fp32_tail, to_fp16
from elastic_export.ranking.plans import make_plans

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
# text (mean pooling + L2 normalisation), fused qkv + SwiGLU + classifier head, HF vision with
# position-embedding interpolation (Resize), global average pooling before the last norm, RoPE
# (timm EVA02 with its separately stored qkv biases; HF DINOv3), SigLIP's nn.MultiheadAttention pooling head
ARCHS = ["hf-bert", "timm-vit-swiglu", "hf-dinov2", "timm-vit-gap", "hf-modernbert", "hf-qwen3", "timm-eva02",
         "hf-dinov3-gated", "hf-siglip-vision", "hf-mpnet"]


def _types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor of a shape-inferred model."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.value_info) + list(g.input) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    for n in g.node:
        if n.op_type == "Constant":
            types[n.output[0]] = n.attribute[0].t.data_type
    return types


def assert_fp16_recipe(fp32: onnx.ModelProto, half: onnx.ModelProto) -> None:
    """The structure the module docstring promises."""
    onnx.checker.check_model(half, full_check=True)
    types = _types(half)
    # I/O: the same names and types as the fp32 file (int64 tokens, fp32 pixels and outputs)
    assert [(v.name, v.type.tensor_type.elem_type) for v in half.graph.input] == \
        [(v.name, v.type.tensor_type.elem_type) for v in fp32.graph.input]
    assert [(v.name, v.type.tensor_type.elem_type) for v in half.graph.output] == \
        [(v.name, F32) for v in fp32.graph.output]
    tail = fp32_tail(half)
    matmuls = [n for n in half.graph.node if n.op_type in ("MatMul", "Gemm", "Conv") and n.name not in tail]
    assert matmuls and all(types[i] == F16 for n in matmuls for i in n.input[:2]), "weights and activations in fp16"
    for n in half.graph.node:
        if n.op_type in FP32_OPS or n.name in tail:
            float_inputs = [types[i] for i in n.input if i and types.get(i) in (F16, F32)]
            assert all(t == F32 for t in float_inputs), f"{n.op_type} {n.name} must run in fp32"
    # the norms are there, in fp32: LayerNorm as one op, RMSNorm decomposed (Pow, ReduceMean, Sqrt)
    assert any(n.op_type in ("LayerNormalization", "ReduceMean") for n in half.graph.node)
    # no fp32 -> fp16 -> fp32 round trip is left (it would round the fp32 tail for nothing)
    producer = {o: n for n in half.graph.node for o in n.output}
    for n in half.graph.node:
        if n.op_type == "Cast" and n.attribute[0].i == F32 and n.input[0] in producer:
            p = producer[n.input[0]]
            assert not (p.op_type == "Cast" and types.get(p.input[0]) == F32), n.name
    # outputs made by fp32 ops (final norm, pooling, normalisation, head) come straight out of them,
    # not rounded through fp16 (an output made by an fp16 op, e.g. a residual Add, is cast to fp32)
    fp32_producer = {o: n for n in fp32.graph.node for o in n.output}
    fp32_tail_names = fp32_tail(fp32)
    for o in half.graph.output:
        made_by = fp32_producer[o.name]
        if made_by.op_type in FP32_OPS or made_by.name in fp32_tail_names:
            assert producer[o.name].op_type == made_by.op_type, o.name
    keys = {p.key: p.value for p in half.metadata_props}
    assert keys[PRECISION_KEY] == "fp16"
    assert all(keys.get(p.key) == p.value for p in fp32.metadata_props)  # the unit map / elastic tables kept
    assert any(p.key == UNITS_KEY for p in fp32.metadata_props) or any("elastic" in k for k in keys)


@pytest.mark.parametrize("name", ARCHS)
def test_tiny_fp16_budgets_match_fp32(name, tiny_exports):
    enc = tiny_exports[name].enc
    inv, rk, dense, plans = tiny_exports[name].prepared(sparsities=(0.0, 0.5, 0.9))
    feeds = enc.sample_inputs(batch=3, seq_len=11)
    for plan in plans:
        model = slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer)
        half = to_fp16(model)
        assert_fp16_recipe(model, half)
        got = run_onnx(half, feeds)
        assert all(g.dtype == np.float32 for g in got)
        valid = feeds["attention_mask"].numpy() if "attention_mask" in feeds else None  # real tokens
        assert relative_error(run_onnx(model, feeds), got, valid) <= FP16_RTOL, plan.sparsity
        assert relative_error(masked_torch(enc, plan, rk, feeds), got, valid) <= FP16_RTOL, plan.sparsity


def test_fp16_conversion_is_deterministic_and_pure(tiny_exports):
    """Converting is deterministic and leaves the fp32 model untouched."""
    inv, rk, dense, plans = tiny_exports["hf-bert"].prepared(sparsities=(0.5,))
    before = dense.SerializeToString()
    a, b = to_fp16(dense), to_fp16(dense)
    assert dense.SerializeToString() == before
    assert a.SerializeToString() == b.SerializeToString()
    assert fp16_name("budget_s010.onnx") == "budget_s010.fp16.onnx"


def test_minilm_fp16(minilm, minilm_small):
    """The real all-MiniLM-L6-v2 (dense and one budget; the dense export of the magnitude ranking is
    the session's ``minilm_small``) on real text with padding."""
    from pydoc_data.topics import topics

    inv = build_inventory(minilm)
    rk, dense = minilm_small_export(minilm, minilm_small)
    plan = make_plans(rk, inv, [0.5])[0]
    texts = [v[:1500] for v in list(topics.values())[:6]] + ["short query", "how do I sort a list"]
    tok = minilm.tokenizer(texts, padding=True, truncation=True, max_length=64, return_tensors="pt")
    feeds = {s.name: tok[s.name] for s in minilm.input_specs()}
    assert int(tok["attention_mask"].sum()) < tok["attention_mask"].numel()  # some rows are padded
    for model, p in ((dense, None), (slice_model(dense, plan.heads_per_layer, plan.neurons_per_layer), plan)):
        half = to_fp16(model)
        assert_fp16_recipe(model, half)
        want, got = run_onnx(model, feeds), run_onnx(half, feeds)
        err = relative_error(want, got)
        assert err <= FP16_RTOL, err
        cos = (want[1] * got[1]).sum(-1) / np.linalg.norm(want[1], axis=-1) / np.linalg.norm(got[1], axis=-1)
        assert cos.min() > 0.9999
        if p is not None:
            assert relative_error(masked_torch(minilm, p, rk, feeds), got) <= FP16_RTOL


def _save_tiny_bert(path) -> str:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=72)
    BertModel(cfg).save_pretrained(str(path))
    return str(path)


def test_pipeline_precision(tmp_path):
    """``--precision fp16`` adds a checked fp16 twin of every file; the default adds nothing."""
    from elastic_export.pipeline import Options, run

    bert = _save_tiny_bert(tmp_path / "bert")
    common = dict(model=bert, budgets=(0.3, 0.6), method="magnitude", seq_len=16, quick_eval=False,
                  report=False)  # neither is read here
    m = run(Options(out=str(tmp_path / "half"), precision="fp16", **common), echo=lambda s: None)
    assert m.precisions == ["fp32", "fp16"]
    assert m.dense.onnx_fp16 == "dense.fp16.onnx"
    assert [b.onnx_fp16 for b in m.budgets] == ["budget_s030.fp16.onnx", "budget_s060.fp16.onnx"]
    for entry in [m.dense, *m.budgets]:
        assert 0 < entry.fp16_max_rel_error <= FP16_RTOL
        half = onnx.load(str(tmp_path / "half" / entry.onnx_fp16))
        assert_fp16_recipe(onnx.load(str(tmp_path / "half" / entry.onnx)), half)
    assert m.elastic.onnx_fp16 == "elastic.fp16.onnx" and 0 < m.elastic.fp16_max_rel_error <= FP16_RTOL
    assert_fp16_recipe(onnx.load(str(tmp_path / "half" / "elastic.onnx")),
                       onnx.load(str(tmp_path / "half" / "elastic.fp16.onnx")))
    assert json.loads((tmp_path / "half" / "manifest.json").read_text()) == m.to_dict()

    m = run(Options(out=str(tmp_path / "full"), **common), echo=lambda s: None)
    assert m.precisions == ["fp32"] and m.dense.onnx_fp16 is None
    assert all(b.onnx_fp16 is None for b in m.budgets) and m.elastic.onnx_fp16 is None
    assert not list((tmp_path / "full").glob("*.fp16.onnx"))

    with pytest.raises(UserError, match="--precision"):
        run(Options(out=str(tmp_path / "bad"), precision="int4", **common), echo=lambda s: None)
    assert not (tmp_path / "bad").exists()


def test_relative_error_at_real_tokens_only():
    """With the attention mask, per-token outputs are compared at real tokens; pooled ones whole."""
    want = [np.ones((2, 3, 4)), np.ones((2, 4))]
    got = [np.ones((2, 3, 4)), np.ones((2, 4))]
    got[0][1, 0] = 100.0  # a padding position of a left-padded row
    mask = np.array([[1, 1, 1], [0, 1, 1]])
    assert relative_error(want, got) == 99.0
    assert relative_error(want, got, mask) == 0.0
    got[1][1, 0] = 3.0
    assert relative_error(want, got, mask) == 2.0
