"""User-facing errors: one clear line per problem, exit status 2, no traceback."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kd.config.schema import Problem


class KDUserError(Exception):
    """A mistake in the user's input (config, files, command line, budget).

    The CLI prints ``kd: error: <line>`` for each line of the message and exits with status 2.
    """

    exit_code = 2


class ConfigError(KDUserError):
    """Every problem found in a config, reported together."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))
