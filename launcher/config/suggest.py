"""'Did you mean': the problem lines for a mistyped config key or group option, closest names first.

Closeness is difflib's ratio, so `trainer.setps` finds `trainer.steps` and `lama8b` finds `llama8b`.
A key is never answered with `+key=`: a `+` key must still be in the schema (launcher/config/schema.py),
so adding it fails again; the only keys `+` can add are those of free-form maps such as `cluster.env`.
"""

from __future__ import annotations

import difflib
from typing import Iterable, List, Optional

# difflib's default cutoff (0.6) keeps `setps`/`steps` and `lama8b`/`llama8b` and drops unrelated names.
CLOSE_ENOUGH = 0.6
MAX_SUGGESTIONS = 3


def closest(word: str, choices: Iterable[str], n: int = MAX_SUGGESTIONS) -> List[str]:
    """Up to n choices close enough to `word` to be what was meant, the closest first."""
    return difflib.get_close_matches(word, sorted(set(choices)), n=n, cutoff=CLOSE_ENOUGH)


def by_closeness(word: str, choices: Iterable[str]) -> List[str]:
    """Every choice, the closest to `word` first (ties in name order)."""
    return sorted(set(choices), key=lambda c: (-difflib.SequenceMatcher(None, word, c).ratio(), c))


def _or_list(names: List[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


# Keys a release renamed: old dotted name -> new one, so old configs get the exact fix.
RENAMED_KEYS = {"run_name": "run.name"}


def unknown_key_problem(dotted: str, known: Iterable[str], value: Optional[str] = None, where: str = "") -> str:
    """The problem line for `dotted` (a.b.c), a key its group does not have; `known` are the
    group's keys. With the value typed on the command line, the Fix is the corrected override;
    `where` names the file that sets the key (empty: the command line or unknown)."""
    source = f" (set in {where})" if where else ""
    if dotted in RENAMED_KEYS:
        new_name = RENAMED_KEYS[dotted]
        fix = f"{new_name}={value}" if value is not None else f"rename it to {new_name}"
        return f"{dotted}{source} was renamed {new_name}. Fix: {fix}."
    group, _, name = dotted.rpartition(".")
    owner = group or "the job"
    prefix = f"{group}." if group else ""
    near = [prefix + k for k in closest(name, known)]
    if near:
        fix = f"{near[0]}={value}" if value is not None else f"rename it to {near[0]}"
        return f"{dotted}{source} is not a key of {owner}; did you mean {_or_list(near)}? Fix: {fix}."
    return (f"{dotted}{source} is not a key of {owner}, whose keys are: {', '.join(sorted(known))}. "
            f"Fix: one of those keys (`train --cfg job` prints every key).")


def unknown_option_problem(group: str, option: str, choices: Iterable[str], typed: str, where: str = "") -> str:
    """The problem line for `group=option` naming no file of the group: every choice, closest first.

    `typed` is how the override is written (`+recipe` or `model`), `where` the file whose
    defaults named the option (empty: the command line)."""
    ordered = by_closeness(option, choices)
    near = closest(option, ordered, n=1)
    source = f" (named in {where})" if where else ""
    kind = "recipe" if group == "recipe" else f"{group} option"
    head = f"{typed}={option}{source}: there is no {kind} named {option!r}"
    if not ordered:
        return f"{head}, and the group has none. Fix: remove {typed}={option}."
    guess = f"; did you mean {near[0]}?" if near else "."
    found_in = " (recipes/ and $LAUNCHER_RECIPES)" if group == "recipe" else f" (conf/{group}/)"
    fix = f"{typed}={near[0] if near else ordered[0]}"
    return f"{head}{guess} The choices{found_in}, closest first: {', '.join(ordered)}. Fix: {fix}."
