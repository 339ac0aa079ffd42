"""Registers the schema and the recipes with Hydra's ConfigStore."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from launcher.config.schema import JobConfig
from launcher.paths import recipes_dir

RECIPES_ENV = "LAUNCHER_RECIPES"


def recipe_dirs() -> List[Path]:
    """Built-in recipes first, then the folders in $LAUNCHER_RECIPES (colon-separated).

    A user recipe with the same name as a built-in one replaces it.
    """
    dirs = [recipes_dir()]
    for extra in os.environ.get(RECIPES_ENV, "").split(os.pathsep):
        if extra.strip():
            dirs.append(Path(extra).expanduser().resolve())
    return dirs


def available_recipes() -> List[str]:
    names = set()
    for d in recipe_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


# The recipe files (path, mtime) register_configs stored last: `train` registers before its
# pre-check and the pre-check's compose_spec again, ~50 ms each (the schema and every recipe).
_registered: Optional[Tuple[Tuple[str, int], ...]] = None


def register_configs() -> None:
    """Register `job_schema` (the typed base of train.yaml) and every recipe as `recipe/NAME`.

    A second call with the same recipe files, unchanged, does nothing."""
    global _registered
    paths = [path for d in recipe_dirs() if d.is_dir() for path in sorted(d.glob("*.yaml"))]
    files = tuple((str(path), path.stat().st_mtime_ns) for path in paths)
    if files == _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for path in paths:
        node = OmegaConf.load(path)
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")
    _registered = files
