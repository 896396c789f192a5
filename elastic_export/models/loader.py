"""Load an encoder from a local Hugging Face directory, a hub id, a timm model name, or the embedded default."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from elastic_export.core.errors import UserError, first_line
from elastic_export.models import hub, preprocess
from elastic_export.models.adapters import adapter_for
from elastic_export.models.adapters.registry import TOWER_NAMES
from elastic_export.models.encoder import Encoder
from elastic_export.models.hub import DEFAULT_MODEL, default_model_path  # noqa: F401 - the loader's names too


def _sentence_transformers_extras(path: Path) -> dict:
    """Pooling and normalisation from a sentence-transformers model directory, if it is one."""
    modules = path / "modules.json"
    if not modules.is_file():
        return {}
    try:
        entries = json.loads(modules.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{modules}: unreadable sentence-transformers modules.json ({e})")
    extras: dict = {}
    for entry in entries:
        kind = str(entry.get("type", ""))
        if kind.endswith("Pooling"):
            cfg_file = path / entry.get("path", "") / "config.json"
            try:
                cfg = json.loads(cfg_file.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{cfg_file}: unreadable pooling config ({e})")
            if cfg.get("pooling_mode_lasttoken"):
                extras["pooling"] = "lasttoken"
            elif cfg.get("pooling_mode_cls_token"):
                extras["pooling"] = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                extras["pooling"] = "max"
            elif cfg.get("pooling_mode_mean_tokens", True):
                extras["pooling"] = "mean"
        elif kind.endswith("Normalize"):
            extras["normalize"] = True
    return extras


def _model_class(config: Any, fallback: type) -> type:
    """The class ``config.architectures`` names when an adapter is registered for it, else
    ``fallback`` (AutoModel). ``AutoModel`` would load a saved ``CLIPTextModelWithProjection`` /
    ``CLIPVisionModelWithProjection`` as the bare tower and drop its projection. A name with no
    adapter (e.g. ``MPNetForMaskedLM`` in sentence-transformers' all-mpnet-base-v2, whose
    ``model.safetensors`` holds the bare ``MPNetModel``) falls back to the bare model."""
    import transformers

    from elastic_export.models.adapters import ADAPTERS, TOWERS

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and (cls in ADAPTERS or cls in TOWERS):
            return cls
    return fallback


def _check_loaded(model: torch.nn.Module, info: dict, path: Path) -> None:
    """Refuse a model whose checkpoint left weights randomly initialised (missing or of another
    shape). A missing ``pooler`` (saved with ``add_pooling_layer=False``, or a masked-LM checkpoint
    loaded as the bare model) is dropped instead: no output then comes from random weights.

    Raises:
        UserError: some weight is missing from ``model.safetensors`` or has the wrong shape.
    """
    missing = sorted(info.get("missing_keys") or [])
    if missing and all(k.startswith("pooler.") for k in missing) and hasattr(model, "pooler"):
        model.pooler = None
        missing = []
    bad = missing + sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or [])
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise UserError(f"{path}: model.safetensors lacks weights of {type(model).__name__} "
                        f"({', '.join(bad[:3])}{more}); they would be random")




def _select_tower(model: Any, tower: str | None, where: str) -> Any:
    """The tower ``--tower`` names of a dual encoder (CLIP, SigLIP), or ``model`` itself.

    Raises:
        UserError: a dual encoder without ``tower``, or ``tower`` for a single-tower model.
    """
    from elastic_export.models.adapters import TOWERS

    pick = next((TOWERS[c] for c in type(model).__mro__ if c in TOWERS), None)
    name = type(model).__name__
    if pick is None:
        if tower is not None:
            raise UserError(f"--tower {tower}: {where} is a single encoder ({name}), not a text + vision "
                            "dual encoder; drop --tower")
        return model
    if tower is None:
        raise UserError(f"{where}: {name} holds a text and a vision tower; choose one with --tower text "
                        "or --tower vision")
    return pick(model, tower)


def _no_tower(tower: str | None, what: str) -> None:
    if tower is not None:
        raise UserError(f"--tower {tower}: {what}, a single encoder; drop --tower")


def _load_hf(path: Path, seq_len: int, image_size: int | None, trust_remote_code: bool,
             tower: str | None = None) -> Encoder:
    from transformers import AutoConfig, AutoModel

    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many types here
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise UserError(f"{path}: the model ships its own Python code, which is not run by default; "
                            "pass --trust-remote-code only if you trust its source")
        raise UserError(f"{path}: not a loadable Hugging Face model directory ({first_line(e)})")
    has_weights = any((path / f).exists() for f in ("model.safetensors", "model.safetensors.index.json"))
    if not has_weights:
        raise UserError(
            f"{path}: no model.safetensors found (only safetensors weights are loaded; convert .bin files first)"
        )
    try:
        model, info = _model_class(config, AutoModel).from_pretrained(
            str(path), config=config, use_safetensors=True, trust_remote_code=trust_remote_code,
            attn_implementation="eager", output_loading_info=True,
        )
    except Exception as e:
        raise UserError(f"{path}: could not load the model ({first_line(e)})")
    _check_loaded(model, info, path)
    model = _select_tower(model.float().eval(), tower, str(path))
    config = model.config
    adapter = adapter_for(model)
    extras = _sentence_transformers_extras(path) if adapter.modality == "text" else {}
    tokenizer = None
    if adapter.modality == "text":
        max_pos = getattr(config, "max_position_embeddings", None)
        offset = 2 if config.model_type in ("roberta", "xlm-roberta", "mpnet") else 0  # positions from pad + 1
        if seq_len is None:  # the default: 128 tokens, or fewer where the model has fewer positions
            seq_len = DEFAULT_SEQ_LEN if max_pos is None else min(DEFAULT_SEQ_LEN, max_pos - offset)
        if max_pos is not None and seq_len > max_pos - offset:
            raise UserError(f"--seq-len {seq_len} is beyond the model's {max_pos - offset} positions")
        if any((path / f).exists() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json")):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path))
            except Exception:
                tokenizer = None
    elif image_size is not None and image_size != adapter.image_size(model)[0]:
        raise UserError(
            f"--image-size {image_size}: Hugging Face vision models run at their config size "
            f"({adapter.image_size(model)[0]}); drop the option or change the config"
        )
    data_config = None
    if adapter.modality == "image":
        seq_len = 0  # N comes from the image size and patches (as for timm models)
        data_config = preprocess.hf_config(path, adapter.image_size(model))
    return Encoder(model, adapter, str(path), type(model).__name__, seq_len, extras, tokenizer, data_config,
                   tower=tower)


def is_timm_dir(path: Path) -> bool:
    """A timm model directory (the Hugging Face hub layout timm saves with ``save_for_hf``):
    ``config.json`` names a timm ``architecture`` (a transformers config names a ``model_type``)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and "architecture" in cfg and "model_type" not in cfg


def _load_timm_dir(path: Path, image_size: int | None) -> Encoder:
    if not any((path / f).exists() for f in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")):
        raise UserError(f"{path}: a timm model directory without weights (model.safetensors)")
    enc = _load_timm(f"local-dir:{path}", True, image_size)
    enc.source = str(path)
    return enc


def _load_timm(name: str, pretrained: bool, image_size: int | None) -> Encoder:
    import timm

    kwargs = {"img_size": image_size} if image_size else {}
    try:
        model = timm.create_model(name, pretrained=pretrained, **kwargs)
    except Exception as e:
        raise _timm_error(name, pretrained, e)
    model = model.float().eval()
    adapter = adapter_for(model)
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if image_size is not None and patch is not None and image_size < max(patch):
        raise UserError(f"--image-size {image_size} is smaller than the model's {max(patch)}-pixel patches")
    data_config = {"library": "timm", **timm.data.resolve_data_config({}, model=model)}
    data_config["input_size"] = (3, *adapter.image_size(model))  # the size the model was built for
    local = name.startswith("local-dir:") or name.startswith(hub.TIMM_PREFIX)
    arch = (getattr(model, "pretrained_cfg", None) or {}).get("architecture", name) if local else name
    enc = Encoder(model, adapter, name, f"{type(model).__name__}:{arch}", 0, {}, None, data_config)
    if pretrained and not name.startswith("local-dir:"):
        enc.repo_id, enc.revision = _timm_weights_commit(model)
    return enc


def _timm_error(name: str, pretrained: bool, e: Exception) -> UserError:
    """One line for a timm model that would not build or load."""
    from huggingface_hub import errors

    msg = first_line(e)
    if name.startswith("local-dir:"):
        return UserError(f"{name[len('local-dir:'):]}: could not load the timm model directory ({msg})")
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError)) and (
            pretrained or name.startswith(hub.TIMM_PREFIX)):
        return hub.not_found(name, e)
    if pretrained:
        return UserError(f"could not load pretrained weights for timm model {name!r} ({msg}); "
                         "--no-pretrained builds it with random weights")
    return UserError(f"could not build timm model {name!r}: {msg}")


def _timm_weights_commit(model: torch.nn.Module) -> tuple[str | None, str | None]:
    """The hub repository and cached commit a timm model's pretrained weights came from, if the hub."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    repo = cfg.get("hf_hub_id")
    if not repo:
        return None, None
    repo, _, rev = str(repo).partition("@")
    for filename in (cfg.get("hf_hub_filename"), "model.safetensors", "config.json", "open_clip_pytorch_model.bin",
                     "pytorch_model.bin"):
        commit = hub.cached_commit(repo, filename, rev or None) if filename else None
        if commit:
            return repo, commit
    return repo, None


def _load_hub(ref: hub.HubRef, seq_len: int | None, image_size: int | None, trust_remote_code: bool,
              tower: str | None) -> Encoder:
    """A Hugging Face hub model (``ORG/NAME[@REV]``): its snapshot, loaded as a local directory would be."""
    folder, commit = hub.snapshot(ref, trust_remote_code)
    if is_timm_dir(folder):
        _no_tower(tower, f"{ref.name} is a timm model")
        enc = _load_timm_dir(folder, image_size)
    else:
        enc = _load_hf(folder, seq_len, image_size, trust_remote_code, tower)
    enc.source, enc.repo_id, enc.revision = ref.repo_id, ref.repo_id, commit
    return enc


def _load_timm_hub(name: str, revision: str | None, pretrained: bool, image_size: int | None) -> Encoder:
    """A timm ``hf-hub:ORG/NAME[@REV]`` name, through timm's own hub loading."""
    ref = hub.parse(name[len(hub.TIMM_PREFIX):], revision)
    if ref is None:
        raise UserError(f"--model {name}: give hf-hub:ORG/NAME[@REVISION]")
    enc = _load_timm(hub.TIMM_PREFIX + ref.name, pretrained, image_size)
    enc.source, enc.repo_id = hub.TIMM_PREFIX + ref.repo_id, ref.repo_id
    enc.revision = hub.cached_commit(ref.repo_id, "config.json", ref.revision) or enc.revision
    return enc


def wrap_module(
    module: torch.nn.Module,
    source: str = "<module>",
    *,
    seq_len: int = 128,
    extras: dict | None = None,
    tokenizer=None,
    data_config: dict | None = None,
) -> Encoder:
    """Bind an already built torch model (timm or transformers) to its adapter.

    Args:
        module: the model; it is put in eval mode.
        source: recorded in the manifest.
        seq_len: nominal text length (text models).
        extras: e.g. ``{"pooling": "mean", "normalize": True}`` for a sentence embedding output.
        tokenizer: optional Hugging Face tokenizer for text calibration.
        data_config: image preprocessing (mean, std, input_size); derived when omitted.
    """
    module = module.float().eval()
    adapter = adapter_for(module)
    arch = type(module).__name__
    if adapter.modality == "image" and data_config is None:
        data_config = {"library": "timm", "input_size": (3, *adapter.image_size(module)), "mean": (0.5, 0.5, 0.5),
                       "std": (0.5, 0.5, 0.5), "interpolation": "bilinear", "crop_pct": 1.0, "crop_mode": "center"}
    return Encoder(module, adapter, source, arch, seq_len if adapter.modality == "text" else 0,
                   dict(extras or {}), tokenizer, data_config)


DEFAULT_SEQ_LEN = 128


def load_encoder(
    model: str | None = None,
    *,
    revision: str | None = None,
    pretrained: bool = True,
    seq_len: int | None = None,
    image_size: int | None = None,
    trust_remote_code: bool = False,
    tower: str | None = None,
) -> Encoder:
    """Load the encoder the user named.

    Args:
        model: a local Hugging Face model directory, a timm model directory (``config.json`` with
            an ``architecture``, as timm saves it), a Hugging Face hub id ``ORG/NAME[@REVISION]``
            (a local path of that name wins), a timm ``hf-hub:ORG/NAME[@REVISION]`` name, a timm
            model name, or None for the embedded default (all-MiniLM-L6-v2).
        revision: hub ids: the branch, tag or commit (as ``@REVISION``).
        pretrained: timm names only: load pretrained weights (from the hub or its cache) or random init.
        seq_len: nominal text length N for FLOP accounting (text models); None: 128, or the
            model's position count where that is smaller (CLIP text: 77).
        image_size: timm names only: input resolution.
        trust_remote_code: allow model code shipped in the directory (off by default).
        tower: ``"text"`` or ``"vision"``: the tower of a dual-encoder directory (``CLIPModel``:
            with its projection, as ``CLIPTextModelWithProjection`` / ``CLIPVisionModelWithProjection``;
            ``SiglipModel``: the tower model itself). Required for those, refused for others.

    Raises:
        UserError: missing path, unknown name, not cached while offline, unsupported architecture, bad options.
    """
    _check_options(seq_len, image_size, tower)
    torch.manual_seed(0)
    if model is None or model == DEFAULT_MODEL:
        _no_revision(revision, "the embedded default")
        enc = _load_hf(default_model_path(), seq_len, image_size, trust_remote_code, tower)
        enc.source = DEFAULT_MODEL
        return enc
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        _no_revision(revision, f"{model} is a local directory")
        if is_timm_dir(path):
            _no_tower(tower, f"{model} is a timm model directory")
            return _load_timm_dir(path.resolve(), image_size)
        return _load_hf(path.resolve(), seq_len, image_size, trust_remote_code, tower)
    if path.exists():
        raise UserError(f"--model {model}: is a file; give a Hugging Face model directory, a hub id or a timm model name")
    if model.startswith(hub.TIMM_PREFIX):
        _no_tower(tower, f"{model} is a timm model")
        return _load_timm_hub(model, revision, pretrained, image_size)
    ref = hub.parse(model, revision)
    if ref is not None:
        return _load_hub(ref, seq_len, image_size, trust_remote_code, tower)
    return _load_timm_name(model, revision, pretrained, image_size, tower)


def _check_options(seq_len: int | None, image_size: int | None, tower: str | None) -> None:
    if seq_len is not None and seq_len < 1:
        raise UserError(f"--seq-len must be a positive integer, got {seq_len}")
    if image_size is not None and image_size < 1:
        raise UserError(f"--image-size must be a positive integer, got {image_size}")
    if tower is not None and tower not in TOWER_NAMES:
        raise UserError(f"--tower {tower}: choose text or vision")


def _no_revision(revision: str | None, what: str) -> None:
    if revision is not None:
        raise UserError(f"--revision {revision}: {what}, not a hub id; drop --revision")


def _load_timm_name(model: str, revision: str | None, pretrained: bool, image_size: int | None,
                    tower: str | None) -> Encoder:
    """A timm model name (``vit_small_patch16_224.augreg_in21k``), else the error saying what ``model`` can be."""
    import timm

    looks_like_path = os.sep in model or model.startswith(".") or model.startswith("~")
    if not looks_like_path and timm.is_model(model):
        _no_tower(tower, f"{model} is a timm model")
        _no_revision(revision, f"{model} is a timm model name (use hf-hub:ORG/NAME@REVISION for a hub revision)")
        return _load_timm(model, pretrained, image_size)
    what = "no such directory" if looks_like_path else "no such directory and not a timm model name (see timm.list_models())"
    raise UserError(f"--model {model}: {what}; give a local model directory, a Hugging Face hub id ORG/NAME[@REVISION], "
                    "a timm name or hf-hub:ORG/NAME")
