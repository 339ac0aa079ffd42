"""The error type for invalid configurations: a list of problems, each with a fix."""

from __future__ import annotations

import sys
from typing import Iterable, List, Sequence


class ConfigError(Exception):
    """One or more problems with a job's configuration. `problems` is one line per problem."""

    def __init__(self, problems: Iterable[str]):
        self.problems: List[str] = list(problems)
        super().__init__("\n".join(self.problems))


def print_problems(headline: str, problems: Sequence[str]) -> None:
    """`headline (N problems):` then one indented line per problem, on stderr: how every refusal
    (an invalid configuration, a stopped prepare) is shown."""
    n = len(problems)
    sys.stderr.write(f"{headline} ({n} problem{'s' if n > 1 else ''}):\n")
    for problem in problems:
        sys.stderr.write(f"  - {problem}\n")
    sys.stderr.flush()
