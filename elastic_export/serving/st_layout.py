"""The sentence-transformers layout: one folder per (budget, precision) that
``SentenceTransformer(folder, backend="onnx")`` loads as it is.

Each folder is the source model's sentence-transformers directory without its torch weights, plus
the budget's ONNX file as ``onnx/model.onnx``::

    s030-fp32/
        onnx/model.onnx          the budget's file (fp32, or its fp16 / int8 twin), unchanged
        onnx/budget_s030.onnx.data   its external data, where it has some (named as the model file names it)
        config.json, tokenizer files, sentence_bert_config.json, ...   copied from the source
        modules.json             Transformer -> Pooling (-> Normalize ...), the source's modules
        1_Pooling/config.json    (and every other module folder of the source)
        elastic_export.json      provenance: artifact directory, sparsity, precision, file sha256

sentence-transformers' Transformer module runs ``onnx/model.onnx`` through Optimum's
``ORTModelForFeatureExtraction``, which reads the graph's ``last_hidden_state`` output (the token
embeddings); the Pooling / Normalize modules then do what the project's ``sentence_embedding``
output does. A plain Hugging Face directory (no ``modules.json``) gets Transformer + mean Pooling,
the embedding the project ranks such a model with. Folders are written to a temporary directory
next to ``out`` and moved into place only when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from elastic_export.core import onnx_io
from elastic_export.core.budgets import budget_tag, parse_budgets
from elastic_export.core.errors import UserError
from elastic_export.core.fileio import OutputLock, check_creatable, file_sha256, umask
from elastic_export.core.manifest import Budget, Manifest, resolve
from elastic_export.core.precisions import FILE_KEYS

LAYOUT = "sentence-transformers"  # the main job's --layout value, and its folder in the artifact directory
ONNX_FILE = "onnx/model.onnx"
PROVENANCE = "elastic_export.json"
TOKEN_OUTPUT = "last_hidden_state"  # the output Optimum's ORTModelForFeatureExtraction reads
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt", ".onnx", ".onnx.data", ".onnx_data", ".gguf",
            ".index.json")
_SKIP = {"README.md", PROVENANCE}
_MEAN_POOLING = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
                 "pooling_mode_mean_sqrt_len_tokens": False}


def source_dir(manifest: Manifest, model: str | None = None) -> Path:
    """The model directory the artifacts were made from (``model`` overrides the manifest's source).

    Raises:
        UserError: not a local directory with a ``config.json`` and tokenizer files.
    """
    from elastic_export.models.text import has_tokenizer_files, model_folder

    info = manifest.model
    source = model if model is not None else info.source
    path = model_folder(source, None if model is not None else info.revision)  # the default imports torch
    what = f"--model {model}" if model is not None else f"model source {source!r}"
    if path is None or not (path / "config.json").is_file() or not has_tokenizer_files(path):
        raise UserError(f"{what}: not a local model directory with config.json and tokenizer files "
                        "(pass --model DIR, the directory the artifacts were made from)")
    return path


def st_modules(source: Path, outputs: Sequence[str]) -> list[dict]:
    """The folder's ``modules.json`` entries: the source's, or Transformer + mean Pooling for a plain
    Hugging Face directory whose graph has no embedding output of its own.

    Args:
        source: the model directory.
        outputs: the artifact graphs' output names.

    Raises:
        UserError: the graphs have no ``last_hidden_state``; the source's ``modules.json`` is unreadable
            or does not start with a Transformer at the directory root; a plain directory whose
            embedding is another output (``pooler_output``, ``text_embeds``: a head the layout cannot run).
    """
    if TOKEN_OUTPUT not in outputs:
        raise UserError(f"the ONNX graphs have no {TOKEN_OUTPUT!r} output (outputs: {', '.join(outputs)}); "
                        "sentence-transformers' ONNX backend needs the token embeddings")
    path = source / "modules.json"
    if not path.is_file():
        extra = [o for o in outputs if o != TOKEN_OUTPUT]
        if extra:
            raise UserError(f"{source}: no modules.json and the model's embedding is its {extra[0]!r} output, which "
                            "sentence-transformers' Transformer + Pooling cannot compute; give a sentence-transformers "
                            "directory (modules.json) that names its pooling")
        return [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    try:
        modules = json.loads(path.read_text())
        first = modules[0]
        ok = isinstance(first, dict) and str(first.get("type", "")).endswith("Transformer") and not first.get("path")
    except (OSError, ValueError, LookupError, TypeError, RecursionError) as e:
        raise UserError(f"{path}: unreadable sentence-transformers modules.json ({type(e).__name__}: {e})")
    if not ok or not all(isinstance(m, dict) and isinstance(m.get("path", ""), str) for m in modules):
        raise UserError(f"{path}: the first module must be a Transformer at the directory root (path \"\")")
    for m in modules[1:]:
        resolve(source, m.get("path") or None)  # module folders stay inside the source directory
    return modules


def select(manifest: Manifest, budgets: str | None, precisions: str | None) -> list[tuple[Budget, str]]:
    """The (budget entry, precision) pairs to write, in manifest order.

    Args:
        budgets: ``--budgets`` syntax (e.g. ``0.3,0.6``), each one of the manifest's; None: all.
        precisions: comma list of fp32 / fp16 / int8; None: every precision the manifest lists.

    Raises:
        UserError: an unknown precision, a sparsity the manifest lacks, a budget without that precision's file.
    """
    entries = manifest.budgets
    if budgets is not None:
        by_key = {round(b.sparsity, 6): b for b in entries}
        wanted = [round(s, 6) for s in parse_budgets(budgets)]
        missing = [s for s in wanted if s not in by_key]
        if missing:
            have = ", ".join(f"{b.sparsity:g}" for b in entries) or "none"
            raise UserError(f"--budgets: sparsity {missing[0]:g} is not one of the artifact's budgets ({have})")
        entries = [by_key[s] for s in dict.fromkeys(wanted)]
    names = [p.strip() for p in precisions.split(",")] if precisions is not None else (manifest.precisions or ["fp32"])
    bad = [p for p in names if p not in FILE_KEYS]
    if bad or not names:
        raise UserError(f"--precision {precisions}: {'unknown precision ' + repr(bad[0]) if bad else 'none given'}; "
                        f"choose a comma list of {', '.join(FILE_KEYS)}")
    if not entries:
        raise UserError("the artifact directory has no budgets")
    pairs = [(b, p) for b in entries for p in dict.fromkeys(names)]
    for b, p in pairs:
        if not b.file(p):
            raise UserError(f"budget {b.sparsity:g} has no {p} file; run the main job with --precision {p}")
    return pairs


def folder_name(sparsity: float, precision: str) -> str:
    """``s030-fp32``: the folder of one (budget, precision)."""
    return f"{budget_tag(sparsity)}-{precision}"


def _link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows it (the files are never modified in place), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _copy_source(source: Path, modules: list[dict], dest: Path) -> None:
    """The source directory less its weights, the top-level README and earlier ONNX exports, with
    ``modules.json`` and every module folder it names (mean Pooling where the source has none)."""
    for f in sorted(source.iterdir()):
        if f.is_file() and f.name not in _SKIP and not f.name.endswith(_WEIGHTS):
            shutil.copyfile(f, dest / f.name)
    for m in modules[1:]:
        sub = m.get("path") or ""
        if sub and (source / sub).is_dir():
            shutil.copytree(source / sub, dest / sub)
    (dest / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    if not (source / "modules.json").is_file():
        width = json.loads((source / "config.json").read_text()).get("hidden_size")
        (dest / "1_Pooling").mkdir(exist_ok=True)
        (dest / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": width, **_MEAN_POOLING}, indent=2) + "\n")


def write_folder(artifacts: Path, manifest: Manifest, source: Path, modules: list[dict], entry: Budget, precision: str,
                 dest: Path) -> Path:
    """Write one (budget, precision) folder at ``dest`` (which must not exist)."""
    rel = entry.file(precision)
    onnx_file = resolve(artifacts, rel)
    if not onnx_file.is_file():
        raise UserError(f"{artifacts / rel}: missing (named by the manifest for budget {entry.sparsity:g})")
    dest.mkdir(parents=True)
    _copy_source(source, modules, dest)
    model_file, *data = onnx_io.files(onnx_file)
    _link_or_copy(model_file, dest / ONNX_FILE)
    for f in data:  # external data: the model names it by its own file name, resolved beside the model
        _link_or_copy(f, (dest / ONNX_FILE).parent / f.name)
    info = {"artifact_dir": str(artifacts.resolve()), "model": manifest.model.source,
            "fingerprint": manifest.model.fingerprint, "sparsity": entry.sparsity,
            "achieved_sparsity": entry.achieved_sparsity, "gflops": entry.gflops, "precision": precision,
            "onnx": rel, "sha256": "sha256:" + file_sha256(dest / ONNX_FILE)}
    (dest / PROVENANCE).write_text(json.dumps(info, indent=2) + "\n")
    return dest


def check_text(manifest: Manifest, where: str) -> None:
    """Refuse artifacts of a model that is not a text encoder."""
    modality = manifest.model.modality
    if modality != "text":
        raise UserError(f"{where}: the model is not a text encoder (modality {modality!r}); the sentence-transformers "
                        "layout is for text encoders")


def write_layout(artifacts: Path, dest: Path, budgets: str | None = None, precisions: str | None = None,
                 model: str | None = None, manifest: Manifest | None = None) -> list[Path]:
    """Write every selected (budget, precision) folder under ``dest`` (created; no lock, no temp dir)."""
    manifest = manifest if manifest is not None else Manifest.load(artifacts)
    check_text(manifest, str(artifacts))
    source = source_dir(manifest, model)
    modules = st_modules(source, [o.name for o in manifest.outputs])
    pairs = select(manifest, budgets, precisions)
    dest.mkdir(parents=True, exist_ok=True)
    return [write_folder(artifacts, manifest, source, modules, b, p, dest / folder_name(b.sparsity, p))
            for b, p in pairs]


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that exists and is not an empty directory."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out}: exists and is not empty; choose a new directory")
    check_creatable(out, "--out")


def export_st(artifacts: str | Path, out: str | Path, budgets: str | None = None, precisions: str | None = None,
              model: str | None = None, echo: Callable[[str], None] = print) -> list[Path]:
    """``elastic-export export-st``: write the sentence-transformers folders of an artifact directory.

    Args:
        artifacts: the artifact directory (``manifest.json``) of a text encoder.
        out: a new (or empty) directory; it gets one folder per (budget, precision), e.g. ``s030-fp32``.
        budgets: sparsities to write (``--budgets`` syntax; default: all of the manifest's).
        precisions: comma list of fp32 / fp16 / int8 (default: every precision the manifest lists).
        model: the source model directory (default: the manifest's ``model.source``).

    Returns:
        The folders written (under ``out``).

    Raises:
        UserError: bad input (one line); nothing is written then.
    """
    artifacts, out = Path(artifacts), Path(out)
    manifest = Manifest.load(artifacts)
    check_text(manifest, str(artifacts))
    check_out(out)
    select(manifest, budgets, precisions)  # fail before anything is written
    st_modules(source_dir(manifest, model), [o.name for o in manifest.outputs])
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        check_out(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
        try:
            os.chmod(tmp, 0o777 & ~umask())
            folders = write_layout(artifacts, tmp, budgets, precisions, model, manifest)
            os.replace(tmp, out)  # an empty out is replaced; a non-empty one was refused above
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for f in folders:
        echo(f"wrote {out / f.name}")
    return [out / f.name for f in folders]
