"""Text in: raw strings to a text encoder's ONNX inputs with the model's own tokenizer (``tokenizers``, no torch).

:class:`TextEncoder` reads a folder holding the model's ``tokenizer.json`` (and, where present,
``tokenizer_config.json`` / ``special_tokens_map.json`` for the padding token and
``sentence_bert_config.json`` for the sentence-transformers ``max_seq_length``) and turns a list
of strings into ``input_ids`` / ``attention_mask`` / ``token_type_ids`` (int64, padded to the
longest text of the call, truncated to the model's maximum length), named as the ONNX inputs.

Used by :meth:`elastic_export.serving.runtime.ElasticRuntime.encode` and by the Triton router's ``text``
input; :func:`copy_tokenizer` puts the files next to either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np

from elastic_export.core.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "sentence_bert_config.json")
DEFAULT_MAX_LENGTH = 512
TOKENIZER_DIR = "tokenizer"  # an artifact directory's folder of tokenizer files (when it has one)
_KNOWN_INPUTS = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _token(value) -> str | None:
    """A special token as tokenizer configs write it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def max_length(folder: Path) -> int:
    """The longest input the model takes: sentence-transformers' ``max_seq_length``, else the
    tokenizer config's ``model_max_length`` (when sane), else :data:`DEFAULT_MAX_LENGTH`."""
    st = _json(folder / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(st, int) and st > 0:
        return st
    m = _json(folder / "tokenizer_config.json").get("model_max_length")
    return m if isinstance(m, int) and 0 < m <= 1_000_000 else DEFAULT_MAX_LENGTH


class TextEncoder:
    """Strings -> the model's ONNX inputs.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        input_names: the ONNX inputs to produce (``input_ids``, ``attention_mask``, ``token_type_ids``).
        max_len: truncation length.
        pad_token: the padding token (its id is looked up); None keeps the tokenizer's own padding.
    """

    def __init__(self, tokenizer, input_names: Sequence[str], max_len: int, pad_token: str | None = None):
        unknown = [n for n in input_names if n not in _KNOWN_INPUTS]
        if unknown:
            raise UserError(f"text input: the model takes {', '.join(unknown)}, which a tokenizer does not produce")
        self.tokenizer, self.input_names, self.max_len = tokenizer, list(input_names), int(max_len)
        tokenizer.enable_truncation(self.max_len)
        pad_id = tokenizer.token_to_id(pad_token) if pad_token else None
        if pad_id is not None:
            tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)
        elif tokenizer.padding is None:
            tokenizer.enable_padding()

    @classmethod
    def from_dir(cls, folder: str | Path, input_names: Sequence[str]) -> "TextEncoder":
        """The tokenizer in ``folder`` (its ``tokenizer.json``).

        Raises:
            UserError: no ``tokenizer.json`` there.
        """
        from tokenizers import Tokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise UserError(f"{folder}: no tokenizer.json (text input needs the model's fast tokenizer)")
        pad = (_token(_json(folder / "tokenizer_config.json").get("pad_token"))
               or _token(_json(folder / "special_tokens_map.json").get("pad_token")))
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), input_names, max_length(folder), pad)

    def encode(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """The inputs for ``texts`` (batch = ``len(texts)``), int64, padded to the longest.

        Raises:
            UserError: no texts, or an element that is not a string.
        """
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise UserError("encode: no texts")
        bad = [type(t).__name__ for t in texts if not isinstance(t, str)]
        if bad:
            raise UserError(f"encode: texts must be strings, got {bad[0]}")
        encodings = self.tokenizer.encode_batch(texts)
        return {name: np.array([getattr(e, _KNOWN_INPUTS[name]) for e in encodings], dtype=np.int64)
                for name in self.input_names}


def copy_tokenizer(source: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` that exist into ``dest`` (created); returns their names.

    Raises:
        UserError: ``source`` has no ``tokenizer.json``.
    """
    if not (source / "tokenizer.json").is_file():
        raise UserError(f"{source}: no tokenizer.json to serve text with")
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, dest / name)
            copied.append(name)
    return copied


def has_tokenizer_files(path: Path) -> bool:
    """Whether ``path`` holds a tokenizer (any of the files transformers' tokenizers load from)."""
    return any((path / f).exists() for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                                             "sentencepiece.bpe.model", "vocab.json"))


def model_folder(source: str | None, revision: str | None = None) -> Path | None:
    """The local folder a model was loaded from (the embedded default's too; a hub id's snapshot at
    ``revision``, from the cache or the hub), or None when ``source`` is not a directory (a timm
    name, a folder since moved).

    Raises:
        UserError: a hub id whose snapshot is neither cached nor reachable.
    """
    from elastic_export.models import hub

    if source in (None, hub.DEFAULT_MODEL):
        return hub.default_model_path()
    path = Path(str(source)).expanduser()
    if path.is_dir():
        return path
    ref = hub.parse(str(source), revision)
    return hub.snapshot(ref)[0] if ref is not None else None


def artifact_entry(encoder, directory: Path) -> dict | None:
    """The manifest's ``preprocess`` entry of a text encoder, its tokenizer files copied into
    ``directory/tokenizer/`` so the artifact directory turns raw text into model inputs on its own
    (:meth:`TextEncoder.from_manifest`); the model's fast tokenizer is saved there when its folder
    has no ``tokenizer.json``. None for other encoders or without a fast tokenizer."""
    if encoder.modality != "text":
        return None
    source = model_folder(encoder.source, encoder.revision)
    dest = directory / TOKENIZER_DIR
    if source is not None and encoder.tower is None and (source / "tokenizer.json").is_file():
        copy_tokenizer(source, dest)
    elif getattr(encoder.tokenizer, "is_fast", False):
        encoder.tokenizer.save_pretrained(str(dest))
    if not (dest / "tokenizer.json").is_file():
        return None
    return {"library": "tokenizers", "tokenizer": f"{TOKENIZER_DIR}/tokenizer.json", "max_length": max_length(dest)}


def tokenizer_folder(manifest, directory: Path) -> Path | None:
    """The folder of a directory's tokenizer: its manifest's ``preprocess`` entry, else the model's
    source folder (directories written before the tokenizer was carried), else None."""
    pp = getattr(manifest, "preprocess", None) or {}
    if pp.get("library") == "tokenizers" and pp.get("tokenizer"):
        path = (directory / pp["tokenizer"]).resolve()
        if directory.resolve() in path.parents and path.is_file():
            return path.parent
    try:
        folder = model_folder(manifest.model.source, manifest.model.revision)
    except UserError:
        return None
    return folder if folder is not None and (folder / "tokenizer.json").is_file() else None


def decode_utf8(values, error: type[Exception] = UserError) -> list[str]:
    """A text input's rows as strings (UTF-8 bytes decoded, strings kept).

    Raises:
        error: bytes that are not UTF-8 (one line naming the row and the byte).
    """
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"text {i} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        out.append(str(v))
    return out


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean of the token vectors under the attention mask (sentence-transformers' mean pooling)."""
    m = mask.astype(hidden.dtype)[..., None]
    return (hidden * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
