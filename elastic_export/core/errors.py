"""The one exception type that means "the user gave us something we cannot use"."""


class UserError(Exception):
    """Bad input. The CLI prints ``error: <message>`` on one line and exits with code 2.

    The message names the problem and, where there is one, the fix.
    """


class CheckFailed(Exception):
    """A check found artifacts that differ from their reference (``elastic-export verify``).

    The CLI prints ``error: <message>`` on one line and exits with code 1 (bad input stays 2).
    """


class Interrupted(KeyboardInterrupt):
    """Ctrl-C where there is a way to go on. The CLI prints ``interrupted; <message>`` (the message
    says how to continue, e.g. ``--resume``) and exits with code 130, as for a plain Ctrl-C."""


ERROR_CHARS = 300  # an error quoted inside a longer line (a check row, a hint) is cut here


def first_line(e: BaseException | str, empty: str | None = None, limit: int | None = None) -> str:
    """The first line of an exception's message (or of a message string), cut at ``limit`` characters;
    when it is empty, ``empty``, else an exception's type name (a string: ``""``)."""
    lines = str(e).strip().splitlines()
    if lines:
        line = lines[0]
    elif empty is not None:
        line = empty
    else:
        line = "" if isinstance(e, str) else type(e).__name__
    return line[:limit] if limit is not None else line
