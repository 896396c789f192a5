"""Calibration data: batches of model inputs for the ranking stage.

Sources, by modality:

* text: a ``.txt`` file (one passage per line), a ``.jsonl`` file (``{"text": ...}`` per line, or
  ``query`` / ``doc`` fields, or bare strings), or by default paragraphs of the Python reference
  carried by the interpreter (``pydoc_data.topics``), so nothing is downloaded;
* image: a directory of images (class sub-folders allowed), preprocessed with the model's own
  mean / std / size; by default deterministic synthetic images (smooth random colour fields).

Labels: for a classifier (a model with a ``logits`` output), images in class sub-folders carry
labels when every folder names one of the model's classes: its index (``0``, ``1``, ...), its label
name from the model's pretrained config, or, for 1000-class models, its ImageNet synset id
(``n01440764``). The ranking then trains on cross-entropy with those labels (``--loss auto``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from elastic_export.core.errors import UserError
from elastic_export.models import preprocess
from elastic_export.models.encoder import Encoder

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
DEFAULT_TEXT_SOURCE = "pydoc_data.topics (Python reference)"  # the description's source of the built-in texts
SYNTHETIC_SOURCE = "synthetic colour fields"  # ... and of the built-in (synthetic) images


@dataclass
class Calibration:
    """Input batches plus a description that goes into the ranking file."""

    batches: list[dict[str, torch.Tensor]]
    description: dict = field(default_factory=dict)
    labels: list[torch.Tensor] | None = None  # class indices per batch (classifiers with labelled data)


def default_texts() -> list[str]:
    """The Python language reference shipped with the interpreter, in a fixed order: each
    paragraph, followed by its first sentence on its own, so that short inputs (queries) and long
    ones (passages) are both represented."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for para in topics[key].split("\n\n"):
            text = " ".join(para.split())
            if len(text) < 80:
                continue
            out.append(text)
            first = text.split(". ")[0].rstrip(".") + "."
            if 4 <= len(first.split()) <= 30 and first != text:
                out.append(first)
    return out


def source_texts(path: str | None) -> list[str]:
    """The texts of a calibration source: a ``.txt`` / ``.jsonl`` file, or the built-in ones (None)."""
    return default_texts() if path is None else read_text_file(Path(path))


@dataclass(frozen=True)
class Drawn:
    """What a calibration drew: ``size`` samples spread evenly over ``source`` (a file or image
    directory; None: the built-in data), ``seed`` for synthetic images; ``size`` None: not recorded."""

    source: str | None
    size: int | None
    seed: int = 0

    @classmethod
    def from_meta(cls, meta: dict) -> Drawn | None:
        """What a ranking was calibrated on, from its file's metadata (``calibration``: the
        :class:`Calibration` description; ``hyperparameters``: ``calib_size``, ``seed``); None when
        it read no data."""
        desc, hyper = meta.get("calibration") or {}, meta.get("hyperparameters") or {}
        source = desc.get("source")
        if source is None:
            return None
        size, seed = hyper.get("calib_size", desc.get("samples")), hyper.get("seed", desc.get("seed", 0))
        ok = isinstance(size, int) and not isinstance(size, bool) and size > 0
        return cls(None if source in (DEFAULT_TEXT_SOURCE, SYNTHETIC_SOURCE) else str(source), size if ok else None,
                   seed if isinstance(seed, int) and not isinstance(seed, bool) else 0)

    def same_as(self, other: Drawn, seeded: bool = True) -> bool:
        """The same samples: the same source (paths compared resolved), size and (``seeded``) seed."""
        if (self.source is None) != (other.source is None) or self.size != other.size:
            return False
        if seeded and self.seed != other.seed:
            return False
        return self.source is None or Path(self.source).resolve() == Path(other.source).resolve()

    def __str__(self) -> str:
        return f"{self.size} spread evenly over {self.source or 'the built-in data'}"

    def unknown(self, kind: str) -> str | None:
        """Why the samples drawn cannot be known here (None: they can)."""
        if self.size is None:
            return f"the ranking file records no calibration size for {self.source or 'the built-in data'}: " \
                   f"held-out {kind} may include some the ranking was calibrated on"
        if self.source is not None and not Path(self.source).exists():
            return f"the ranking was calibrated on {self.source}, which does not exist here: held-out {kind} may " \
                   f"include some of its {self.size} calibration {kind}"
        return None


def drawn_texts(drawn: Drawn | None, ours: Drawn) -> tuple[list[str], str | None]:
    """The texts ``drawn`` took beyond ``ours``'s ([] when the same or None) and, when they cannot be
    read, why not (the held-out texts then cannot be guaranteed disjoint from them)."""
    if drawn is None or drawn.same_as(ours, seeded=False):
        return [], None
    why = drawn.unknown("texts")
    if why is not None:
        return [], why
    try:
        return evenly_spaced(source_texts(drawn.source), drawn.size), None
    except UserError as e:
        return [], f"the ranking's calibration texts cannot be read ({e}): held-out texts may include some of them"


def drawn_files(drawn: Drawn | None, ours: Drawn) -> tuple[set[Path], str | None]:
    """The image files (resolved) ``drawn`` took beyond ``ours``'s, as :func:`drawn_texts` (synthetic
    images: none; they are told apart by their seed and position in the stream)."""
    if drawn is None or drawn.source is None or drawn.same_as(ours):
        return set(), None
    why = drawn.unknown("images")
    if why is not None:
        return set(), why
    try:
        return {f.resolve() for f in evenly_spaced(image_files(Path(drawn.source)), drawn.size)}, None
    except UserError as e:
        return set(), f"the ranking's calibration images cannot be listed ({e}): held-out images may include some"


def synthetic_skip(drawn: Drawn | None, size: int, seed: int) -> tuple[int, str | None]:
    """How many images of the synthetic stream of ``seed`` a held-out set skips: the calibration's
    ``size``, or ``drawn``'s where it drew more of the same stream; and why that cannot be known."""
    if drawn is None or drawn.source is not None or drawn.seed != seed:
        return size, None
    if drawn.size is None:
        return size, drawn.unknown("images")
    return max(size, drawn.size), None


def _prefix_key(text: str) -> str:
    return " ".join(text.split()).rstrip(".")


def overlapping(texts: list[str], used: list[str]) -> set[str]:
    """The texts of ``texts`` that equal, are a prefix of, or start with one of ``used`` (whitespace
    normalised, final full stops ignored): the calibration adds each paragraph's first sentence as its
    own sample (:func:`default_texts`), so a text held out from it must be neither."""
    import bisect

    keys = sorted({_prefix_key(u) for u in used})
    found = set()
    for t in texts:
        k = _prefix_key(t)
        i = bisect.bisect_left(keys, k)
        if i < len(keys) and keys[i].startswith(k):  # a prefix of (or equal to) a used text
            found.add(t)
    by_key = sorted((_prefix_key(t), t) for t in texts)
    for u in keys:  # texts that start with a used one
        i = bisect.bisect_left(by_key, (u, ""))
        while i < len(by_key) and by_key[i][0].startswith(u):
            found.add(by_key[i][1])
            i += 1
    return found


def evenly_spaced(items: list, size: int) -> list:
    """``size`` items evenly spaced over ``items`` (deterministic)."""
    if len(items) <= size:
        return list(items)
    step = len(items) / size
    return [items[int(i * step)] for i in range(size)]


def read_text(path: Path, option: str, expected: str) -> str:
    """The UTF-8 text of a user's file; a one-line :class:`UserError` otherwise."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{option} {path}: not UTF-8 text ({expected})")
    except OSError as e:
        raise UserError(f"{option} {path}: unreadable ({e.strerror or e})")


def json_lines(raw: str, path: Path, option: str) -> list[tuple[int, object]]:
    """(line number, value) of every non-blank line of a JSONL text."""
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except ValueError:
            raise UserError(f"{option} {path}:{n}: not a JSON line")
    return out


def read_text_file(path: Path) -> list[str]:
    raw = read_text(path, "--calib", "text models take .txt or .jsonl calibration files")
    texts: list[str] = []
    if path.suffix.lower() in (".jsonl", ".json"):
        for _, obj in json_lines(raw, path, "--calib"):
            if isinstance(obj, str):
                texts.append(obj)
            elif isinstance(obj, dict):
                texts.extend(str(obj[k]) for k in ("text", "query", "doc") if isinstance(obj.get(k), str))
    else:
        texts = [line.strip() for line in raw.splitlines()]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise UserError(f"--calib {path}: no text found (one passage per line, or JSONL with a 'text' field)")
    return texts


def by_length(encoder: Encoder, texts: list[str]) -> list[str]:
    """``texts`` ordered by token count (stable), so that each batch holds texts of about one length
    and pads little: batches padded to their longest text spend half their tokens on padding with
    the default calibration text, which pairs each paragraph with its first sentence."""
    if encoder.tokenizer is not None:
        lengths = [len(ids) for ids in encoder.tokenizer(texts, truncation=True, max_length=encoder.seq_len)["input_ids"]]
    else:
        lengths = [min(len(t.split()), encoder.seq_len) for t in texts]
    return [texts[i] for i in sorted(range(len(texts)), key=lambda i: lengths[i])]


def text_batches(encoder: Encoder, texts: list[str], batch_size: int) -> list[dict[str, torch.Tensor]]:
    names = [s.name for s in encoder.input_specs()]
    batches = []
    for i in range(0, len(texts), batch_size):
        chunk = texts[i : i + batch_size]
        if encoder.tokenizer is not None:
            enc = encoder.tokenizer(
                chunk, padding="longest", truncation=True, max_length=encoder.seq_len, return_tensors="pt"
            )
            feeds = {n: enc[n].long() if n in enc else torch.zeros_like(enc["input_ids"]) for n in names}
        else:  # no tokenizer in the model directory: hash words into the vocabulary
            vocab = encoder.module.config.vocab_size
            rows = [[1 + (hash_word(w) % (vocab - 1)) for w in t.split()][: encoder.seq_len] or [1] for t in chunk]
            width = max(len(r) for r in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, row in enumerate(rows):
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, : len(row)] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in names:
                feeds["token_type_ids"] = torch.zeros_like(ids)
        batches.append(feeds)
    return batches


def hash_word(word: str) -> int:
    """A stable (process-independent) hash of a word."""
    h = 2166136261
    for ch in word.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def image_files(path: Path) -> list[Path]:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTS)
    if not files:
        raise UserError(f"--calib {path}: no image files found (.jpg, .png, ...)")
    return files


def class_index(encoder: Encoder) -> dict[str, int]:
    """Folder names that name the model's classes -> class index (empty for non-classifiers)."""
    if "logits" not in encoder.output_names():
        return {}
    n = int(getattr(encoder.module, "num_classes", 0) or 0)
    names = {str(i): i for i in range(n)}
    cfg = getattr(encoder.module, "pretrained_cfg", None) or {}
    label_names = cfg.get("label_names") if isinstance(cfg, dict) else None
    if not label_names and n == 1000:
        try:
            from timm.data import ImageNetInfo

            label_names = ImageNetInfo().label_names()
        except Exception:  # no timm label info: indices only
            label_names = None
    for i, name in enumerate(label_names or []):
        if i < n:
            names.setdefault(str(name), i)
    return names


def _folder_labels(encoder: Encoder, root: Path, files: list[Path]) -> tuple[list[int] | None, str]:
    """Class index of every file from its class sub-folder, or None and why not."""
    index = class_index(encoder)
    if not index:
        return None, "none (the model has no logits output)"
    labels, unknown = [], set()
    for f in files:
        parts = f.relative_to(root).parts
        if len(parts) < 2:
            return None, "none (images not in class sub-folders)"
        if parts[0] not in index:
            unknown.add(parts[0])
        labels.append(index.get(parts[0], -1))
    if unknown:
        return None, f"none ({len(unknown)} folders name no model class, e.g. {sorted(unknown)[0]!r})"
    return labels, f"{len(set(labels))} classes from sub-folders"


def _image_tensors(path: Path, cfg: dict, size: int,
                   encoder: Encoder | None = None) -> tuple[list[torch.Tensor], int, list[int] | None, str]:
    from PIL import Image

    files = evenly_spaced(image_files(path), size)
    labels, why = _folder_labels(encoder, path, files) if encoder is not None else (None, "none")
    prep = preprocess.transform(cfg)
    out, kept, failed = [], [], 0
    for j, f in enumerate(files):
        try:
            with Image.open(f) as img:
                out.append(prep(img))
            kept.append(j)
        except Exception:
            failed += 1
    if not out:
        raise UserError(f"--calib {path}: none of the images could be decoded ({failed} failed)")
    return out, failed, [labels[j] for j in kept] if labels is not None else None, why


def synthetic_images(cfg: dict, size: int, seed: int) -> list[torch.Tensor]:
    """Deterministic smooth random colour fields, normalised like real inputs."""
    g = torch.Generator().manual_seed(seed)
    _, h, w = cfg["input_size"]
    mean = torch.tensor(cfg["mean"]).view(3, 1, 1)
    std = torch.tensor(cfg["std"]).view(3, 1, 1)
    out = []
    for _ in range(size):
        coarse = torch.rand(1, 3, 4, 4, generator=g)
        fine = torch.rand(1, 3, 16, 16, generator=g)
        img = 0.7 * F.interpolate(coarse, size=(h, w), mode="bilinear") + 0.3 * F.interpolate(
            fine, size=(h, w), mode="bilinear"
        )
        out.append((img[0] - mean) / std)
    return out


def load_calibration(
    encoder: Encoder, path: str | None = None, size: int = 64, batch_size: int = 16, seed: int = 0
) -> Calibration:
    """Calibration batches for ``encoder``.

    Args:
        encoder: the model (decides modality and preprocessing).
        path: text / JSONL file or image directory; None for the built-in default.
        size: number of samples.
        batch_size: samples per batch.
        seed: for synthetic data.

    Raises:
        UserError: missing, empty, unreadable or wrong-modality data.
    """
    if size < 1:
        raise UserError(f"--calib-size must be positive, got {size}")
    p = Path(path) if path else None
    if p is not None and not p.exists():
        raise UserError(f"--calib {path}: no such file or directory")
    if encoder.modality == "text":
        if p is None:
            texts, desc = default_texts(), {"source": DEFAULT_TEXT_SOURCE}
        elif p.is_dir():
            raise UserError(f"--calib {path}: a directory; text models take a .txt or .jsonl file")
        else:
            texts, desc = read_text_file(p), {"source": str(p)}
        texts = by_length(encoder, evenly_spaced(texts, size))
        desc.update(samples=len(texts), seq_len=encoder.seq_len, tokenizer=encoder.tokenizer is not None,
                    batches="length-bucketed")
        return Calibration(text_batches(encoder, texts, batch_size), desc)
    cfg = encoder.data_config
    labels = None
    if p is None:
        images, desc = synthetic_images(cfg, size, seed), {"source": SYNTHETIC_SOURCE, "seed": seed}
    elif not p.is_dir():
        raise UserError(f"--calib {path}: image models take a directory of images")
    else:
        images, failed, labels, why = _image_tensors(p, cfg, size, encoder)
        desc = {"source": str(p), "failed_to_decode": failed, "labels": why}
    desc.update(samples=len(images), input_size=list(cfg["input_size"]))
    starts = range(0, len(images), batch_size)
    batches = [{"pixel_values": torch.stack(images[i : i + batch_size])} for i in starts]
    label_batches = None if labels is None else [torch.tensor(labels[i : i + batch_size]) for i in starts]
    return Calibration(batches, desc, label_batches)
