"""Atomic file output: every file the tool writes appears whole or not at all."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def umask() -> int:
    """The process umask (read without changing it for longer than the call)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file next to ``path``, then rename it to ``path``.

    The temporary file gets the permissions a normal file would (0666 less the umask); it is
    removed if ``write`` fails, so ``path`` is either the previous file or the complete new one.
    """
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def check_creatable(path: str | Path, what: str) -> None:
    """Refuse (one-line :class:`UserError`) a path whose nearest existing ancestor is not a
    writable directory. Nothing is created: missing parents are made only when writing."""
    from elastic_export.errors import UserError

    p = Path(path)
    ancestor = p.parent if str(p.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path}: {ancestor} is not a writable directory")
