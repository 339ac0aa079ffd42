"""A run's identity: which config keys say *what* is trained, and the run name derived from them.

Rerunning a command resumes its run because the run's checkpoints live in a folder named after
the run (`outputs/runs/<run.name>/checkpoints`, launcher/checkpoint/run_folder.py), and `run.name`
is by default `<recipe or model.name>-<hash>`: a hash of the keys that change what is trained.
Keys that change how long, how it is logged or evaluated, where or how fast it runs leave the
name alone, so `trainer.steps=300` (or `trainer.log_every`, `trainer.val_every`, `checkpoint.*`,
`cluster.*`...) on the same command continues the same run, and `optim.lr=1e-3` starts another.

IDENTITY_RULES is the one table of which keys count; pure Python, no torch, no files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

from launcher.config.schema import JobConfig

# (key or section, counts, why). The most specific entry above a key decides; every key of the
# schema falls under one (tests/test_run_identity.py checks it), so a new key is classified here.
IDENTITY_RULES: Tuple[Tuple[str, bool, str], ...] = (
    ("model", True, "the model's shape and starting weights (model.init_from)"),
    ("precision", True, "the numerics"),
    ("parallel", True, "the layout; to continue a run at another layout set run.name to its name"),
    ("optim", True, "the optimizer and its LR schedule"),
    ("optim.implementation", False, "another kernel for the same update"),
    ("data", True, "the training data"),
    ("data.val_path", False, "evaluation"),
    ("data.val_mix", False, "evaluation"),
    ("data.max_epochs", False, "a warning threshold of action=plan"),
    ("backend", True, "who serves each feature (and so the checkpoint's format)"),
    ("backend.reduce_bucket_size", False, "a communication tuning knob"),
    ("backend.allgather_bucket_size", False, "a communication tuning knob"),
    ("backend.zeropp_hierarchical_partition", False, "a communication tuning knob"),
    ("backend.cp_impl", False, "how context parallelism computes the same attention (same checkpoint)"),
    ("trainer", False, "how long (steps, tokens), logging, evaluation, health checks, device, speed"),
    ("trainer.global_batch_size", True, "the batch"),
    ("trainer.micro_batch_size", True, "the layout (gradient accumulation)"),
    ("trainer.seq_len", True, "the sequences"),
    ("trainer.grad_clip", True, "the update"),
    ("trainer.seed", True, "the initialisation and data order"),
    ("activation_checkpointing", False, "recomputation: the same maths"),
    ("offload", False, "where states live: the same maths"),
    ("checkpoint", False, "how it is saved and resumed"),
    ("logging", False, "logging"),
    ("cluster", False, "where and how it is launched"),
    ("hardware", False, "the planner's hardware model"),
    ("plan", False, "the planner's output"),
    ("profile", False, "profiling"),
    ("rehearse", False, "the rehearsal"),
    ("prepare", False, "action=prepare"),
    ("eval", False, "downstream evaluation"),
    ("action", False, "what the command does"),
    ("run", False, "the name itself"),
)

HASH_CHARS = 8  # 32 bits: a collision needs tens of thousands of runs of one recipe
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ABSENT = "(absent)"


def _rule(key: str) -> Optional[Tuple[str, bool, str]]:
    """The most specific IDENTITY_RULES entry for dotted `key` (None: no entry covers it)."""
    best = None
    for entry in IDENTITY_RULES:
        prefix = entry[0]
        if (key == prefix or key.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = entry
    return best


def counts(key: str) -> bool:
    """Whether dotted config key `key` is part of what is trained (so of the derived run.name)."""
    rule = _rule(key)
    return bool(rule and rule[1])


def _plain(value: Any) -> Any:
    """A JSON value: dataclasses (data.mix entries) as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def config_leaves(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Every key of a config dataclass, dotted, with its value (lists and dicts are one value)."""
    leaves: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            leaves.update(config_leaves(value, key + "."))
        else:
            leaves[key] = _plain(value)
    return leaves


def identity_of(spec: JobConfig, swept: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """What is trained: {dotted key: value} of every key that counts, sorted.

    swept: a `-m` sweep job's swept overrides ({key: value}). Those that do not count are added
    too, so two jobs of one sweep never share a name (and a checkpoint folder).
    """
    identity = {k: v for k, v in config_leaves(spec).items() if counts(k)}
    for key, value in (swept or {}).items():
        identity.setdefault(key.lstrip("+~"), value)
    return dict(sorted(identity.items()))


def identity_hash(identity: Mapping[str, Any]) -> str:
    """A short stable hash of an identity, over the values that differ from the schema's defaults:
    a key a later version adds (with a default that keeps today's behaviour) leaves names as they were."""
    defaults = config_leaves(JobConfig())
    differing = {k: v for k, v in identity.items() if k not in defaults or defaults[k] != v}
    text = json.dumps(differing, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:HASH_CHARS]


def name_base(text: str) -> str:
    """`text` (a recipe or model name) as the start of a folder name."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip(".-_")
    return base or "run"


def derive_run_name(base: str, identity: Mapping[str, Any]) -> str:
    """The default run.name: `<recipe or model.name>-<hash of what is trained>`."""
    return f"{name_base(base)}-{identity_hash(identity)}"


def _shown(value: Any) -> str:
    if value is ABSENT:
        return ABSENT
    if isinstance(value, float):
        return format(value, "g")
    if isinstance(value, str):
        return value if value else "''"
    return json.dumps(value, default=str)


def identity_differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> List[str]:
    """`key: old -> new` for each key whose value differs (a key only one side has shows `(absent)`)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        before, after = old.get(key, ABSENT), new.get(key, ABSENT)
        if before != after:
            lines.append(f"{key}: {_shown(before)} -> {_shown(after)}")
    return lines


def run_name_problems(name: str) -> List[str]:
    """An explicit run.name must be one folder name ('' derives it)."""
    if not name or NAME_PATTERN.match(name):
        return []
    return [f"run.name={name!r} is not a folder name: it names outputs/runs/<run.name>. Fix: use letters, digits, "
            f"'.', '_' and '-' (at most 128, starting with a letter or digit), e.g. run.name={name_base(name)[:128]}, "
            f"or run.name='' to derive it."]
