"""The in-job restart decision (launcher/resilience/restarts.py) on real run folders: what it reads
from the failure bundle, when it stops, what it writes. The multi-process runs that use it are in
tests/test_train_e2e.py (local) and tests/test_slurm_train.py (SLURM)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.resilience.node_exclusion import NodeSet, blamed_nodes
from launcher.resilience.restarts import (EXCLUDE_DOWN, RESTART, REWIND, STOP_EXHAUSTED, STOP_NODE_LOST, STOP_REPEATING,
                                         STOP_REWINDS, RestartReport, decide, read_events)


def _summary(run_dir: Path, what: str, error: str, last_step: int, rank: int = 1) -> Path:
    folder = run_dir / "failure"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "summary.json"
    path.write_text(json.dumps({"what": what, "error": error, "rank": rank, "host": "n2", "last_step": last_step,
                                "unix_time": time.time()}))
    (folder / f"traceback_rank_{rank}.txt").write_text("Traceback ...\n")
    return path


def test_an_exception_is_restarted_once_and_stops_when_it_repeats_at_the_same_step(tmp_path):
    _summary(tmp_path, "exception", "RuntimeError: boom", 7)
    first = decide(tmp_path, 0, 3, 1)
    assert first.action == RESTART and "restart 1 of 3" in first.message
    # The bundle is set aside for the next attempt, its evidence kept.
    assert not (tmp_path / "failure" / "summary.json").exists()
    assert (tmp_path / "failure" / "before_restart_1" / "traceback_rank_1.txt").is_file()
    _summary(tmp_path, "exception", "RuntimeError: boom", 7)
    second = decide(tmp_path, 1, 3, 1)
    assert second.action == STOP_REPEATING
    assert second.message.startswith("repeating failure") and "not restarting" in second.message
    assert "rank 1 on n2, last step 7" in second.message
    assert [e["action"] for e in read_events(tmp_path)] == [RESTART, STOP_REPEATING]


def test_the_same_error_reported_by_another_rank_with_its_own_numbers_still_repeats(tmp_path):
    """The summary names whichever rank failed first; each rank words a data error with its own
    token id (seen in the SLURM crash test: rank 1 reported id 1288, then rank 0 id 1300)."""
    _summary(tmp_path, "exception", "ValueError: web.bin holds token id 1288 but model.vocab_size=256", 0, rank=1)
    assert decide(tmp_path, 0, 3, 1).restart
    _summary(tmp_path, "exception", "ValueError: web.bin holds token id 1300 but model.vocab_size=256", 0, rank=0)
    assert decide(tmp_path, 1, 3, 1).action == STOP_REPEATING
    # Another error at the same step is not the same failure.
    other = tmp_path / "other"
    _summary(other, "exception", "RuntimeError: boom", 0)
    assert decide(other, 0, 3, 1).restart
    _summary(other, "exception", "KeyError: 'tok_embeddings.weight'", 0)
    assert decide(other, 1, 3, 1).restart


def test_the_same_exception_at_another_step_or_a_repeated_hang_is_restarted(tmp_path):
    _summary(tmp_path, "exception", "RuntimeError: boom", 7)
    assert decide(tmp_path, 0, 3, 1).restart
    _summary(tmp_path, "exception", "RuntimeError: boom", 9)  # progress was made: a fault, not a bug
    assert decide(tmp_path, 1, 3, 1).restart
    _summary(tmp_path, "hang", "no progress for 9 s (trainer.hang_timeout_s=8)", 9)
    assert decide(tmp_path, 2, 4, 3).restart
    _summary(tmp_path, "hang", "no progress for 9 s (trainer.hang_timeout_s=8)", 9)
    assert decide(tmp_path, 3, 4, 3).restart  # a hang never proves a bug


def test_no_summary_means_a_killed_rank_and_max_restarts_bounds_the_restarts(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    first = decide(tmp_path, 0, 1, -9)
    assert first.restart and first.event["cause"]["what"] == "exit" and first.event["cause"]["last_step"] == 3
    assert "wrote no failure summary" in first.event["cause"]["error"]
    second = decide(tmp_path, 1, 1, -9)
    assert second.action == STOP_EXHAUSTED and "cluster.max_restarts=1 reached" in second.message
    off = decide(tmp_path, 0, 0, 1)
    assert off.action == STOP_EXHAUSTED and "cluster.max_restarts=0 (in-job restarts off)" in off.message


def test_a_summary_older_than_the_attempt_is_not_its_cause(tmp_path):
    path = _summary(tmp_path, "exception", "RuntimeError: from an earlier launch", 4)
    old = time.time() - 3600
    os.utime(path, (old, old))
    decision = decide(tmp_path, 0, 2, -9, attempt_started=time.time() - 5)
    assert decision.event["cause"]["what"] == "exit", decision.event


def test_restart_report_gives_the_metrics_once_after_a_restart(tmp_path):
    _summary(tmp_path, "exception", "RuntimeError: boom", 7, rank=0)
    decide(tmp_path, 0, 3, 1)
    report = RestartReport(tmp_path, 1, rank=0, node="n1")
    report.resumed_at(4)
    resumed = read_events(tmp_path)[-1]
    assert resumed["event"] == "resumed" and resumed["step"] == 4 and resumed["lost_steps"] == 3
    metrics = report.metrics()
    assert metrics["resilience/restarts"] == 1 and metrics["resilience/lost_steps"] == 3
    assert 0 <= metrics["resilience/downtime_s"] < 60
    assert report.metrics() == {}  # once
    assert RestartReport(tmp_path, 0, rank=0, node="n1").metrics() == {}  # no restart: no metrics


def test_the_batch_scripts_command_exits_0_to_restart_and_1_to_stop(tmp_path):
    def run(done: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "launcher.resilience.restarts", "decide", "--run-dir", str(tmp_path),
                               "--restarts-done", str(done), "--max-restarts", "1", "--exit-code", "1",
                               "--attempt-started", str(time.time() - 60)], capture_output=True, text=True, timeout=60)

    again = run(0)
    assert again.returncode == 0 and "restarting them (restart 1 of 1)" in again.stdout, again
    stop = run(1)
    assert stop.returncode == 1 and stop.stdout.startswith("launcher: error: the ranks failed"), stop
    assert "cluster.max_restarts=1 reached" in stop.stdout


def test_a_lost_node_is_not_restarted_in_the_job_and_is_recorded(tmp_path):
    _summary(tmp_path, "exception", "RuntimeError: Connection closed by peer", 5, rank=0)
    decision = decide(tmp_path, 0, 3, 1, lost_nodes=["n2"])
    assert decision.action == STOP_NODE_LOST and "SLURM no longer hears from n2: not restarting" in decision.message
    assert "cluster.requeue_on_failure=true" in decision.message
    event = read_events(tmp_path)[-1]
    assert event["action"] == STOP_NODE_LOST and event["cause"]["lost_nodes"] == ["n2"]


def _decide_cli(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.resilience.restarts", "decide", "--run-dir", str(run_dir),
                           "--max-restarts", "3", "--exit-code", "1", "--attempt-started", str(time.time() - 60),
                           "--state-file", str(run_dir / "next_step.env"), *args],
                          capture_output=True, text=True, timeout=60)


def _sourced(state_file: Path) -> dict:
    """The variables the batch script gets when it sources the decision's state file."""
    probe = f'source {shlex.quote(str(state_file))}; printf "%s|%s|%s" "$STEP_NODES" "$EXCLUDED_NODES" "$REQUEUE_EXCLUDE"'
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout
    return dict(zip(("STEP_NODES", "EXCLUDED_NODES", "REQUEUE_EXCLUDE"), out.split("|")))


def test_a_crash_on_n2_excludes_it_and_the_next_step_runs_on_the_spare(tmp_path):
    _summary(tmp_path, "exception", "RuntimeError: CUDA error: an illegal memory access", 7)  # on n2
    allocation = ["--allocation", "n1 n2 n3", "--step-nodes", "n1,n2", "--nodes-needed", "2"]
    proc = _decide_cli(tmp_path, "--restarts-done", "0", *allocation)
    assert proc.returncode == 0 and "excluding node(s) n2" in proc.stdout and "restarting on n1,n3" in proc.stdout, proc
    assert _sourced(tmp_path / "next_step.env") == {"STEP_NODES": "n1,n3", "EXCLUDED_NODES": "n2", "REQUEUE_EXCLUDE": ""}
    exclude = [e for e in read_events(tmp_path) if e["event"] == "exclude"]
    assert [(e["node"], e["action"]) for e in exclude] == [("n2", "restart on a spare")]
    assert exclude[0]["cause"].startswith("crash: exception on rank 1: RuntimeError: CUDA error")

    # The next failure: n3 is lost and no spare is left; the job stops and both bad nodes go to
    # the requeued job's ExcNodeList.
    proc = _decide_cli(tmp_path, "--restarts-done", "1", "--allocation", "n1 n2 n3", "--step-nodes", "n1,n3",
                       "--nodes-needed", "2", "--excluded", "n2", "--lost-nodes", "n2 n3", "--requeue", "1")
    assert proc.returncode == 1 and "SLURM no longer hears from n3" in proc.stdout and "no spare node left" in proc.stdout
    assert _sourced(tmp_path / "next_step.env") == {"STEP_NODES": "", "EXCLUDED_NODES": "n2,n3",
                                                     "REQUEUE_EXCLUDE": "n2,n3"}
    events = read_events(tmp_path)
    assert [(e["event"], e["action"]) for e in events] == [
        ("failure", RESTART), ("exclude", "restart on a spare"),
        ("failure", STOP_NODE_LOST), ("exclude", EXCLUDE_DOWN)]
    assert events[-1]["node"] == "n3" and events[-1]["cause"].startswith("node lost")


def test_without_a_spare_a_lost_node_goes_to_the_requeue_and_is_recorded_as_down(tmp_path):
    # The survivor's error (a reset connection on n1) is a consequence: the lost node is the cause.
    _summary(tmp_path, "exception", "RuntimeError: Connection reset by peer", 5, rank=0)
    nodes = NodeSet(["n1", "n2"], needed=2, step=["n1", "n2"])
    decision = decide(tmp_path, 0, 3, 1, lost_nodes=["n2"], nodes=nodes, requeue=True)
    assert decision.action == STOP_NODE_LOST
    assert (decision.nodes.step_nodes, decision.nodes.exclude_on_requeue) == ([], ["n2"])
    # DOWN, so allocated to nobody: the batch script does not wait to set ExcNodeList for it.
    assert read_events(tmp_path)[-1] == {**read_events(tmp_path)[-1], "event": "exclude", "node": "n2",
                                         "action": EXCLUDE_DOWN}
    # Not requeued (requeue_on_failure=false): recorded, nothing for ExcNodeList.
    other = tmp_path / "no_requeue"
    other.mkdir()
    decision = decide(other, 0, 3, 1, lost_nodes=["n2"], nodes=nodes, requeue=False)
    assert decision.nodes.exclude_on_requeue == [] and read_events(other)[-1]["action"] == "none: the job is not requeued"


def test_what_names_a_node_and_what_does_not(tmp_path):
    step = ["n1", "n2", "n3"]
    hang = {"what": "hang", "node": "n1", "hosts_not_arrived": ["n3"], "ranks_not_arrived": [4, 5]}
    assert list(blamed_nodes(hang, step)) == ["n3"]  # the stuck node, not rank 0's, which summarised
    assert blamed_nodes({**hang, "hosts_not_arrived": step}, step) == {}  # every node stuck: no evidence
    assert blamed_nodes({"what": "exception", "node": "n1", "error": "DistBackendError: NCCL timed out"}, step) == {}
    assert blamed_nodes({"what": "exit", "node": None, "error": "exit code 137"}, step) == {}
    assert list(blamed_nodes({"what": "exit"}, step, lost_nodes=["n2"])) == ["n2"]
    # A crash on a node without a spare: restarted in place, nothing excluded yet.
    _summary(tmp_path, "exception", "RuntimeError: boom", 3)
    decision = decide(tmp_path, 0, 3, 1, nodes=NodeSet(["n1", "n2"], needed=2, step=["n1", "n2"]))
    assert decision.restart and decision.nodes.step_nodes == ["n1", "n2"] and decision.nodes.excluded == []
    # ... and when the restarts are used up, the requeue excludes it.
    _summary(tmp_path, "exception", "RuntimeError: boom again", 9)
    decision = decide(tmp_path, 3, 3, 1, nodes=NodeSet(["n1", "n2"], needed=2, step=["n1", "n2"]), requeue=True)
    assert decision.action == STOP_EXHAUSTED and decision.nodes.exclude_on_requeue == ["n2"]


def _spike(run_dir: Path, spike_step: int, max_rewinds: int) -> None:
    _summary(run_dir, "spike", "LossSpike: loss spike at step ...", spike_step, rank=0)
    path = run_dir / "failure" / "summary.json"
    summary = json.loads(path.read_text())
    summary["rewind"] = {"spike_step": spike_step, "onset_step": spike_step, "skip_batches": None,
                         "max_rewinds": max_rewinds}
    path.write_text(json.dumps(summary))


def test_a_loss_spike_rewinds_on_its_own_budget_not_max_restarts(tmp_path):
    """trainer.on_spike=rewind: the decision rewinds with cluster.max_restarts=0, counts rewinds over
    the whole run (trainer.max_rewinds), and a fault restart after a rewind still has max_restarts."""
    _spike(tmp_path, 8, max_rewinds=2)
    first = decide(tmp_path, 0, 0, 1)
    assert first.action == REWIND and first.restart and first.event["rewind"] == 1, first.message
    assert "rewind 1 of 2" in first.message and "before step 8" in first.message
    _summary(tmp_path, "exception", "RuntimeError: boom", 9)
    assert decide(tmp_path, 1, 1, 1).action == RESTART  # the rewind did not use max_restarts=1
    _spike(tmp_path, 11, max_rewinds=2)
    assert decide(tmp_path, 2, 1, 1).action == REWIND
    _spike(tmp_path, 12, max_rewinds=2)
    last = decide(tmp_path, 3, 1, 1)
    assert last.action == STOP_REWINDS and not last.restart and "trainer.max_rewinds=2" in last.message
    assert [e["action"] for e in read_events(tmp_path)] == [REWIND, RESTART, REWIND, STOP_REWINDS]


def test_a_pending_rewind_starts_before_the_onset_once_and_moves_newer_checkpoints_aside(tmp_path):
    from launcher.checkpoint.folder import step_dir_name
    from launcher.runtime.rewind import apply_on_rank0, latest_rewind, rewind_start

    root = tmp_path / "checkpoints"
    for step in (3, 6, 9):
        (root / step_dir_name(step)).mkdir(parents=True)
        (root / step_dir_name(step) / "trainer.json").write_text(json.dumps({"step": step}))
    assert latest_rewind(tmp_path) is None and rewind_start(root, None) is None
    _spike(tmp_path, 10, max_rewinds=3)
    summary = json.loads((tmp_path / "failure" / "summary.json").read_text())
    summary["rewind"]["onset_step"] = 8  # log_every=2: the spike began after step 7, the last logged one
    (tmp_path / "failure" / "summary.json").write_text(json.dumps(summary))
    decide(tmp_path, 0, 0, 1)
    rewind = latest_rewind(tmp_path)
    assert (rewind.number, rewind.spike_step, rewind.onset_step, rewind.skip_batches) == (1, 10, 8, None)
    start = rewind_start(root, rewind)
    assert (start.step, start.skip, start.path) == (6, 4, str(root / step_dir_name(6)))  # batches 7-10
    apply_on_rank0(tmp_path, root, start)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [step_dir_name(3), step_dir_name(6)]
    aside = [p for p in root.iterdir() if p.name.startswith("abandoned_")]
    assert len(aside) == 1 and (aside[0] / step_dir_name(9)).is_dir()
    rewound = [e for e in read_events(tmp_path) if e["event"] == "rewound"]
    assert rewound[0]["from_step"] == 6 and rewound[0]["skipped_batches"] == 4 and rewound[0]["rewind"] == 1
    # A crash before the rewound timeline's first save: the same start again.
    assert rewind_start(root, rewind) == start
    # Once a checkpoint of the rewound timeline exists, resuming is ordinary.
    (root / step_dir_name(8)).mkdir()
    (root / step_dir_name(8) / "trainer.json").write_text(json.dumps({"step": 8, "rewinds_applied": 1,
                                                                         "batches_skipped": 4}))
    assert rewind_start(root, rewind) is None


def test_goodput_accounts_restarts_recomputed_steps_and_requeues_and_adds_up():
    """Three attempts: a launch, an in-job restart that resumed at the step-4 checkpoint (the
    steps after it were trained twice), and a requeued job that started 100 s after the last record."""
    from launcher.observe.goodput import BUCKETS, Attempt, account, summary_line

    def attempt(start, end, launch, new, resumed, productive, saves):
        buckets = {"productive": productive, "compile_warmup": 2.0, "checkpoint": 1.0, "data_wait": 0.5,
                   "eval": 0.0, "startup": 3.0}
        return Attempt(start, end, launch, new, resumed, resumed + 4, buckets, saves)

    attempts = [attempt(1005.0, 1030.0, 1000.0, True, 0, 16.0, {4: 8.0}),
                attempt(1040.0, 1060.0, 1000.0, False, 4, 12.0, {8: 12.0}),
                attempt(1200.0, 1220.0, 1160.0, True, 8, 10.0, {})]
    got = account(attempts, now=1225.0)
    assert got["wall"] == 225.0  # from the first launch
    assert got["recomputed"] == 8.0  # attempt 1's productive after its step-4 save
    assert got["productive"] == 16.0 + 12.0 + 10.0 - 8.0
    assert got["restart"] == 10.0  # 1030 -> 1040, inside the launch
    assert got["between_jobs"] == 100.0  # 1060 -> the requeued job's launch at 1160
    assert got["startup"] == 3 * 3.0 + 5.0 + 40.0  # the ranks' own, plus each launch until its ranks started
    assert sum(got[b] for b in BUCKETS) == pytest.approx(got["wall"]) and got["other"] >= 0
    assert summary_line(got).startswith("goodput: 13% productive (30.0 s of 225.0 s wall); between jobs 44%")
