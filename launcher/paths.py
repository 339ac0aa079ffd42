"""Where the launcher's data folders are: the source tree (editable install) or the wheel.

A wheel carries conf/, recipes/ and slurm/ inside the package as launcher/_conf,
launcher/_recipes and launcher/_slurm; a source checkout keeps them at the top level.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def _data_dir(name: str) -> Path:
    bundled = _PACKAGE_DIR / f"_{name}"
    if bundled.is_dir():
        return bundled
    return _PACKAGE_DIR.parent / name


def config_dir() -> Path:
    """Folder with train.yaml and the config groups."""
    return _data_dir("conf")


def recipes_dir() -> Path:
    """Folder with the built-in recipes (NAME.yaml, used as `+recipe=NAME`)."""
    return _data_dir("recipes")


def slurm_dir() -> Path:
    """Folder with the sbatch templates and the development-cluster script."""
    return _data_dir("slurm")
