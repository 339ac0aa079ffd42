"""Turn Hydra's composed DictConfig into the typed JobConfig, and read it back from a run dir."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, List, Sequence

from omegaconf import DictConfig, OmegaConf

from launcher.config.errors import ConfigError
from launcher.config.hf_model import fill_from_hf
from launcher.config.export_spec import export_spec
from launcher.config.schema import JobConfig
from launcher.config.suggest import unknown_key_problem
from launcher.paths import config_dir

RESOLVED_CONFIG = "config.yaml"

# A run of backslashes right before `${`: OmegaConf reads `\${` as a literal `${` and halves
# the backslashes before it, so k literal backslashes + `${` are written as 2k+1 + `${`.
_INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def to_spec(cfg: DictConfig) -> JobConfig:
    """Resolve interpolations and convert to dataclasses (type-checked by OmegaConf).

    Raises ConfigError for keys the schema does not have (added with `+key=` or `++key=`),
    which OmegaConf would otherwise drop silently.
    """
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(unknown)

    fill_from_hf(cfg)  # model=hf: shape keys (and data.tokenizer) from model.init_from's config.json
    steps_from_token_budget(cfg)
    return export_spec(OmegaConf.to_object(cfg))  # type: ignore[arg-type]  # action=export: no training-only limits


def steps_from_token_budget(cfg: DictConfig) -> None:
    """trainer.tokens > 0: trainer.steps = ceil(tokens / tokens per step), decided here once so the
    LR schedule, the data checks and the plan all see the same count (the last step may pass the
    budget by less than one step's tokens)."""
    trainer = cfg.get("trainer")
    if trainer is None or not trainer.get("tokens") or int(trainer.tokens) <= 0:
        return
    per_step = int(trainer.global_batch_size) * int(trainer.seq_len)
    if per_step <= 0:
        return  # the validator names the bad batch or sequence length
    trainer.steps = -(-int(trainer.tokens) // per_step)


def token_budget_problems(overrides: Sequence[str], spec: JobConfig) -> List[str]:
    """A trainer.steps given in `overrides` (the command line) that disagrees with the steps
    trainer.tokens decided (steps_from_token_budget): one problem, since the budget would silently win.

    Only the command line counts as explicit: a recipe's trainer.steps is its default for runs
    without a token budget (`+recipe=qwen3_8b trainer.tokens=...` is the documented use)."""
    if spec.trainer.tokens <= 0:
        return []
    from hydra.core.override_parser.overrides_parser import OverridesParser  # lazy: ranks import this module without hydra

    problems: List[str] = []
    for parsed in OverridesParser.create().parse_overrides(list(overrides)):
        if parsed.key_or_group != "trainer.steps" or parsed.is_delete() or parsed.is_sweep_override():
            continue
        given = parsed.value()
        if isinstance(given, bool) or not isinstance(given, int) or given == spec.trainer.steps:
            continue  # a non-integer is the schema's problem; an agreeing count is harmless
        t = spec.trainer
        problems.append(f"trainer.steps={given} and trainer.tokens={t.tokens} disagree: the token budget gives "
                        f"{t.steps} steps (ceil(tokens / (global_batch_size {t.global_batch_size} x seq_len "
                        f"{t.seq_len}))) and would win. Fix: drop trainer.steps to train to the budget, or "
                        f"trainer.tokens=0 to train {given} steps.")
    return problems


def unknown_keys(cfg: DictConfig, prefix: str = "") -> List[str]:
    """One problem line per key of `cfg` that its schema dataclass does not declare, naming the
    closest keys it does declare.

    Nodes typed as plain dicts in the schema (e.g. `cluster.env`) take any key.
    """
    problems: List[str] = []
    schema = OmegaConf.get_type(cfg)
    known = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if known is not None and key not in known:
            problems.append(unknown_key_problem(dotted, known))
            continue
        child = cfg._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            problems.extend(unknown_keys(child, f"{dotted}."))
    return problems


def escape_interpolations(text: str) -> str:
    """`text` written so that OmegaConf reads it back exactly (no `${...}` is resolved)."""
    if "${" not in text:
        return text
    return _INTERPOLATION_START.sub(lambda m: m.group(1) * 2 + "\\${", text)


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return escape_interpolations(value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_escaped(v) for v in value]
    return value


def save_spec(spec: JobConfig, run_dir: Path) -> Path:
    """Write the resolved config; the rank runtime reads exactly this file.

    Values are final: a `${...}` left in a string (a shell variable in cluster.setup or
    cluster.env) is escaped so that loading it back gives the same text, not a lookup.
    """
    path = Path(run_dir) / RESOLVED_CONFIG
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(_escaped(dataclasses.asdict(spec))))
    tmp.replace(path)
    return path


def load_spec(run_dir: Path) -> JobConfig:
    """Read the resolved config of a run, type-checked against the schema."""
    merged = OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.load(Path(run_dir) / RESOLVED_CONFIG))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def compose_spec(overrides: Sequence[str] = ()) -> JobConfig:
    """Compose conf/train.yaml with overrides, outside any Hydra app (tests, planner, benches)."""
    # lazy: hydra (~0.1 s) only composes here; ranks read the saved spec with OmegaConf alone
    from hydra import compose, initialize_config_dir

    from launcher.config.store import register_configs  # lazy: config.store imports hydra; see above

    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides))
    return to_spec(cfg)


def user_overrides(argv: Sequence[str]) -> List[str]:
    """The config overrides in a `train` command line, as Hydra's own argument parser reads it
    (so a flag's value, as in `--cfg job`, is not taken for one); drops hydra.* keys."""
    # lazy: hydra's parser (hydra is imported by the CLI anyway); ranks import this module without hydra
    from hydra._internal.utils import get_args_parser

    out = []
    for arg in get_args_parser().parse_intermixed_args(list(argv)).overrides:
        key = arg.lstrip("+~").split("=", 1)[0]
        if key.startswith("hydra.") or key.startswith("hydra/"):
            continue
        out.append(arg)
    return out
