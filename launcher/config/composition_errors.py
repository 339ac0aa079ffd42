"""Hydra's composition errors as the CLI's problem lines: the mistake, the closest valid names, a Fix.

The CLI checks the command line's keys and options itself first (launcher/config/overrides.py);
what reaches Hydra and fails there (a recipe naming a missing option or key, a value of the wrong
type, a new key of `cluster.env` set without `+`) is translated here. Hydra's config search path and
its `To append to your config use +key=` advice never reach the user.
"""

from __future__ import annotations

import re
from typing import List

from hydra.errors import MissingConfigException

from launcher.config.overrides import RECIPE_GROUP, schema_keys
from launcher.config.suggest import unknown_key_problem, unknown_option_problem

GENERIC_FIX = "Fix: check the key name and the value's type (`train --cfg job` prints the composed config)."

# "In 'recipe/mine': ..." names the file being composed; "train" is conf/train.yaml (or the command line).
_IN_FILE = re.compile(r"^In '([^']+)':")
_MISSING_KEY = re.compile(r"Key '([^']+)' (?:not in|is not in struct)")
_FULL_KEY = re.compile(r"full_key: (\S+)")
_APPEND_ADVICE = re.compile(r"To append to your config use (\+\S+)")
_SWEEP_IN_A_RUN = re.compile(r"Ambiguous value for argument '(([^=']+)=([^']*))'")


def composition_problem(err: BaseException) -> str:
    """One problem line, with a Fix, for an exception of Hydra's composition."""
    text = str(err).strip()
    cause = err.__cause__
    details = text + ("\n" + str(cause).strip() if cause is not None else "")
    where_match = _IN_FILE.match(text)
    where = where_match.group(1) if where_match and where_match.group(1) != "train" else ""
    if isinstance(err, MissingConfigException) and err.missing_cfg_file and "/" in err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        typed = f"+{group}" if group == RECIPE_GROUP else group
        return unknown_option_problem(group, option, err.options or [], typed, where)
    sweep = _SWEEP_IN_A_RUN.search(text)
    if sweep:
        typed, key, values = sweep.groups()
        return (f"{typed} gives several values to one job. Fix: {key}=[{values}] for a list, or `train -m ...` "
                f"to run one job per value.")
    full_key = _FULL_KEY.search(details)
    if _MISSING_KEY.search(details) and full_key:
        return _missing_key_problem(full_key.group(1), text, where)
    return _generic_problem(text, cause)


def _missing_key_problem(full_key: str, text: str, where: str) -> str:
    parent = full_key.rpartition(".")[0]
    known = schema_keys(parent)
    if known is not None:
        return unknown_key_problem(full_key, known, where=where)
    source = f" (set in {where})" if where else ""
    # A free-form map (cluster.env): new keys are added with `+`, which is the right advice here.
    advice = _APPEND_ADVICE.search(text)
    fix = advice.group(1) if advice else f"+{full_key}=VALUE"
    return f"{full_key}{source} is a new key of {parent}, which takes new keys with `+`. Fix: {fix}."


def _generic_problem(text: str, cause: BaseException | None) -> str:
    lines: List[str] = []
    for line in text.splitlines():
        if line.strip().startswith("Config search path"):
            break  # what follows lists Hydra's search path: no help to a user
        if line.strip() and not _APPEND_ADVICE.search(line):
            lines.append(line.strip())
    msg = " ".join(lines)
    if cause is not None and str(cause).strip():
        msg += f" ({str(cause).strip().splitlines()[0]})"
    return f"{msg}. {GENERIC_FIX}"
