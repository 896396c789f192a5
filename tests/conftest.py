"""Tiny models of every supported architecture, built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # workers share the cores: one torch thread each, not one per core each
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from elastic_export.models.loader import load_encoder, wrap_module  # noqa: E402


def _perturb(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random biases, norms and layer scales, so that no parameter is trivially 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module.eval()


def _timm(**kw):
    from timm.models.vision_transformer import VisionTransformer

    base = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, mlp_ratio=2.0, num_classes=10)
    base.update(kw)
    return VisionTransformer(**base)


def _timm_swiglu():
    from timm.layers import SwiGLU

    return _timm(mlp_layer=SwiGLU, mlp_ratio=8 / 3)


def _timm_glu_packed():
    from timm.layers import SwiGLUPacked

    return _timm(mlp_layer=SwiGLUPacked, mlp_ratio=2.0 * 2, act_layer=torch.nn.SiLU)


def _bert(cls_name: str, cfg_name: str, **kw):
    import transformers

    base = dict(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=72)
    return getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**{**base, **kw}), add_pooling_layer=False)


def _hf_vit(pooler: bool = True, **kw):
    from transformers import ViTConfig, ViTModel

    base = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
                patch_size=8)
    return ViTModel(ViTConfig(**{**base, **kw}), add_pooling_layer=pooler)


def _dinov2(swiglu: bool, **kw):
    from transformers import Dinov2Config, Dinov2Model

    base = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, mlp_ratio=2, image_size=32, patch_size=8,
                use_swiglu_ffn=swiglu, layerscale_value=0.5)
    return Dinov2Model(Dinov2Config(**{**base, **kw}))


def _timm_named(name: str, **kw):
    """A registered timm model (``deit_*`` ...) shrunk to the tiny test size."""
    import timm

    base = dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, mlp_ratio=2.0, num_classes=10)
    base.update(kw)
    return timm.create_model(name, pretrained=False, **base)


def _distilbert(**kw):
    from transformers import DistilBertConfig, DistilBertModel

    base = dict(vocab_size=512, dim=32, n_layers=3, n_heads=4, hidden_dim=64, max_position_embeddings=72)
    return DistilBertModel(DistilBertConfig(**{**base, **kw}))


def _mpnet(**kw):
    from transformers import MPNetConfig, MPNetModel

    # 32 buckets: MPNetEncoder.compute_position_bias always bucketises into 32, whatever the config says
    base = dict(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=72, relative_attention_num_buckets=32)
    return MPNetModel(MPNetConfig(**{**base, **kw}))


def _clip_text(projection: bool, **kw):
    import transformers

    base = dict(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=40, projection_dim=24, bos_token_id=510, eos_token_id=511, pad_token_id=511)
    cfg = transformers.CLIPTextConfig(**{**base, **kw})
    return (transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel)(cfg)


def _clip_vision(projection: bool, **kw):
    import transformers

    base = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
                patch_size=8, projection_dim=24)
    cfg = transformers.CLIPVisionConfig(**{**base, **kw})
    return (transformers.CLIPVisionModelWithProjection if projection else transformers.CLIPVisionModel)(cfg)


def _decoder(cfg_name: str, **kw):
    """A tiny decoder-only embedder (Qwen3Model, Qwen2Model, LlamaModel, MistralModel): 4 query heads."""
    import transformers

    base = dict(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=64, max_position_embeddings=72)
    cfg = getattr(transformers, f"{cfg_name}Config")(**{**base, **kw})
    return getattr(transformers, f"{cfg_name}Model")(cfg)


def _modernbert(**kw):
    """Layers global, local, local (every 3rd global); local layers read 2·(8 // 2) + 1 = 9 keys."""
    from transformers import ModernBertConfig, ModernBertModel

    base = dict(vocab_size=512, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=72, global_attn_every_n_layers=3, local_attention=8, pad_token_id=0,
                bos_token_id=1, cls_token_id=1, eos_token_id=2, sep_token_id=2, attn_implementation="eager")
    return ModernBertModel(ModernBertConfig(**{**base, **kw}))


def _dinov3(gated: bool, **kw):
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    base = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
                patch_size=8, num_register_tokens=2, layerscale_value=0.5, use_gated_mlp=gated, key_bias=gated)
    return DINOv3ViTModel(DINOv3ViTConfig(**{**base, **kw}))


def _siglip(tower: str, version: int = 1, **kw):
    import transformers

    prefix = "Siglip" if version == 1 else "Siglip2"
    base = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64)
    if tower == "vision":
        cfg = transformers.SiglipVisionConfig(**{**base, "image_size": 32, "patch_size": 8, **kw})
        return transformers.SiglipVisionModel(cfg)
    cfg = getattr(transformers, f"{prefix}TextConfig")(**{
        **base, "vocab_size": 512, "max_position_embeddings": 40, "projection_size": 24, "pad_token_id": 1,
        "eos_token_id": 1, "bos_token_id": None, **kw})
    return getattr(transformers, f"{prefix}TextModel")(cfg)


def _eva_postnorm():
    """timm Eva with post-norm blocks, ``AttentionRope`` (fused qkv with its own bias), RoPE only and
    RMSNorm (``aten::rms_norm`` in the export)."""
    from timm.layers import RmsNorm
    from timm.models.eva import Eva

    return Eva(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4, mlp_ratio=2.0, num_classes=10,
               use_post_norm=True, attn_type="rope", use_rot_pos_emb=True, use_abs_pos_emb=False,
               norm_layer=RmsNorm)


def _with(build: Callable[..., torch.nn.Module], *args: Any, **fixed: Any) -> Callable[..., torch.nn.Module]:
    """``build(*args, **fixed)`` as a builder that takes config overrides (``**kw`` over ``fixed``)."""
    return lambda **kw: build(*args, **{**fixed, **kw})


# name -> (builder, extras)
TINY = {
    "timm-vit": (lambda: _timm(), {}),
    "timm-vit-reg": (lambda: _timm(reg_tokens=4, no_embed_class=True), {}),
    "timm-vit-layerscale": (lambda: _timm(init_values=0.5), {}),
    "timm-vit-swiglu": (_timm_swiglu, {}),
    "timm-vit-glu-packed": (_timm_glu_packed, {}),
    "timm-vit-gap": (lambda: _timm(class_token=False, global_pool="avg", num_classes=0), {}),
    "hf-bert": (_with(_bert, "BertModel", "BertConfig"), {"pooling": "mean", "normalize": True}),
    "hf-roberta": (_with(_bert, "RobertaModel", "RobertaConfig", pad_token_id=1), {}),
    "hf-xlm-roberta": (_with(_bert, "XLMRobertaModel", "XLMRobertaConfig", pad_token_id=1), {"pooling": "cls"}),
    "timm-deit-distilled": (lambda: _timm_named("deit_tiny_distilled_patch16_224"), {}),
    "timm-deit3": (lambda: _timm_named("deit3_small_patch16_224", init_values=0.5), {}),
    "hf-distilbert": (_distilbert, {"pooling": "mean"}),
    "hf-mpnet": (_mpnet, {"pooling": "mean", "normalize": True}),
    "hf-clip-text": (_with(_clip_text, False), {}),
    "hf-clip-text-proj": (_with(_clip_text, True, eos_token_id=2), {"normalize": True}),
    "hf-clip-vision": (_with(_clip_vision, False), {}),
    "hf-clip-vision-proj": (_with(_clip_vision, True), {}),
    "hf-vit": (_hf_vit, {}),
    "hf-dinov2": (_with(_dinov2, False), {}),
    "hf-dinov2-swiglu": (_with(_dinov2, True), {}),
    "hf-modernbert": (_modernbert, {"pooling": "mean", "normalize": True}),
    "hf-qwen3": (_with(_decoder, "Qwen3"), {"pooling": "lasttoken", "normalize": True}),
    "hf-qwen2": (_with(_decoder, "Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1), {}),
    "hf-llama": (_with(_decoder, "Llama", num_key_value_heads=1, attention_bias=True, mlp_bias=True), {}),
    "hf-mistral": (_with(_decoder, "Mistral", sliding_window=8), {"pooling": "mean"}),
    # timm Eva: EVA02 (fused qkv, q/v biases stored apart, packed GluMlp, RoPE); timm DINOv3 with
    # separate q/k/v, SwiGLU, layer scale and 4 registers; post-norm blocks with AttentionRope
    "timm-eva02": (lambda: _timm_named("eva02_tiny_patch14_224", mlp_ratio=4 * 2 / 3), {}),
    "timm-eva-dinov3": (lambda: _timm_named("vit_small_plus_patch16_dinov3_qkvb", qkv_fused=False), {}),
    "timm-eva-postnorm": (_eva_postnorm, {}),
    "hf-dinov3": (_with(_dinov3, False), {}),  # RoPE, 2 registers, layer scale, plain MLP
    "hf-dinov3-gated": (_with(_dinov3, True), {}),  # gated (SwiGLU) MLP, key bias
    "hf-siglip-vision": (_with(_siglip, "vision"), {}),  # attention-pooling head, no class token
    "hf-siglip-text": (_with(_siglip, "text"), {}),
    "hf-siglip2-text": (_with(_siglip, "text", 2), {}),
}


# timm model classes reach the CLI as a saved timm directory (config.json with the architecture and
# its model_args, model.safetensors), so they are built by registered name: class -> (name, kwargs)
TIMM_SAVED = {
    "VisionTransformer": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4,
                                                       num_classes=10)),
    "Eva": ("eva02_tiny_patch14_224", dict(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=4,
                                           mlp_ratio=4 * 2 / 3, num_classes=10)),
}


def save_tiny(model_class: type, path, **overrides: Any) -> None:
    """Save a tiny model of ``model_class`` (a registered adapter's class) as the directory a user
    would pass to ``--model``: ``save_pretrained`` for Hugging Face models, timm's ``save_for_hf``
    layout for timm models. ``overrides`` change the tiny config: timm model kwargs over
    :data:`TIMM_SAVED`'s, or the keyword arguments of the class's first :data:`TINY` builder
    (Hugging Face config attributes; ``_hf_vit`` also takes ``pooler``)."""
    if model_class.__name__ in TIMM_SAVED:
        import timm
        from timm.models import save_for_hf

        name, kw = TIMM_SAVED[model_class.__name__]
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, **{**kw, **overrides})
        save_for_hf(_perturb(model, seed=1), path, safe_serialization=True)
        return
    for tiny_name, (builder, _) in TINY.items():
        torch.manual_seed(0)
        module = builder()
        if type(module) is model_class:
            if overrides:
                torch.manual_seed(0)
                module = builder(**overrides)
            _perturb(module, seed=1).save_pretrained(path)
            return
    raise KeyError(f"no TINY model of class {model_class.__name__}")


def tiny_encoder(name: str):
    builder, extras = TINY[name]
    torch.manual_seed(0)
    module = _perturb(builder(), seed=1)
    return wrap_module(module, source=f"tiny:{name}", seq_len=16, extras=extras)


@pytest.fixture(params=sorted(TINY))
def tiny(request):
    return tiny_encoder(request.param)


@pytest.fixture(scope="session")
def tiny_exports(tmp_path_factory):
    """One dense export per tiny model (``_helpers.prepared``'s), made on first use, shared read-only."""
    from _helpers import TinyExports

    return TinyExports(tmp_path_factory.mktemp("tiny_exports"))


@pytest.fixture(params=sorted(TINY))
def tiny_export(request, tiny_exports):
    """Every tiny model's shared dense export (:class:`_helpers.TinyExport`); read it, never write it."""
    return tiny_exports[request.param]


@pytest.fixture(scope="session")
def minilm():
    return load_encoder(None, seq_len=32)


@pytest.fixture(scope="session")
def minilm_small(tmp_path_factory):
    """all-MiniLM-L6-v2 (the embedded default) at budgets 0.1 and 0.5 (magnitude ranking, N = 32, no
    verification or elastic graph: fast), exported once per session. Tests that change a directory
    work on :func:`_helpers.link_copy` of it."""
    from elastic_export import pipeline

    out = tmp_path_factory.mktemp("minilm_small") / "out"
    pipeline.run(pipeline.Options(budgets=(0.1, 0.5), out=str(out), method="magnitude", verify=False,
                                  elastic_graph=False, seq_len=32), echo=lambda s: None)
    return out


@pytest.fixture
def routers(monkeypatch) -> Callable[..., Any]:
    """``_triton_fake.start_router`` for this test: every router it starts is finalized at teardown, as
    Triton does when it unloads the model, and its prober thread must have ended by then."""
    from _triton_fake import start_router

    started = []

    def start(repository, name: str):
        model, server = start_router(repository, name, monkeypatch)
        started.append(model)
        return model, server

    yield start
    for model in started:
        model.finalize()
        assert not model._prober.is_alive(), "finalize left the router's prober thread running"


# The files that take longest, first: under pytest-xdist (``-n 2 --dist loadfile``) each file runs whole on
# one worker, in collection order, so a long file collected last would leave the other worker idle at the end.
SLOW_FIRST = ("test_triton_server.py", "test_pipeline.py", "test_golden_export.py", "test_api_exposure.py",
              "test_reliability.py", "test_http_api.py", "test_cli_families.py", "test_distributed.py",
              "test_replicas.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        name = item.path.name
        return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
