"""Turn Hydra's composed DictConfig into the typed JobConfig, and read it back from a run dir."""

from __future__ import annotations

from pathlib import Path
from typing import List, Sequence

from omegaconf import DictConfig, OmegaConf

from launcher.config.schema import JobConfig

RESOLVED_CONFIG = "config.yaml"


def to_spec(cfg: DictConfig) -> JobConfig:
    """Resolve interpolations and convert to dataclasses (type-checked by OmegaConf)."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def save_spec(spec: JobConfig, run_dir: Path) -> Path:
    """Write the resolved config; the rank runtime reads exactly this file."""
    path = Path(run_dir) / RESOLVED_CONFIG
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(spec)))
    tmp.replace(path)
    return path


def load_spec(run_dir: Path) -> JobConfig:
    """Read the resolved config of a run, type-checked against the schema."""
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(Path(run_dir) / RESOLVED_CONFIG))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def compose_spec(overrides: Sequence[str] = ()) -> JobConfig:
    """Compose conf/train.yaml with overrides, outside any Hydra app (tests, planner, benches)."""
    from hydra import compose, initialize_config_dir

    from launcher.config.store import register_configs
    from launcher.paths import config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return to_spec(cfg)


def user_overrides(argv: Sequence[str]) -> List[str]:
    """The config overrides in a `train` command line (drops Hydra flags and hydra.* keys)."""
    out = []
    for arg in argv:
        if arg.startswith("-"):
            continue
        key = arg.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra.") or key.startswith("hydra/"):
            continue
        out.append(arg)
    return out
