"""Composition, schema and cross-field validation: every rule reports keys, numbers and a fix."""

from __future__ import annotations

import subprocess

import pytest

from launcher.config.loader import compose_spec, user_overrides
from launcher.config.store import RECIPES_ENV, available_recipes
from launcher.plan.decide.resolve import validate
from tests.conftest import TRAIN, train_env

RECIPES = ["debug", "llama8b", "llama70b", "llama405b", "mixtral8x7b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    spec = compose_spec([f"+recipe={recipe}", "action=plan"])
    assert validate(spec) == []
    assert set(RECIPES) <= set(available_recipes())


def test_command_line_wins_over_recipe():
    spec = compose_spec(["+recipe=llama70b", "parallel.tp=4", "action=plan"])
    assert spec.parallel.tp == 4
    assert spec.model.name == "llama3_70b"
    spec = compose_spec(["+recipe=llama70b", "cluster=slurm", "cluster.nodes=16", "action=plan"])
    assert spec.cluster.nodes == 16 and spec.cluster.name == "slurm"


def test_user_recipes_folder(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - override /model: debug_moe\ntrainer:\n  steps: 3\n  seq_len: 64\n"
    )
    monkeypatch.setenv(RECIPES_ENV, str(tmp_path))
    spec = compose_spec(["+recipe=mine"])
    assert spec.model.name == "debug_moe" and spec.trainer.steps == 3


def test_user_overrides_drops_flags_and_hydra_keys():
    assert user_overrides(["-m", "a=1", "hydra.run.dir=x", "+recipe=debug"]) == ["a=1", "+recipe=debug"]


def _problems(*overrides):
    return validate(compose_spec(["+recipe=debug", *overrides]))


def _one(problems, *fragments):
    hits = [p for p in problems if all(f in p for f in fragments)]
    assert hits, f"no problem mentions {fragments}: {problems}"
    assert "Fix" in hits[0]
    return hits[0]


RULES = [
    # (overrides, fragments the message must contain)
    (["parallel.tp=2", "parallel.dp_shard=2"], ["pp*dp_replicate*dp_shard*cp*tp", "= 4", "world size 2"]),
    (["cluster.gpus_per_node=3", "parallel.tp=2", "trainer.global_batch_size=6"], ["does not divide", "world size 3"]),
    (["model.n_heads=6", "model.dim=96", "parallel.tp=2", "parallel.dp_shard=1", "model.n_kv_heads=3"], ["model.n_kv_heads=3", "not divisible by 2"]),
    (["cluster.gpus_per_node=4", "parallel.tp=4", "trainer.global_batch_size=2"], ["model.n_kv_heads=2", "not divisible by 4"]),
    (["parallel.pp=2", "parallel.pp_layers=[1,1]"], ["parallel.pp_layers=[1, 1]", "n_layers=4"]),
    (["parallel.pp=2", "parallel.pp_layers=[4]"], ["parallel.pp_layers has 1 entries", "= 2"]),
    (["model.n_layers=1", "parallel.pp=2"], ["2 stage chunks", "n_layers=1"]),
    (["parallel.ep=2"], ["parallel.ep=2", "dense"]),
    (["model=debug_moe", "parallel.ep=2", "model.n_experts=3", "model.top_k=1"], ["n_experts=3", "not divisible by 2"]),
    (["trainer.global_batch_size=7"], ["global_batch_size=7", "micro_batch_size*dp", "2*2 = 4"]),
    (["parallel.microbatches=3"], ["parallel.microbatches=3", "= 2 micro-batches"]),
    (["parallel.tp=2", "parallel.sp=true", "trainer.seq_len=127", "trainer.global_batch_size=4"], ["seq_len=127", "parallel.tp=2"]),
    # Experts folded over TP: each TP rank routes 1/tp of the sequence.
    (["model=debug_moe", "parallel.tp=2", "trainer.seq_len=127", "trainer.global_batch_size=4"],
     ["seq_len=127", "parallel.cp*tp = 2", "folds its experts"]),
    # ep may take the TP ranks (dp_shard*cp*tp = 2), not more.
    (["model=debug_moe", "parallel.tp=2", "parallel.ep=4", "trainer.global_batch_size=4"],
     ["parallel.ep=4 must divide dp_shard*cp*tp", "= 2"]),
    (["parallel.cp=2", "trainer.seq_len=126", "trainer.device=cuda", "trainer.global_batch_size=4"], ["seq_len=126", "2*parallel.cp = 4"]),
    (["parallel.zero_stage=5"], ["zero_stage=5", "0, 1, 2 or 3"]),
    (["offload.optimizer=disk"], ["offload.optimizer='disk'", "none, cpu, nvme"]),
    (["offload.optimizer=nvme"], ["nvme_path"]),
    (["offload.params=cpu", "parallel.zero_stage=2"], ["offload.params=cpu", "zero_stage=3"]),
    (["parallel.cp=2", "trainer.global_batch_size=4", "backend.cp_impl=ring"], ["backend.cp_impl=ring", "trainer.device=cpu", "backend.cp_impl=allgather"]),
    (["precision=fp8"], ["precision=fp8", "emulate"]),
    (["parallel.sp=true"], ["parallel.sp=true", "tp > 1"]),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.dp_shard=1", "trainer.global_batch_size=4"], ["pp_virtual_stages=1", "interleaved_1f1b"]),
    (["trainer.seq_len=512"], ["seq_len=512", "max_seq_len=256"]),
    (["model.tie_embeddings=true", "parallel.pp=2", "parallel.dp_shard=1", "trainer.global_batch_size=4"], ["tie_embeddings", "pipeline"]),
    (["data.source=tokens"], ["data.source=tokens", "data.path"]),
    (["parallel.tp=2", "parallel.dp_shard=1", "model.vocab_size=257", "trainer.global_batch_size=4"], ["vocab_size=257", "pad", "258"]),
    (["parallel.tp=2", "parallel.dp_shard=1", "model.tie_embeddings=true", "trainer.global_batch_size=4"], ["tie_embeddings", "parallel.tp=2"]),
    (["parallel.cp=2", "parallel.pp=2", "cluster.gpus_per_node=4", "trainer.device=cuda", "trainer.global_batch_size=4",
      "backend.cp_impl=ring"], ["backend.cp_impl=ring", "parallel.pp=2", "backend.cp_impl=allgather"]),
    (["parallel.pp=2", "parallel.dp_shard=1", "trainer.global_batch_size=2"], ["1f1b", "at least 2 micro-batches", "= 1"]),
    # Observability keys (launcher/resilience/watchdog.py and stragglers.py, launcher/runtime/heldout_loss.py,
    # launcher/observe/profiler.py).
    (["trainer.hang_timeout_s=-5"], ["trainer.hang_timeout_s=-5", "-1 (auto"]),
    (["trainer.val_every=-1"], ["trainer.val_every=-1", ">= 0"]),
    (["trainer.val_every=5", "trainer.val_steps=0"], ["trainer.val_steps=0", "at least 1"]),
    (["trainer.val_every=5", "data=tokens", "data.path=/"], ["trainer.val_every=5", "data.source=tokens", "data.val_path"]),
    (["trainer.val_every=5", "data.val_path=/nonexistent/val.bin"], ["data.val_path=/nonexistent/val.bin", "does not exist"]),
    (["trainer.straggler_factor=0.5"], ["trainer.straggler_factor=0.5", "above 1"]),
    # Straggler exclusion and the pre-flight health check (launcher/resilience/preflight.py).
    (["trainer.straggler_checks=0"], ["trainer.straggler_checks=0", "at least 1"]),
    (["trainer.straggler_action=kill"], ["trainer.straggler_action='kill'", "auto, warn or exclude"]),
    (["trainer.health_check=maybe"], ["trainer.health_check='maybe'", "auto (on for multi-node jobs), on or off"]),
    (["trainer.health_factor=1"], ["trainer.health_factor=1", "above 1"]),
    # Numerical health (launcher/runtime/numerics.py).
    (["trainer.max_skipped_steps=-1"], ["trainer.max_skipped_steps=-1", "trainer.max_skipped_steps=5"]),
    (["trainer.spike_zscore=-1"], ["trainer.spike_zscore=-1", "0 (off)"]),
    (["trainer.spike_zscore=6", "trainer.spike_window=1"], ["trainer.spike_window=1", "at least 2"]),
    (["trainer.on_spike=retry"], ["trainer.on_spike='retry'", "log", "rewind"]),
    (["trainer.on_spike=rewind"], ["trainer.on_spike=rewind", "trainer.spike_zscore=0", "Fix: e.g. trainer.spike_zscore=6"]),
    (["trainer.on_spike=rewind", "trainer.spike_zscore=6", "checkpoint.interval=0"],
     ["trainer.on_spike=rewind", "saves none", "checkpoint.interval=100"]),
    (["trainer.spike_skip_batches=-2"], ["trainer.spike_skip_batches=-2", "trainer.spike_skip_batches=200"]),
    (["profile.enabled=true", "profile.steps=[5,2]"], ["profile.steps=[5, 2]", "first <= last"]),
    (["profile.enabled=true", "profile.ranks=[7]"], ["profile.ranks has [7]", "0..1"]),
    # Budget keys (launcher/plan/estimate/budget.py).
    (["trainer.tokens=-5"], ["trainer.tokens=-5", ">= 0"]),
    (["hardware.usd_per_gpu_hour=-1"], ["hardware.usd_per_gpu_hour=-1", "null for no cost"]),
    # Model families (launcher/models/family.py) and the Qwen3 keys.
    (["model.family=gpt2"], ["model.family='gpt2'", "llama, mixtral, qwen3", "qwen3_moe -> qwen3"]),
    (["model.head_dim=15"], ["head_dim = 15", "even for RoPE"]),
    (["model.n_heads=3", "model.n_kv_heads=3"], ["model.dim=64 is not divisible by model.n_heads=3", "model.head_dim"]),
    (["model=debug_moe", "model.mlp_only_layers=[0,9]"], ["mlp_only_layers has layer ids [9]", "0..3"]),
    (["model=debug_moe", "model.n_dense_layers=0", "model.mlp_only_layers=[0,1,2,3]"], ["leave no MoE layer", "n_layers=4"]),
]


@pytest.mark.parametrize("overrides,fragments", RULES, ids=[" ".join(o) for o, _ in RULES])
def test_validation_rule_message(overrides, fragments):
    _one(_problems(*overrides), *fragments)


def test_backend_conflicts_reported_with_other_problems():
    spec = compose_spec(["+recipe=llama8b", "backend=deepspeed", "parallel.tp=2"])
    problems = validate(spec)
    assert any("data.path" in p for p in problems)
    assert any("parallel.tp=2" in p and "DeepSpeed" in p for p in problems), problems


def test_all_problems_reported_at_once():
    problems = _problems("parallel.zero_stage=7", "trainer.global_batch_size=7", "offload.params=disk")
    assert len(problems) >= 3


def test_cli_invalid_config_exits_2_without_traceback(tmp_path):
    proc = subprocess.run(
        [TRAIN, "+recipe=debug", "parallel.tp=3", "trainer.global_batch_size=7"],
        cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "parallel.tp=3" in proc.stderr and "global_batch_size=7" in proc.stderr
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("plan.json"))


@pytest.mark.parametrize("override,fragment", [("trainer.stepz=3", "stepz"), ("trainer.steps=abc", "abc"), ("+recipe=nope", "nope")])
def test_cli_unknown_key_or_wrong_type_exits_2(tmp_path, override, fragment):
    proc = subprocess.run(
        [TRAIN, "+recipe=debug", override], cwd=tmp_path, env=train_env(tmp_path),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
