"""The output directory as a transaction: checked, locked, written in a temporary directory beside it,
moved into place only when complete (a killed run never leaves a half-written or damaged ``--out``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from elastic_export.core.errors import UserError
from elastic_export.core.fileio import OutputLock, check_creatable
from elastic_export.core.manifest import MANIFEST


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse an output directory that holds something other than a previous artifact set, and one
    that is (or contains) the working directory: the output is replaced as a whole."""
    resolved = out.resolve()
    if out.name in ("", ".", "..") or resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        raise UserError(f"--out {out}: give a directory of its own (e.g. {Path(out) / 'elastic-out'}); "
                        "it is replaced as a whole")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST).is_file() and not overwrite:
        raise UserError(f"--out {out}: exists and holds other files; pass --overwrite to replace it")
    check_creatable(out, "--out")  # parents are created only once the run succeeds this far


def clean_stale(out: Path, echo: Callable[[str], None] = print) -> None:
    """With ``out``'s lock held: remove the temporary directories that killed runs left next to
    it; if a run was killed between moving the previous artifact set aside and moving the new one
    in, put the previous set back first."""
    import glob

    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return
    name = glob.escape(out.name)
    olds = sorted(parent.glob(f".{name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not out.exists():
        os.replace(olds.pop(), out)
        echo(f"restored the previous {out} (a run was killed while replacing it)")
    for d in [*parent.glob(f".{name}.tmp-*"), *olds]:
        shutil.rmtree(d, ignore_errors=True)


def commit_out(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` directory to ``out``, replacing a previous one only now."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def claim_out(lock: OutputLock, out: Path, overwrite: bool, echo: Callable[[str], None]) -> bool:
    """Take ``out``'s lock (False while its parent does not exist); holding it, clear what killed
    runs left and check ``out`` again (another process may have written it meanwhile)."""
    if lock.held or not lock.acquire():
        return lock.held
    clean_stale(out, echo)
    prepare_out(out, overwrite)
    return True


def make_tmp(lock: OutputLock, out: Path, overwrite: bool, echo: Callable[[str], None]) -> Path:
    """Create ``out``'s parent, hold its lock and make the temporary directory next to it."""
    parent = out.parent if str(out.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    claim_out(lock, out, overwrite, echo)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
