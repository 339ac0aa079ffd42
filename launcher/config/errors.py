"""The error type for invalid configurations: a list of problems, each with a fix."""

from __future__ import annotations

from typing import Iterable, List


class ConfigError(Exception):
    """One or more problems with a job's configuration. `problems` is one line per problem."""

    def __init__(self, problems: Iterable[str]):
        self.problems: List[str] = list(problems)
        super().__init__("\n".join(self.problems))
