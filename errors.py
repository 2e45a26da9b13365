"""The one base class for errors a user can fix (bad recipe, missing file, weights that do not fit).

The CLI turns any :class:`OmforgeError` into one line on stderr and exit code 2, never a traceback.
"""


class OmforgeError(ValueError):
    """A user-facing error; ``str(err)`` is one line naming what was wrong and where."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception's text on one line, cut at ``limit`` characters (for errors that quote a library's)."""
    text = " ".join(str(e).split())
    return text[:limit] + ("…" if len(text) > limit else "")
