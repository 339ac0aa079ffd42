"""Command-line overrides checked against the schema and the config groups before Hydra composes.

Hydra stops at the first mistake and answers a mistyped key with `To append to your config use
+key=...` (wrong here: the schema has no such key either way) and a missing option with its config
search path. These checks read only the schema's dataclasses and the group folders, so they name
every mistyped key and option of a command at once, with the closest valid names, in milliseconds.
What they leave alone (values, syntax Hydra reads differently) Hydra's composition still checks.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException

from launcher.config.schema import JobConfig
from launcher.config.store import available_recipes
from launcher.config.suggest import closest, unknown_key_problem, unknown_option_problem
from launcher.paths import config_dir

RECIPE_GROUP = "recipe"


def config_groups() -> Dict[str, List[str]]:
    """Each config group and its options: the folders of conf/ (`model=NAME`) and the recipes
    (`+recipe=NAME`, from recipes/ and $LAUNCHER_RECIPES)."""
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in config_dir().iterdir() if d.is_dir()}
    groups[RECIPE_GROUP] = available_recipes()
    return groups


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _without_optional(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp


def _value_text(override: Override) -> Optional[str]:
    """The value as typed (a sweep `1,2` too); None for `~key`."""
    if override.is_delete():
        return None
    return (override.input_line or "").partition("=")[2] or override.get_value_element_as_str()


def schema_keys(dotted: str) -> Optional[List[str]]:
    """The keys the schema declares at `dotted` (a.b; "" for the job), or None where it declares
    none (a free-form map, a list, an untyped field, or no such key)."""
    node: Any = JobConfig
    for part in dotted.split(".") if dotted else []:
        node = _without_optional(node)
        if not dataclasses.is_dataclass(node) or part not in _field_types(node):
            return None
        node = _field_types(node)[part]
    node = _without_optional(node)
    return sorted(_field_types(node)) if dataclasses.is_dataclass(node) else None


def key_problem(override: Override) -> Optional[str]:
    """The problem with a `key=value` override's key (a.b.c), or None when the schema has it.

    Below a free-form map (`cluster.env`), a list or an untyped field any key is the value's own
    business: Hydra and the validator check those.
    """
    parts = override.key_or_group.split(".")
    value = _value_text(override)
    node: Any = JobConfig
    for depth, part in enumerate(parts):
        node = _without_optional(node)
        if not dataclasses.is_dataclass(node):
            return None
        fields = _field_types(node)
        if part not in fields:
            if depth == 0 and closest(part, [RECIPE_GROUP]):
                return (f"{part} is not a key of the job; did you mean +{RECIPE_GROUP}? "
                        f"Fix: +{RECIPE_GROUP}={value}.")
            last = depth == len(parts) - 1
            return unknown_key_problem(".".join(parts[: depth + 1]), fields, value if last else None)
        node = fields[part]
    return None  # `+` on a key the job has: Hydra allows it where the value is null or a dict/list


def option_problem(override: Override, options: List[str]) -> Optional[str]:
    """The problem with a `group=option` override, or None when the option exists."""
    group = override.key_or_group
    typed = ("+" if override.is_add() else "++" if override.is_force_add() else "") + group
    option = _value_text(override)
    if group == RECIPE_GROUP and override.type == OverrideType.CHANGE:
        return f"{group}={option}: a recipe is added to the job with `+`. Fix: +{group}={option}."
    if override.is_delete() or override.is_sweep_override() or not isinstance(override.value(), str):
        return None  # a sweep is expanded into its jobs first; null and ~group are Hydra's to judge
    if option in options:
        return None
    return unknown_option_problem(group, option, options, typed)


def override_problems(overrides: Sequence[str]) -> List[str]:
    """One problem line per override whose key or option does not exist (closest names first),
    or which cannot be read as an override. Empty when Hydra should compose them."""
    parser = OverridesParser.create()
    groups = config_groups()
    problems: List[str] = []
    for text in overrides:
        try:
            override = parser.parse_override(text)
        except HydraException as err:
            reason = str(err).strip().splitlines()[0]
            problems.append(f"{text!r} cannot be read as an override ({reason}). Fix: key=value; quote a "
                            f"value holding spaces, commas or brackets, e.g. key='a,b'.")
            continue
        if override.package is not None or "/" in override.key_or_group:
            continue  # `group@package=` and nested group paths: left to Hydra
        if override.key_or_group in groups:
            problem = option_problem(override, groups[override.key_or_group])
        else:
            problem = key_problem(override)
        if problem:
            problems.append(problem)
    return problems
