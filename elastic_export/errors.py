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


def first_line(e: BaseException | str, empty: str | None = None) -> str:
    """The first line of an exception's message (or of a message string); when it is empty, ``empty``
    or else the exception's type name."""
    lines = str(e).strip().splitlines()
    if lines:
        return lines[0]
    return empty if empty is not None else type(e).__name__
