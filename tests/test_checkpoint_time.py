"""The planner's save-time prediction, torchrun's shutdown timeout built from it, and the
warning when SLURM's time-limit signal comes too late for a stop. Pure Python, no ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.config.validate import validate
from launcher.launch import slurm
from launcher.launch.local import rank_environment
from launcher.compat import TorchCapabilities
from launcher.launch.torchrun import SHUTDOWN_TIMEOUT, shutdown_timeout_of, torchrun_argv
from launcher.plan.estimate.checkpoint_time import STOP_MARGIN_S
from launcher.plan.present.plan import Plan, build_plan
from launcher.plan.present.report import render_plan

REPO = Path(__file__).resolve().parents[1]
LLAMA70B = ["+recipe=llama70b", "cluster.nodes=2"]  # 2 nodes: 16 ranks share the 70B states


def test_save_time_comes_from_the_memory_model_and_storage_bandwidth():
    spec = compose_spec(LLAMA70B)
    plan = build_plan(spec)
    ck, mem = plan.checkpoint, plan.memory
    assert plan.mesh.pp == 1 and not mem["host"]
    # What a rank saves is what the memory model says it holds: parameters + optimizer states.
    assert ck["bytes_per_rank"] == mem["params"] + mem["optimizer"]
    assert ck["bytes_per_node"] == ck["bytes_per_rank"] * 8
    assert ck["storage_gbps"] == spec.hardware.storage_gbps == 5.0
    assert ck["save_s"] == ck["bytes_per_node"] / 5e9
    assert ck["stop_s"] == plan.time["step_s"] + ck["save_s"]
    assert ck["shutdown_timeout_s"] > ck["stop_s"] + STOP_MARGIN_S
    faster = build_plan(compose_spec([*LLAMA70B, "hardware.storage_gbps=10"])).checkpoint
    assert faster["save_s"] == ck["save_s"] / 2


def test_plan_shows_the_prediction_in_text_and_json(tmp_path):
    spec = compose_spec(LLAMA70B)
    plan = build_plan(spec)
    text = render_plan(plan, spec, "text")
    line = next(l for l in text.splitlines() if l.startswith("Checkpoint save:"))
    assert "hardware.storage_gbps" in line and f"--shutdown-timeout {plan.checkpoint['shutdown_timeout_s']} s" in line
    assert json.loads(render_plan(plan, spec, "json"))["checkpoint"] == plan.checkpoint
    plan.save(tmp_path)
    assert Plan.load(tmp_path).checkpoint == plan.checkpoint


def test_plan_shows_the_work_lost_per_failure_for_each_checkpoint_tier(tmp_path):
    spec = compose_spec([*LLAMA70B, "checkpoint.interval=100"])
    plan = build_plan(spec)
    ck, step_s = plan.checkpoint, plan.time["step_s"]
    # Half an interval of steps: a failure lands on average halfway between two saves.
    assert ck["interval_steps"] == 100 and ck["lost_per_failure_s"] == pytest.approx(50 * step_s)
    assert ck["local_interval_steps"] == 0 and ck["local_lost_per_failure_s"] is None
    line = render_plan(plan, spec, "text").split("Lost per failure (half an interval): ")[1].splitlines()[0]
    assert line.startswith(f"{50 * step_s:.1f} s from the shared checkpoint (checkpoint.interval=100 steps)")
    assert "set checkpoint.local_dir" in line
    local = compose_spec([*LLAMA70B, "checkpoint.interval=100", f"checkpoint.local_dir={tmp_path}",
                          "checkpoint.local_interval=10"])
    plan = build_plan(local)
    assert plan.checkpoint["local_lost_per_failure_s"] == pytest.approx(5 * step_s)
    assert plan.checkpoint["lost_per_failure_s"] == ck["lost_per_failure_s"]  # the shared tier's is unchanged
    text = render_plan(plan, local, "text")
    assert f", {5 * step_s:.1f} s from the node-local tier (checkpoint.local_interval=10 steps)" in text
    assert json.loads(render_plan(plan, local, "json"))["checkpoint"]["local_lost_per_failure_s"] == pytest.approx(5 * step_s)
    # No periodic checkpoint: everything since the start is at stake.
    none = build_plan(compose_spec([*LLAMA70B, "checkpoint.interval=0"]))
    assert none.checkpoint["lost_per_failure_s"] is None
    assert "everything since the start" in render_plan(none, compose_spec([*LLAMA70B, "checkpoint.interval=0"]), "text")


def test_short_signal_lead_is_a_warning_not_an_error():
    spec = compose_spec([*LLAMA70B, "cluster.signal_seconds=30"])
    assert not [p for p in validate(spec) if "signal_seconds" in p]  # not an error
    plan = build_plan(spec)
    assert plan.checkpoint["stop_s"] > 30
    warning = [w for w in plan.warnings if w.startswith("cluster.signal_seconds=30 ")]
    assert len(warning) == 1 and "Fix: cluster.signal_seconds=" in warning[0], plan.warnings
    wanted = int(warning[0].split("Fix: cluster.signal_seconds=")[1].split(",")[0])
    assert wanted > plan.checkpoint["stop_s"]
    lead_ok = build_plan(compose_spec([*LLAMA70B, f"cluster.signal_seconds={wanted}"]))
    assert not [w for w in lead_ok.warnings if "cluster.signal_seconds" in w]


def test_torchrun_gets_the_shutdown_timeout_locally_and_in_the_sbatch_script(tmp_path):
    spec = compose_spec(LLAMA70B)
    plan = build_plan(spec)
    timeout = plan.checkpoint["shutdown_timeout_s"]
    # A torch with the option (launcher/compat.py; tests/test_torch_compat.py covers the floor's fallback).
    argv = torchrun_argv(tmp_path, nproc_per_node=2, shutdown_timeout_s=shutdown_timeout_of(plan),
                         capabilities=TorchCapabilities("2.13", frozenset({SHUTDOWN_TIMEOUT})))
    assert f"--shutdown-timeout={timeout}" in argv
    assert "--shutdown-timeout" not in " ".join(torchrun_argv(tmp_path, nproc_per_node=2))  # old plan.json: torchrun's own
    script = slurm.render_script(spec, plan, tmp_path / "run", cwd=tmp_path)
    launch = next(l for l in script.splitlines() if "torch.distributed.run" in l)
    assert f"--shutdown-timeout={timeout}" in launch


def test_cluster_env_reaches_local_ranks_and_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", "/from/the/shell")
    env = rank_environment(tmp_path, "cpu", {"MY_FLAG": "1", "WANDB_DIR": "/from/cluster/env"})
    assert env["MY_FLAG"] == "1" and env["WANDB_DIR"] == "/from/cluster/env"
    assert rank_environment(tmp_path, "cpu")["WANDB_DIR"] == "/from/the/shell"


def test_an_interval_that_loses_hours_per_failure_is_a_warning_with_the_interval_to_use():
    spec = compose_spec([*LLAMA70B, "checkpoint.interval=400"])
    plan = build_plan(spec)
    step_s = plan.time["step_s"]
    assert plan.checkpoint["lost_per_failure_s"] == pytest.approx(200 * step_s) and 200 * step_s > 3600
    [warning] = [w for w in plan.warnings if w.startswith("checkpoint.interval=400 ")]
    suggested = int(warning.split("Fix: checkpoint.interval=")[1].split(" ")[0])
    assert 0.4 * 3600 <= suggested * step_s / 2 <= 0.5 * 3600  # about half an hour lost per failure
    assert not [w for w in build_plan(compose_spec([*LLAMA70B, f"checkpoint.interval={suggested}"])).warnings
                if w.startswith("checkpoint.interval=")]
    # A node-local tier bounds the loss: no warning.
    local = compose_spec([*LLAMA70B, "checkpoint.interval=400", "checkpoint.local_dir=/local", "checkpoint.local_interval=20"])
    assert not [w for w in build_plan(local).warnings if w.startswith("checkpoint.interval=")]


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (REPO / "recipes").glob("*.yaml")))
def test_every_recipe_plans_without_a_warning_about_its_own_checkpointing(recipe):
    """A shipped recipe at its own size: SLURM's time-limit warning comes early enough for a stop's
    save, and a failure loses at most an hour of training."""
    spec = compose_spec([f"+recipe={recipe}"])
    plan = build_plan(spec)
    own = [w for w in plan.warnings if w.startswith(("cluster.signal_seconds=", "checkpoint.interval="))]
    assert not own, own
    lost = plan.checkpoint["lost_per_failure_s"]
    assert lost is None or lost <= 3600, lost
