"""`train ... cluster=slurm` end to end on the development cluster: the real CLI, real jobs.

(b) a malformed config never reaches the queue; (c) the debug recipe trains as a SLURM job
with falling loss; (d) a job sent USR1 mid-run checkpoints, requeues, resumes and ends with
the same per-step losses as the uninterrupted run; Hydra multirun submits one job per point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from conftest import TRAIN, losses_by_step, read_metrics, run_train, train_env
from slurm_cluster import JOB_NODES, JobInfo, SlurmCluster, slurm_cluster  # noqa: F401  (fixture)
from launcher.resilience.debug_hooks import held_marker
from launcher.resilience.restarts import read_events
from tests.deepspeed_harness.common import deepspeed_env

pytestmark = pytest.mark.slurm

STEPS = 24
JOB_TIMEOUT_S = 420
# Small and fast: 2 CPU ranks, a checkpoint every 4 steps, a metrics row every step.
# cluster.name=slurm is spelled out so that these tests exercise SLURM even while a recipe
# pins cluster.name; test_recipe_with_cluster_slurm_composes_to_slurm checks the short form.
COMMON = [
    "+recipe=debug",
    "cluster=slurm",
    "cluster.name=slurm",
    "cluster.gpus_per_node=2",
    "cluster.exclusive=false",
    "cluster.rdzv_port=0",
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "checkpoint.interval=4",
    "logging.progress=false",
]


def submit_train(run_dir: Path, *extra: str) -> str:
    """Run `train COMMON EXTRA` (which submits and returns); the job id it submitted.
    A key given in EXTRA replaces COMMON's value (Hydra refuses a key given twice)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    keys = {arg.split("=", 1)[0] for arg in extra}
    common = [arg for arg in COMMON if arg.split("=", 1)[0] not in keys]
    # W&B on (offline), as a user's job has it: its files are among those the secret must stay out of.
    proc = run_train([*common, *extra], run_dir, timeout=180, wandb="offline")
    assert proc.returncode == 0, f"train exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    info_path = run_dir / "slurm_job.json"
    assert info_path.exists(), f"train did not submit a SLURM job (cluster.name ignored?):\n{proc.stdout[-2000:]}"
    job_id = json.loads(info_path.read_text())["job_id"]
    assert f"submitted SLURM job {job_id}" in proc.stdout
    assert str(run_dir / "job.sbatch") in proc.stdout
    return job_id


def job_logs(run_dir: Path, job_id: str) -> str:
    logs = run_dir / "logs"
    parts = []
    for path in [logs / f"slurm-{job_id}.out", logs / f"slurm-{job_id}.err", *sorted(logs.glob("rank_*.log"))]:
        if path.exists():
            parts.append(f"----- {path.name}\n{path.read_text()[-3000:]}")
    return "\n".join(parts)


def wait_done(cluster: SlurmCluster, job_id: str, run_dir: Path):
    info = cluster.wait(job_id, timeout=JOB_TIMEOUT_S)
    assert info.state == "COMPLETED" and info.rc == 0, f"{info.state} {info.exit_code}\n{job_logs(run_dir, job_id)}"
    return info


SECRET = "hf_s3cr3t-VALUE-51d0"
UNFIT_NODE = "n1"  # where the reference job's first run lands (submitted first, on an idle cluster)


@dataclass
class TrainJob:
    job_id: str
    run_dir: Path
    info: JobInfo
    signalled_at: int = 0  # last logged step when USR1 was sent (0: not signalled)
    losses_before_kill: Dict[int, float] = None  # the losses logged when a rank was SIGKILLed
    checkpoint_at_kill: int = 0  # the newest checkpoint's step just after the kill

    @property
    def main_log(self) -> str:
        return (self.run_dir / "logs" / f"slurm-{self.job_id}.out").read_text()


HOLD_STEP = {"preempted": 3, "restarted": 5, "restarted_zero2": 5}  # where a signalled or killed run waits


def hold_env(run_dir: Path, name: str) -> str:
    """The override that makes every rank of run `name` wait after its step HOLD_STEP[name]
    (LAUNCHER_DEBUG_HOLD) until release_file(run_dir) exists or a stop is requested: the signal or
    the kill lands at that step however loaded the machine is."""
    return f"+cluster.env.LAUNCHER_DEBUG_HOLD={HOLD_STEP[name]}:{release_file(run_dir)}"


def release_file(run_dir: Path) -> Path:
    return run_dir.parent / "release"


def wait_held(cluster: SlurmCluster, job_id: str, run_dir: Path, rank: int) -> None:
    """Wait until global rank `rank` of the job holds after its HOLD_STEP (it touched release.rank<R>)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    held = held_marker(release_file(run_dir), rank)
    while not held.exists():
        state = cluster.job(job_id).state
        assert state in ("PENDING", "RUNNING"), f"job {job_id} {state} before it held\n{job_logs(run_dir, job_id)}"
        assert time.monotonic() < deadline, f"job {job_id}: rank {rank} did not hold in {JOB_TIMEOUT_S} s"
        time.sleep(0.2)


def signal_mid_run(cluster: SlurmCluster, job_id: str, run_dir: Path) -> int:
    """Send USR1 to the batch script while the ranks hold after step HOLD_STEP["preempted"] (they
    go on once the stop request reaches them); returns the last logged step."""
    wait_held(cluster, job_id, run_dir, rank=0)
    cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    return read_metrics(run_dir)[-1]["step"]


def rank_pid(run_dir: Path, rank: int) -> int:
    """The process of global rank `rank` of the job training in `run_dir` (not its torchrun)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"launcher.runtime.entry" not in argv or str(run_dir).encode() not in argv:
                continue
            if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue  # ended while we looked, or not a process folder
    assert len(found) == 1, f"rank {rank} of {run_dir}: processes {found}"
    return found[0]


def kill_ranks_mid_run(cluster: SlurmCluster, runs: Dict[str, Tuple[str, Path]]) -> Dict[str, Tuple[Dict[int, float], int]]:
    """SIGKILL global rank 1 of each run (name -> job id, run dir) while it holds after step 5
    (its step-4 checkpoint written), then release the run's other rank, which meets the dead rank
    in the next collective; returns, by name, the losses logged by then (step -> loss; the resumed
    rank 0 rewrites metrics.jsonl from its checkpoint's step on) and the newest checkpoint's step
    (a save is renamed to step_N when complete)."""
    killed = {}
    for name, (job_id, run_dir) in runs.items():
        wait_held(cluster, job_id, run_dir, rank=1)
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        newest = max(int(p.name[len("step_"):]) for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir())
        killed[name] = (losses_by_step(run_dir), newest)
        release_file(run_dir).touch()  # the restarted ranks pass step 5 without holding
    return killed


@pytest.fixture(scope="module")
def train_jobs(slurm_cluster: SlurmCluster, tmp_path_factory) -> Dict[str, TrainJob]:
    """Four debug runs submitted together (they share the queue's idle time): "reference" runs
    uninterrupted on one node (2 ranks), after a first run on n1 (the idle cluster's first node)
    that fails its pre-flight health check there (LAUNCHER_DEBUG_PROBE=n1:fail) before training
    a step and is requeued with n1 excluded; "preempted" runs on both nodes (1 rank each) and gets
    USR1 after its third step; "restarted" runs on both nodes (1 rank each,
    cluster.max_restarts=1) and its rank 1 is SIGKILLed after step 5 (both wait there: HOLD_STEP); "restarted_zero2" is
    "restarted" with DeepSpeed ZeRO-2 owning the model states, killed the same way.

    All are submitted with a secret in the environment (HF_TOKEN, in cluster.secret_env).
    """
    base = tmp_path_factory.mktemp("slurm_train")
    dirs = {"reference": base / "reference" / "run", "preempted": base / "preempted" / "run",
            "restarted": base / "restarted" / "run", "restarted_zero2": base / "restarted_zero2" / "run"}
    restarted = [f"cluster.nodes={JOB_NODES}", "cluster.gpus_per_node=1", "cluster.max_restarts=1"]
    # The jobs inherit the environment (sbatch --export=ALL). The DeepSpeed ranks look for their
    # JIT ops where the suite's background prebuild puts them (tests/conftest.py).
    env = {"HF_TOKEN": SECRET, "TORCH_EXTENSIONS_DIR": deepspeed_env()["TORCH_EXTENSIONS_DIR"]}
    previous = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        ids = {
            "reference": submit_train(dirs["reference"], "trainer.health_check=on", "cluster.requeue_on_failure=true",
                                      f"+cluster.env.LAUNCHER_DEBUG_PROBE={UNFIT_NODE}:fail"),
            "preempted": submit_train(dirs["preempted"], f"cluster.nodes={JOB_NODES}", "cluster.gpus_per_node=1",
                                      hold_env(dirs["preempted"], "preempted")),
            "restarted": submit_train(dirs["restarted"], *restarted, hold_env(dirs["restarted"], "restarted")),
            # ZeRO-2 without offload needs one DeepSpeed JIT op, the shared-memory comm op (no CPU
            # Adam: the optimizer is torch's AdamW); the prebuild builds it first (about 95 s at
            # nice 19 on 2 loaded cores, from scratch), and a rank that finds it building waits
            # on its lock.
            "restarted_zero2": submit_train(dirs["restarted_zero2"], *restarted, "parallel.zero_stage=2",
                                            "backend=deepspeed", hold_env(dirs["restarted_zero2"], "restarted_zero2")),
        }
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
    t0 = time.monotonic()
    signalled_at = {"preempted": signal_mid_run(slurm_cluster, ids["preempted"], dirs["preempted"])}
    killed = kill_ranks_mid_run(slurm_cluster, {name: (ids[name], dirs[name]) for name in ("restarted", "restarted_zero2")})
    signalled_at.update({name: max(losses) for name, (losses, _) in killed.items()})
    jobs = {}
    for name in dirs:
        # A restarted job's end is its test's to judge: a failure there fails that test only.
        info = (slurm_cluster.wait(ids[name], timeout=JOB_TIMEOUT_S) if name in killed
                else wait_done(slurm_cluster, ids[name], dirs[name]))
        jobs[name] = TrainJob(ids[name], dirs[name], info, signalled_at.get(name, 0), *killed.get(name, (None, 0)))
        print(f"{name} job {ids[name]}: done after {time.monotonic() - t0:.1f} s, restarts={info.restarts}")
    return jobs


def test_recipe_with_cluster_slurm_composes_to_slurm():
    from launcher.config.loader import compose_spec

    spec = compose_spec(["+recipe=debug", "cluster=slurm"])
    assert spec.cluster.name == "slurm", (
        "`train +recipe=debug cluster=slurm` would run locally: the recipe sets cluster.name, which "
        "overrides the cluster group chosen on the command line; remove `cluster.name` from the recipe"
    )


def test_malformed_config_fails_before_sbatch(slurm_cluster: SlurmCluster, tmp_path):
    before = set(slurm_cluster.job_ids())
    run_dir = tmp_path / "bad"
    proc = run_train(["+recipe=debug", "cluster=slurm", "cluster.name=slurm", "parallel.tp=3"], run_dir, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "parallel.tp" in proc.stderr and "Traceback" not in proc.stderr
    assert set(slurm_cluster.job_ids()) == before
    assert not (run_dir / "job.sbatch").exists()


def test_debug_recipe_trains_as_a_slurm_job(train_jobs: Dict[str, TrainJob]):
    ref = train_jobs["reference"]
    assert ref.info.restarts == 1  # the requeue after the unfit node (the next test), nothing else
    losses_at = losses_by_step(ref.run_dir)
    assert sorted(losses_at) == list(range(1, STEPS + 1)), sorted(losses_at)
    losses = [losses_at[s] for s in sorted(losses_at)]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.1, f"loss did not fall: first steps {losses[:3]}, last steps {losses[-3:]}"
    assert "launcher: training finished" in ref.main_log


def test_a_node_failing_its_health_check_is_excluded_from_the_requeued_job(
        slurm_cluster: SlurmCluster, train_jobs: Dict[str, TrainJob]):
    """No spare: the node whose probe fails ends the run before its first step (`stop: unfit
    node`), and cluster.requeue_on_failure requeues the job with the node in its ExcNodeList (set
    once the job is pending again: SLURM refuses it for a running job), so the requeued run lands
    on another node, passes the check there and trains."""
    ref = train_jobs["reference"]
    log = ref.main_log
    first_run = re.search(r"job \d+ restart 0 \(max \d+\) on (\S+) at", log)
    assert first_run and first_run[1] == UNFIT_NODE, (
        f"the reference job's first run was not on {UNFIT_NODE} (the idle cluster's first node), so its "
        f"health-check hook never fired:\n{log[-3000:]}")
    assert f"health check failed before the first step: rank 0 on {UNFIT_NODE}" in log, log[-4000:]
    assert f"node(s) {UNFIT_NODE} join ExcNodeList once job {ref.job_id} is pending again" in log, log[-4000:]
    assert f"excluded node(s) from the requeued job {ref.job_id} (ExcNodeList={UNFIT_NODE})" in log, log[-4000:]
    second_run = re.search(r"job \d+ restart 1 \(max \d+\) on (\S+) at", log)
    assert second_run and UNFIT_NODE not in slurm_cluster.run(
        ["scontrol", "show", "hostnames", second_run[1]]).stdout.split(), log[-4000:]
    assert f"job {ref.job_id} excludes node(s): {UNFIT_NODE}" in log, log[-4000:]
    assert slurm_cluster.job(ref.job_id).fields["ExcNodeList"] == UNFIT_NODE
    events = read_events(ref.run_dir)
    health = [e for e in events if e["event"] == "health"]
    assert not health[0]["ok"] and {b["host"] for b in health[0]["named"]} == {UNFIT_NODE}, events
    assert health[-1]["ok"], events  # the requeued run's check, on a healthy node
    failures = [(e["cause"]["what"], e["action"]) for e in events if e["event"] == "failure"]
    assert failures == [("health", "stop: unfit node")], events
    excluded = [(e["node"], e["action"]) for e in events if e["event"] == "exclude"]
    assert excluded == [(UNFIT_NODE, "excluded from the requeued job")], events


def test_secret_reaches_the_job_but_no_file_of_the_run(train_jobs: Dict[str, TrainJob]):
    for job in train_jobs.values():
        assert "secret HF_TOKEN is set (value not shown)" in job.main_log
        # Script, resolved config, plan, logs, metrics, checkpoints, W&B files.
        for path in job.run_dir.rglob("*"):
            if path.is_file():
                assert SECRET.encode() not in path.read_bytes(), f"secret value written to {path}"


def test_usr1_checkpoints_requeues_and_resumes_with_identical_losses(train_jobs: Dict[str, TrainJob]):
    job, ref = train_jobs["preempted"], train_jobs["reference"]
    log = job.main_log
    assert job.signalled_at == HOLD_STEP["preempted"], f"signalled after step {job.signalled_at}, not while the ranks held"
    assert job.info.restarts == 1, f"job was not requeued (restarts={job.info.restarts})\n{job_logs(job.run_dir, job.job_id)}"
    assert "received SIGUSR1" in log and "requeueing job" in log, log
    stopped = json.loads(log.split("the ranks checkpointed and stopped: ", 1)[1].splitlines()[0])
    # The ranks agree on a stop one check after they see it (runtime/signals.py): the next step.
    assert job.signalled_at <= stopped["step"] <= job.signalled_at + 1, stopped
    # The job spans both nodes, and every rank on every node stopped at the same step.
    rank_logs = [(job.run_dir / "logs" / f"rank_{r}.log").read_text() for r in range(JOB_NODES)]
    nodes = {re.search(r"placement: rank \d+ local_rank 0 node (\S+)", text)[1] for text in rank_logs}
    assert len(nodes) == JOB_NODES, nodes
    for text in rank_logs:
        assert re.findall(r"stopped at step (\d+)", text) == [str(stopped["step"])], text[-2000:]
    resumed, reference = losses_by_step(job.run_dir), losses_by_step(ref.run_dir)
    assert sorted(resumed) == sorted(reference)
    diffs = {s: abs(resumed[s] - reference[s]) for s in reference}
    assert max(diffs.values()) == 0.0, f"losses differ after resume from step {stopped['step']}: {diffs}"


def _assert_restarted_in_the_allocation_from_the_newest_checkpoint(job: TrainJob) -> int:
    """The killed job restarted once in its allocation (no requeue), resumed from the newest
    checkpoint before the kill, logged every step once and counted the restart; returns the
    step it resumed from."""
    log = job.main_log
    assert job.info.state == "COMPLETED" and job.info.rc == 0, f"{job.info}\n{job_logs(job.run_dir, job.job_id)}"
    assert job.signalled_at == HOLD_STEP["restarted"], f"killed after step {job.signalled_at}, not while the ranks held"
    assert job.info.restarts == 0 and "requeueing job" not in log, log
    assert "restarting them (restart 1 of 1)" in log and "in-job restart 1 of 1: a new srun step" in log, log
    records = [json.loads(line) for line in (job.run_dir / "resilience.jsonl").read_text().splitlines()]
    # The pre-flight health check (on for 2 nodes) records a passing event at each start.
    health = [e for e in records if e["event"] == "health"]
    assert [(e["restart"], e["ok"]) for e in health] == [(0, True), (1, True)], health
    events = [e for e in records if e["event"] != "health"]
    assert [(e["event"], e.get("action")) for e in events] == [("failure", "restart"), ("resumed", None)], events
    resumed = events[1]
    assert job.checkpoint_at_kill <= resumed["step"] <= job.signalled_at and resumed["restart"] == 1, (
        f"resumed from step {resumed['step']}; the newest checkpoint at the kill was step "
        f"{job.checkpoint_at_kill}, the last logged step {job.signalled_at}: {events}")
    records = read_metrics(job.run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    after = [r for r in records if "resilience/restarts" in r]
    assert len(after) == 1 and after[0]["step"] == resumed["step"] + 1, after
    assert after[0]["resilience/restarts"] == 1 and 0 < after[0]["resilience/downtime_s"] < JOB_TIMEOUT_S, after
    return resumed["step"]


def test_a_killed_rank_restarts_in_the_allocation_without_a_requeue_and_resumes_exactly(train_jobs: Dict[str, TrainJob]):
    """cluster.max_restarts=1 on 2 nodes: rank 1 SIGKILLed after step 5 -> the batch script starts a
    new srun step in the same allocation (SLURM never requeues), the ranks resume from the newest
    checkpoint, and the losses equal the uninterrupted reference's."""
    job, ref = train_jobs["restarted"], train_jobs["reference"]
    _assert_restarted_in_the_allocation_from_the_newest_checkpoint(job)
    assert losses_by_step(job.run_dir) == losses_by_step(ref.run_dir)


def test_a_killed_rank_under_deepspeed_zero2_restarts_in_the_allocation_and_redoes_its_steps_exactly(
        train_jobs: Dict[str, TrainJob]):
    """The same kill with DeepSpeed ZeRO-2 owning the model states: restart in the allocation,
    resume from the newest checkpoint; the steps trained twice (after the checkpoint, before the
    kill) log the same losses the second time. (The native reference shards with FSDP, so its
    losses are not DeepSpeed's to the last bit: the run is compared with itself.)"""
    job = train_jobs["restarted_zero2"]
    rank0 = (job.run_dir / "logs" / "rank_0.log").read_text()
    assert "DeepSpeed engine ready: ZeRO-2" in rank0, f"the job did not run on DeepSpeed ZeRO-2:\n{rank0[-3000:]}"
    start = _assert_restarted_in_the_allocation_from_the_newest_checkpoint(job)
    before, after = job.losses_before_kill, losses_by_step(job.run_dir)
    redone = [s for s in sorted(before) if s > start]
    assert redone, f"no step between the checkpoint at {start} and the kill at {job.signalled_at} was logged"
    assert {s: after[s] for s in redone} == {s: before[s] for s in redone}
    assert sorted(after) == list(range(1, STEPS + 1))


def test_crashing_rank_fails_the_job_with_its_error_in_the_main_log(slurm_cluster: SlurmCluster, tmp_path):
    # Passes validation (Megatron-written data has no manifest recording its largest token id),
    # fails inside the ranks: the first batch holds ids beyond model.vocab_size.
    import numpy as np

    from launcher.data.indexed import write_indexed_dataset

    run_dir = tmp_path / "run"
    (tmp_path / "megatron").mkdir()
    write_indexed_dataset(tmp_path / "megatron" / "web", [np.arange(300, 3000, dtype=np.uint16)] * 4, np.uint16)
    job_id = submit_train(run_dir, "data.source=indexed", f"data.path={tmp_path}/megatron")
    info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S)
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert info.state == "FAILED" and info.rc != 0, (info, log)
    assert "the ranks failed" in log
    # cluster.max_restarts=3 (SLURM's default) allows restarts, but the same exception at the same
    # step after the first one is a bug, not a fault: one restart, then the job ends.
    assert "restarting them (restart 1 of 3)" in log and "repeating failure" in log, log
    assert "restart 2 of 3" not in log, log
    assert f"{tmp_path}/megatron/web.bin (source 'megatron') holds token id" in log, log
    assert "model.vocab_size=256" in log, log


def test_sbatch_rejection_is_reported_with_a_fix(slurm_cluster: SlurmCluster, tmp_path):
    # The dev cluster has no GPUs (no gres): asking for them is refused at submit time.
    before = set(slurm_cluster.job_ids())
    proc = run_train([*COMMON, "trainer.device=cuda"], tmp_path / "run", timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "sbatch rejected" in proc.stderr and "trainer.device=cpu" in proc.stderr, proc.stderr
    assert set(slurm_cluster.job_ids()) == before


def test_multirun_submits_one_job_per_point(slurm_cluster: SlurmCluster, tmp_path):
    """One 2-node job per sweep point, each chained (cluster.after, afterany) to a job that fails:
    they start after it ends, although it failed."""
    failing = slurm_cluster.sbatch_wrap("sleep 3; exit 1", f"--output={tmp_path}/failing.out")
    sweep = tmp_path / "sweep"
    cmd = [
        TRAIN, "-m", *COMMON, "cluster.python=/bin/true", "trainer.seed=1,2", f"hydra.sweep.dir={sweep}",
        f"cluster.nodes={JOB_NODES}", f"cluster.after=[{failing}]",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    paths = [sweep / str(i) / "slurm_job.json" for i in (0, 1)]
    assert all(p.exists() for p in paths), f"no SLURM job submitted per sweep point:\n{proc.stdout[-2000:]}"
    infos = [json.loads(p.read_text()) for p in paths]
    assert infos[0]["job_id"] != infos[1]["job_id"]
    before = slurm_cluster.wait(failing, timeout=120)
    assert before.state == "FAILED", before
    for i, info in enumerate(infos):
        done = slurm_cluster.wait(info["job_id"], timeout=120)
        assert done.state == "COMPLETED", done
        assert info["script"] == str(sweep / str(i) / "job.sbatch")
        assert done.fields["NumNodes"] == str(JOB_NODES), done.fields
        # Timestamps to the second: the chained job started no earlier than the failed one ended.
        assert done.fields["StartTime"] >= before.fields["EndTime"], (done.fields, before.fields)
