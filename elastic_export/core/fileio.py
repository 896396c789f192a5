"""Atomic file output: every file the tool writes appears whole or not at all."""

from __future__ import annotations

import hashlib
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
    from elastic_export.core.errors import UserError

    p = Path(path)
    ancestor = p.parent if str(p.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path}: {ancestor} is not a writable directory")



def existing_dir(directory: str | Path) -> Path:
    """``directory`` as a Path; a one-line :class:`UserError` when it is missing or not a directory."""
    from elastic_export.core.errors import UserError

    d = Path(directory)
    if not d.is_dir():
        raise UserError(f"{directory}: no such directory" if not d.exists() else f"{directory}: not a directory")
    return d

class OutputLock:
    """An exclusive lock on an output path, so two processes never write the same artifacts.

    The lock is ``fcntl.flock`` on ``.<name>.lock`` next to the output (created on acquire and
    removed on release); the kernel drops it when its process dies, so a killed run never leaves
    a stale lock. Usable as a context manager; :meth:`acquire` may be called before the parent
    directory exists (it then does nothing until called again once it does).

    Args:
        path: the output directory (or file) to protect.
        what: how the path is named in messages (e.g. ``--out``).
    """

    def __init__(self, path: str | Path, what: str = "--out") -> None:
        self.path = Path(path)
        parent = self.path.parent if str(self.path.parent) else Path(".")
        self.lock_path = parent / f".{self.path.name}.lock"
        self.what = what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        """Take the lock; False when the parent directory does not exist yet.

        Raises:
            UserError: another process holds the lock.
        """
        import fcntl

        from elastic_export.core.errors import UserError

        if self._fd is not None:
            return True
        if not self.lock_path.parent.is_dir():
            return False
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise UserError(f"{self.what} {self.path}: cannot write in {self.lock_path.parent} "
                                f"({e.strerror or e}); choose a writable location") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise UserError(f"{self.what} {self.path}: another elastic-export process (pid {owner}) is writing "
                                f"it; wait for it to finish or choose another {self.what}") from None
            except BaseException:
                os.close(fd)
                raise
            try:  # the holder before us may have removed the file after we opened it: lock the new one
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, str(os.getpid()).encode(), 0)
                self._fd = fd
                return True
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.lock_path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
