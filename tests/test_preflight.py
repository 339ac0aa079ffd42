"""The pre-flight health check (launcher/resilience/preflight.py) and the straggler exclusion
(launcher/resilience/stragglers.py): their verdicts, the failure bundle they leave, the restart
decision on it, and one real 2-rank local run whose rank 1 fails its probe."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from launcher.resilience.failure import FailureBundle, NodeBlamed
from launcher.resilience.node_exclusion import NodeSet
from launcher.resilience.preflight import probe, verdict
from launcher.resilience.restarts import RESTART, STOP_NODE_UNFIT, decide, read_events
from launcher.resilience.stragglers import StragglerMonitor
from tests.conftest import TRAIN, train_env


def _rank(rank: int, host: str, compute_s: float = 0.05, ok: bool = True, gbps: float = 1.0) -> dict:
    return {"rank": rank, "host": host, "compute_s": compute_s, "compute_ok": ok, "max_abs_error": 0.0 if ok else 1.0,
            "allreduce_gbps": gbps, "device": "cpu"}


def test_verdict_names_a_wrong_result_and_a_rank_beyond_the_factor_of_the_others_median():
    healthy = [_rank(0, "n1"), _rank(1, "n1", 0.06), _rank(2, "n2", 0.055), _rank(3, "n2", 0.05)]
    assert verdict(healthy, factor=3) == []
    wrong = [*healthy[:3], _rank(3, "n2", ok=False)]
    assert [(b["rank"], b["host"]) for b in verdict(wrong, 3)] == [(3, "n2")]
    assert "wrong matmul result" in verdict(wrong, 3)[0]["why"]
    # 0.2 s is 3.6x the others' median 0.055 s: over a factor 3, under a factor 4.
    slow = [*healthy[:3], _rank(3, "n2", 0.2)]
    assert [b["rank"] for b in verdict(slow, 3)] == [3] and verdict(slow, 4) == []
    assert "3.6x the other ranks' median 0.0550 s" in verdict(slow, 3)[0]["why"]
    # Bandwidth: under the others' median / factor.
    narrow = [*healthy[:3], _rank(3, "n2", gbps=0.2)]
    assert [b["rank"] for b in verdict(narrow, 3)] == [3] and verdict(narrow, 6) == []
    # With two ranks the slow one is compared with the other, not with a median it moves itself.
    assert [b["rank"] for b in verdict([_rank(0, "n1", 0.05), _rank(1, "n2", 0.2)], 3)] == [1]
    # Tiny CPU timings: a ratio over the factor within timer noise names nobody.
    assert verdict([_rank(0, "n1", 0.002), _rank(1, "n2", 0.009)], 3) == []


def test_the_probe_computes_the_right_product_and_the_debug_hook_breaks_or_slows_one_rank(monkeypatch):
    cpu = torch.device("cpu")
    fine = probe(cpu, 0)
    assert fine["compute_ok"] and fine["max_abs_error"] == 0.0 and fine["compute_s"] > 0
    monkeypatch.setenv("LAUNCHER_DEBUG_PROBE", "0:fail")
    assert probe(cpu, 1)["compute_ok"]  # another rank: untouched
    broken = probe(cpu, 0)
    assert not broken["compute_ok"] and broken["max_abs_error"] == 1.0
    monkeypatch.setenv("LAUNCHER_DEBUG_PROBE", "0:slow")
    slow = dict(probe(cpu, 0), host="n2")
    assert slow["compute_ok"] and [b["rank"] for b in verdict([dict(fine, host="n1"), slow], 3)] == [0]
    # By node name: every rank on that node, whatever its number.
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    monkeypatch.setenv("LAUNCHER_DEBUG_PROBE", "n2:fail")
    assert not probe(cpu, 3)["compute_ok"]
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert probe(cpu, 3)["compute_ok"]


def _health_failure(run_dir: Path, host: str = "n2") -> Path:
    """The summary the ranks write when the probe names `host`'s rank 1 (the real bundle writer)."""
    bundle = FailureBundle(run_dir, rank=0, world_size=4)
    err = NodeBlamed("health", [{"rank": 1, "host": host, "why": "wrong matmul result (max abs error 1.0)"}],
                     f"health check failed before the first step: rank 1 on {host}")
    bundle.record_exception(err, "Traceback ...\n")
    return run_dir / "failure" / "summary.json"


def test_a_health_failure_excludes_the_node_and_restarts_on_a_spare(tmp_path):
    summary = json.loads(_health_failure(tmp_path).read_text())
    assert (summary["what"], summary["rank"], summary["host"], summary["blamed_hosts"]) == ("health", 1, "n2", ["n2"])
    decision = decide(tmp_path, 0, 3, 1, nodes=NodeSet(["n1", "n2", "n3"], needed=2, step=["n1", "n2"]))
    assert decision.action == RESTART and decision.nodes.step_nodes == ["n1", "n3"]
    assert decision.nodes.excluded == ["n2"] and "excluding node(s) n2" in decision.message
    exclude = read_events(tmp_path)[-1]
    assert (exclude["event"], exclude["node"], exclude["action"]) == ("exclude", "n2", "restart on a spare")
    assert exclude["cause"] == "health: wrong matmul result (max abs error 1.0)"


def test_without_a_spare_a_health_failure_stops_and_excludes_the_node_from_the_requeue(tmp_path):
    _health_failure(tmp_path)
    decision = decide(tmp_path, 0, 3, 1, nodes=NodeSet(["n1", "n2"], needed=2, step=["n1", "n2"]), requeue=True)
    # Not restarted in place (the same node would fail the same probe), restarts left or not.
    assert decision.action == STOP_NODE_UNFIT and "not restarting in place" in decision.message
    assert (decision.nodes.step_nodes, decision.nodes.exclude_on_requeue) == ([], ["n2"])
    assert read_events(tmp_path)[-1]["action"] == "excluded from the requeued job"


def test_a_straggler_for_n_checks_in_a_row_names_its_node_and_the_decision_uses_the_spare(tmp_path):
    hosts = ["n1", "n1", "n2", "n2"]
    warn_only = StragglerMonitor(0, hosts, factor=1.5, device=torch.device("cpu"), checks=2)
    for step in (1, 2, 3):
        assert warn_only.judge(step, [1.0, 1.0, 1.0, 2.0])["slowest_host"] == "n2"
    excluding = StragglerMonitor(0, hosts, factor=1.5, device=torch.device("cpu"), checks=2, exclude=True)
    excluding.judge(1, [1.0, 1.0, 1.0, 2.0])
    excluding.judge(2, [1.0, 1.0, 1.0, 1.2])  # back under the factor: the streak starts again
    excluding.judge(3, [1.0, 1.0, 1.0, 2.0])
    with pytest.raises(NodeBlamed) as raised:
        excluding.judge(4, [1.0, 1.0, 1.0, 2.0])
    assert raised.value.kind == "straggler" and [(n["rank"], n["host"]) for n in raised.value.named] == [(3, "n2")]
    # The first log step (one-off start-up costs) never counts against a rank.
    at_once = StragglerMonitor(0, hosts, factor=1.5, device=torch.device("cpu"), checks=1, exclude=True)
    at_once.judge(1, [1.0, 1.0, 1.0, 5.0])
    with pytest.raises(NodeBlamed):
        at_once.judge(2, [1.0, 1.0, 1.0, 5.0])
    FailureBundle(tmp_path, rank=0, world_size=4).record_exception(raised.value, "Traceback ...\n")
    decision = decide(tmp_path, 0, 3, 1, nodes=NodeSet(["n1", "n2", "n3"], needed=2, step=["n1", "n2"]))
    assert decision.restart and decision.nodes.step_nodes == ["n1", "n3"]
    assert read_events(tmp_path)[-1]["cause"].startswith("straggler: 2.000 s per step, 2.0x the other ranks' median")


def test_on_gpu_the_probe_is_judged_and_the_step_device_times_are_reported():
    """On GPU a healthy rank waiting in NCCL for a slow one is as busy on its stream, so the probe
    matmul's time is judged and the step's device time reported: the slowest rank is the slow probe's,
    whatever the step times say (they are equal in lock-step)."""
    monitor = StragglerMonitor(0, ["n1", "n2", "n3"], factor=1.5, device=torch.device("cpu"), checks=1)
    metrics = monitor.judge(1, [0.004, 0.004, 0.009], step_times=[0.81, 0.80, 0.80])
    assert (metrics["slowest_rank"], metrics["slowest_host"]) == (2, "n3")
    assert (metrics["step_time_min_s"], metrics["step_time_median_s"], metrics["step_time_max_s"]) == (0.80, 0.80, 0.81)


@pytest.mark.multiprocess
def test_a_rank_failing_its_probe_stops_a_local_run_before_the_first_step(run_dir):
    """2 local ranks, rank 1's probe result made wrong: the run ends before step 1, naming rank 1,
    its host and the numbers, and is not restarted (cluster.max_restarts=1 allows one)."""
    run_dir.mkdir(parents=True)
    started = time.monotonic()
    proc = subprocess.run([TRAIN, "+recipe=debug", "trainer.steps=4", "trainer.health_check=on",
                           "cluster.max_restarts=1", "+cluster.env.LAUNCHER_DEBUG_PROBE=1:fail",
                           f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=train_env(run_dir.parent),
                          capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-4000:]
    summary = json.loads((run_dir / "failure" / "summary.json").read_text())
    assert (summary["what"], summary["rank"], summary["last_step"]) == ("health", 1, 0), summary
    host = summary["host"]
    assert summary["blamed_hosts"] == [host] and "wrong matmul result" in summary["error"]
    assert f"health check failed before the first step: rank 1 on {host}: wrong matmul result" in out
    assert "not restarting in place" in out and "(restart 1)" not in out
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    health = [e for e in read_events(run_dir) if e["event"] == "health"]
    assert len(health) == 1 and not health[0]["ok"] and [b["rank"] for b in health[0]["named"]] == [1]
    assert [r["compute_ok"] for r in health[0]["ranks"]] == [True, False]
    assert all(r["compute_s"] > 0 and r["allreduce_gbps"] > 0 for r in health[0]["ranks"])
    rank0_log = (run_dir / "logs" / "rank_0.log").read_text()
    assert f"{host}/rank 1: matmul" in rank0_log and "WRONG (error 1.0)" in rank0_log and "GB/s" in rank0_log
    print(f"health-probe local run: {elapsed:.1f} s")


def test_a_requeued_jobs_failure_replaces_the_summary_its_earlier_run_left(tmp_path, monkeypatch):
    """Without this the health failure of a requeued job would not be its cause: the first run's
    summary would stay and the decision would see a stale summary (a rank "killed by a signal")."""
    monkeypatch.setenv("SLURM_JOB_ID", "114")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    FailureBundle(tmp_path, rank=0, world_size=2).record_exception(RuntimeError("Connection closed by peer"), "tb")
    later = FailureBundle(tmp_path, rank=1, world_size=2)  # the same run: the first failure stays the cause
    assert later.record_exception(RuntimeError("boom"), "tb") is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # requeued
    _health_failure(tmp_path)
    summary = json.loads((tmp_path / "failure" / "summary.json").read_text())
    assert (summary["what"], summary["attempt"]) == ("health", ["114", 1, 0])


def test_the_check_is_on_for_multi_node_jobs_by_default_and_exclusion_of_stragglers_needs_a_spare():
    from launcher.config.loader import compose_spec
    from launcher.plan.decide.resolve import resolve

    def checks(*overrides):
        r = resolve(compose_spec(["+recipe=debug", *overrides])).resilience
        return r.health_check, r.exclude_stragglers

    one_node = compose_spec(["+recipe=debug"])
    two_nodes = ["cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1"]
    assert (one_node.trainer.health_check, one_node.trainer.health_factor) == ("auto", 3.0)
    assert checks() == (False, False) and checks(*two_nodes) == (True, False)
    assert checks("trainer.health_check=on")[0]
    assert not checks(*two_nodes, "trainer.health_check=off")[0]
    assert (one_node.trainer.straggler_checks, one_node.trainer.straggler_action) == (3, "auto")
    assert checks("cluster=slurm", "cluster.nodes=2", "cluster.spare_nodes=1")[1]
    assert checks("trainer.straggler_action=exclude")[1]
    assert not checks("cluster=slurm", "cluster.nodes=2", "cluster.spare_nodes=1", "trainer.straggler_action=warn")[1]
