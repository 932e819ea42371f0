"""User-facing errors: one clear line per problem, exit status 2, no traceback."""

from __future__ import annotations

import re
from collections.abc import Iterable


class KDUserError(Exception):
    """A mistake in the user's input (config, files, command line, budget).

    The CLI prints ``kd: error: <line>`` for each line of the message and exits with status 2.
    """

    exit_code = 2


class ConfigError(KDUserError):
    """Every problem found in a config, reported together.

    Args:
        problems: each one line when printed (:class:`kd.config.schema.Problem`: key, problem,
            fix); the errors layer names no config type, so that :mod:`kd.config` sits above it.
    """

    def __init__(self, problems: Iterable[object]):
        self.problems = list(problems)
        # One line per problem: a value or path quoted in a problem cannot break it.
        super().__init__("\n".join(one_line(str(p)) for p in self.problems))


def brief(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` of ``e`` and of its root cause, shortened to fit one
    error line (a wrapper such as ``DatasetGenerationError`` hides the useful part in its cause)."""

    def one(x: BaseException) -> str:
        lines = str(x).strip().splitlines()
        return f"{type(x).__name__}: {lines[0]}" if lines else type(x).__name__

    root = e
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = one(e) if root is e else f"{one(e)} <- {one(root)}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str) -> str:
    """``text`` with line breaks and other non-printable characters escaped (``\\n``, ``\\u202e``).

    Values and paths quoted in a message pass through it, so they cannot split the message's one
    line (the CLI prints one ``kd: error:`` line per line) or reorder what the terminal shows.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# A URL's user information (``scheme://user:password@``), up to the last ``@`` before its path.
_USERINFO = re.compile(r"(?<=://)[^/?#\s]*@")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URL's ``user:password@`` shown as ``***@`` and each of ``secrets``
    (an API token) as ``***``: the one filter of what kd prints or logs of a URL or a server's
    answer, so no credential reaches an error line, a log, a manifest or a metric sink."""
    out = _USERINFO.sub("***@", text)
    for secret in secrets:
        if secret:
            out = out.replace(secret, "***")
    return out
