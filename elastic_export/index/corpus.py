"""A corpus to index: ``.txt`` (one document per line; its id is the 1-based line number, blank lines
skipped) or ``.jsonl`` (one object per line with an id field and a text field), checked whole before
anything is embedded."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_export.core.errors import UserError

FORMATS = {".txt": "txt", ".jsonl": "jsonl"}


@dataclass(frozen=True)
class Corpus:
    """Documents (ids in file order, their texts) and where they came from."""

    path: Path
    format: str
    ids: list[Any]
    texts: list[str]
    sha256: str
    id_field: str | None = None
    text_field: str | None = None

    def describe(self) -> dict[str, Any]:
        """The manifest's ``index.corpus`` entry."""
        d: dict[str, Any] = {"path": str(self.path), "format": self.format, "sha256": self.sha256, "count": len(self.ids)}
        if self.format == "jsonl":
            d.update(id_field=self.id_field, text_field=self.text_field)
        return d


def read_corpus(path: str | Path, id_field: str = "id", text_field: str = "text") -> Corpus:
    """Read and check a corpus.

    Raises:
        UserError: one line: no such file, unknown extension, unreadable or not UTF-8, empty, an
            invalid JSON line, a line that is not an object, a missing or empty field, a duplicate id.
    """
    p = Path(path)
    kind = FORMATS.get(p.suffix.lower())
    if kind is None:
        raise UserError(f"corpus {path}: expected a .txt (one document per line) or .jsonl file")
    if not p.is_file():
        raise UserError(f"corpus {path}: no such file")
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"corpus {path}: not UTF-8 text")
    except OSError as e:
        raise UserError(f"corpus {path}: unreadable ({e.strerror or e})")
    if kind == "txt":
        ids, texts = _txt(text)
    else:
        ids, texts = _jsonl(text, p, id_field, text_field)
    if not ids:
        raise UserError(f"corpus {path}: no documents")
    digest = hashlib.sha256(raw).hexdigest()
    fields = (id_field, text_field) if kind == "jsonl" else (None, None)
    return Corpus(p, kind, ids, texts, digest, *fields)


def _txt(text: str) -> tuple[list[Any], list[str]]:
    pairs = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    return [n for n, _ in pairs], [t for _, t in pairs]


def _jsonl(text: str, path: Path, id_field: str, text_field: str) -> tuple[list[Any], list[str]]:
    ids: list[Any] = []
    texts: list[str] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise UserError(f"corpus {path}:{n}: not a JSON line")
        if not isinstance(obj, dict):
            raise UserError(f"corpus {path}:{n}: expected a JSON object with fields {id_field!r} and {text_field!r}")
        doc_id, doc = obj.get(id_field), obj.get(text_field)
        if isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)) or doc_id == "":
            what = "missing" if id_field not in obj else "not a string or integer"
            raise UserError(f"corpus {path}:{n}: id field {id_field!r} {what} (--id-field names it)")
        if not isinstance(doc, str) or not doc.strip():
            what = "missing" if text_field not in obj else "not a non-empty string"
            raise UserError(f"corpus {path}:{n}: text field {text_field!r} {what} (--text-field names it)")
        key = str(doc_id)  # 1 and "1" name one document
        if key in seen:
            raise UserError(f"corpus {path}:{n}: duplicate id {doc_id!r} (first on line {seen[key]})")
        seen[key] = n
        ids.append(doc_id)
        texts.append(doc)
    return ids, texts
