"""Registers the schema and the recipes with Hydra's ConfigStore."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

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


def register_configs() -> None:
    """Register `job_schema` (the typed base of train.yaml) and every recipe as `recipe/NAME`."""
    cs = ConfigStore.instance()
    cs.store(name="job_schema", node=JobConfig)
    for d in recipe_dirs():
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.yaml")):
            node = OmegaConf.load(path)
            cs.store(group="recipe", name=path.stem, node=node, package="_global_")
