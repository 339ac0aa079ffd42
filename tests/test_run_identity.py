"""run.name and the run's checkpoint folder: which keys start a new run, and what a rerun is told.

Pure functions and files only (no ranks): the reruns through `train` are in tests/test_train_e2e.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from launcher.checkpoint.folder import MANIFEST
from launcher.checkpoint.run_folder import IDENTITY_FILE, choose_run, write_identity
from launcher.config.loader import compose_spec
from launcher.config.run_identity import (
    IDENTITY_RULES, _rule, config_leaves, derive_run_name, identity_differences, identity_of, run_name_problems,
)
from launcher.config.schema import JobConfig, set_dotted
from launcher.config.validate import validate

BASE = ["+recipe=debug"]


@pytest.fixture(scope="module")
def spec() -> JobConfig:
    return compose_spec(BASE)


def _with(spec: JobConfig, **values) -> JobConfig:
    """A copy of spec with dotted keys (written with __ for .) set."""
    changed = copy.deepcopy(spec)
    for key, value in values.items():
        set_dotted(changed, key.replace("__", "."), value)
    return changed


def _name(spec: JobConfig, key: str, value) -> str:
    return derive_run_name("debug", identity_of(_with(spec, **{key.replace(".", "__"): value})))


def test_every_key_of_the_schema_is_classified_once():
    """A new key must be placed in IDENTITY_RULES (counts or not): none falls through unclassified."""
    keys = config_leaves(JobConfig())
    assert [k for k in keys if _rule(k) is None] == []
    prefixes = [rule[0] for rule in IDENTITY_RULES]
    assert len(prefixes) == len(set(prefixes))


# How long, logging, evaluation, saving, where and how fast: the same run (a rerun resumes it).
SAME_RUN = [
    ("trainer.steps", 300), ("trainer.tokens", 100000), ("trainer.log_every", 7), ("trainer.val_every", 4),
    ("trainer.val_steps", 3), ("trainer.compile", True), ("trainer.track_memory", True), ("trainer.device", "cuda"),
    ("trainer.hang_timeout_s", 900.0), ("checkpoint.interval", 5), ("checkpoint.keep", 9),
    ("checkpoint.resume", "none"), ("logging.wandb.mode", "disabled"), ("cluster.nodes", 4), ("cluster.name", "slurm"),
    ("cluster.max_restarts", 2), ("profile.enabled", True), ("activation_checkpointing.mode", "full"),
    ("offload.optimizer", "cpu"), ("optim.implementation", "foreach"), ("data.val_path", "/tmp/val"),
    ("hardware.name", "a100_80gb"), ("backend.reduce_bucket_size", 1), ("run.name", "x"), ("action", "plan"),
]
# What is trained: model, data, layout, optimizer, precision, batch: another run.
NEW_RUN = [
    ("optim.lr", 1e-3), ("optim.warmup_steps", 2), ("optim.schedule", "linear"), ("model.n_layers", 2),
    ("model.init_from", "/models/x"), ("precision.name", "bf16"), ("parallel.tp", 2), ("parallel.zero_stage", 2),
    ("trainer.global_batch_size", 16), ("trainer.micro_batch_size", 1), ("trainer.seq_len", 64), ("trainer.seed", 7),
    ("trainer.grad_clip", 0.5), ("data.path", "/data/x"), ("data.embedded_tokens", 100000), ("backend.default", "deepspeed"),
]


def test_length_logging_evaluation_and_launch_keys_keep_the_run(spec):
    base = derive_run_name("debug", identity_of(spec))
    assert [key for key, value in SAME_RUN if _name(spec, key, value) != base] == []


def test_what_is_trained_makes_another_run(spec):
    base = derive_run_name("debug", identity_of(spec))
    assert [key for key, value in NEW_RUN if _name(spec, key, value) == base] == []


def test_a_sweeps_jobs_never_share_a_name(spec):
    """Jobs of `-m ... trainer.steps=100,200` train the same thing: their swept values still part them."""
    names = {derive_run_name("debug", identity_of(spec, {"trainer.steps": v})) for v in ("100", "200")}
    assert len(names) == 2


def test_differences_name_each_key_and_both_values(spec):
    old, new = identity_of(spec), identity_of(_with(spec, optim__lr=1e-3, parallel__tp=2))
    assert identity_differences(old, new) == ["optim.lr: 0.003 -> 0.001", "parallel.tp: 1 -> 2"]
    assert identity_differences(old, old) == []


def test_an_explicit_run_name_must_be_a_folder_name(spec):
    assert run_name_problems("my-run_1.b") == [] and run_name_problems("") == []
    (problem,) = validate(_with(spec, run__name="../x y"))
    assert "run.name='../x y'" in problem and "Fix:" in problem


def _checkpoint(root: Path, step: int) -> None:
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text("{}")


def test_the_run_folder_says_resume_new_run_and_why(spec, tmp_path):
    runs = tmp_path / "runs"
    first = choose_run(spec, tmp_path / "r1", "debug", run_dir_given=False, runs_root=runs)
    root = Path(first.spec.checkpoint.dir)
    assert root == (runs / first.spec.run.name / "checkpoints").resolve() and root.is_absolute()
    assert "a new run" in first.message and not first.warn
    write_identity(root, first, "train +recipe=debug")
    _checkpoint(root, 20)

    again = choose_run(_with(spec, trainer__steps=300), tmp_path / "r2", "debug", False, runs_root=runs)
    assert again.spec.checkpoint.dir == str(root)
    assert again.message == f"run {first.spec.run.name}: resuming from its newest checkpoint, step 20, in {root}"

    other = choose_run(_with(spec, optim__lr=1e-3), tmp_path / "r3", "debug", False, runs_root=runs)
    assert other.spec.run.name != first.spec.run.name and other.warn
    assert f"differs from run {first.spec.run.name}" in other.message and "optim.lr: 0.003 -> 0.001" in other.message
    assert "train +recipe=debug" in other.message  # the command that continues the other run

    # An explicit run.name resumes whatever its folder holds, saying what differs.
    named = choose_run(_with(spec, optim__lr=1e-3, run__name=first.spec.run.name), tmp_path / "r4",
                       "debug", False, runs_root=runs)
    assert named.spec.checkpoint.dir == str(root) and named.warn
    assert "resuming from its newest checkpoint, step 20" in named.message and "optim.lr: 0.003 -> 0.001" in named.message
    assert json.loads((root / IDENTITY_FILE).read_text())["run_name"] == first.spec.run.name


def test_hydra_run_dir_and_checkpoint_dir_keep_their_folders(spec, tmp_path):
    given = choose_run(spec, tmp_path / "run", "debug", run_dir_given=True, runs_root=tmp_path / "runs")
    assert given.spec.checkpoint.dir == str((tmp_path / "run" / "checkpoints").resolve())
    explicit = _with(spec, checkpoint__dir=str(tmp_path / "ck"))
    assert choose_run(explicit, tmp_path / "run", "debug", False).spec.checkpoint.dir == str(tmp_path / "ck")
    # Every other checkpoint setting survives, `async` too (an init=False field dataclasses.replace resets).
    asynchronous = compose_spec([*BASE, "checkpoint.async=true", "checkpoint.interval=7"])
    chosen = choose_run(asynchronous, tmp_path / "run", "debug", False, runs_root=tmp_path / "runs").spec.checkpoint
    assert chosen.saves_async and chosen.interval == 7


def test_the_resume_command_is_the_same_command_less_checkpoint_resume():
    """A stopped run prints this: checkpoint.resume=none again would start over (and an older PATH go back)."""
    from launcher.launch.local import resume_command

    assert resume_command(["+recipe=debug", "trainer.steps=300"]) == "train +recipe=debug trainer.steps=300"
    assert resume_command(["+recipe=debug", "checkpoint.resume=none", "optim.lr=1e-3"]) == "train +recipe=debug optim.lr=1e-3"
