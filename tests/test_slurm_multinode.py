"""Multi-node jobs for real, on the development cluster (nodes n1..n4 on this one host).

One job, `train +recipe=debug cluster=slurm cluster.nodes=2 cluster.gpus_per_node=2` with
`parallel.dp_shard=2 parallel.tp=2` (fp32), runs three times under one job id:

1. it trains until a checkpoint is written, then its second node is killed (slurmd, step
   daemon, torchrun and ranks SIGKILLed: the peers see reset connections);
2. the job names that node, requeues itself (cluster.requeue_on_failure=true) and reruns on two
   live nodes, resumes from the last checkpoint and trains until a newer one; then its second
   node goes silent (its processes SIGSTOPped: peers see nothing; the survivors give up after
   cluster.collective_timeout_s);
3. the job names that node, requeues, resumes and finishes. The dead nodes come back at the end
   (`dev-cluster.sh up`), not in between: see slurm_cluster.py for why.

Each run's rank logs show the placement (one torchrun per node, local ranks 0-1, distinct
global ranks, each TP group inside a node), and the per-step losses equal those of a 4-rank
local run of the same layout. Multi-node preemption (USR1) is the "preempted" job of
test_slurm_train.py, which runs on 2 nodes.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import pytest

from launcher.resilience.restarts import EXCLUDE_DOWN
from conftest import losses_by_step, read_metrics, run_train
from slurm_cluster import JOB_NODES, SlurmCluster, dev_cluster_up, slurm_cluster  # noqa: F401  (fixture)
from test_slurm_train import job_logs, submit_train

pytestmark = pytest.mark.slurm

STEPS = 24
COLLECTIVE_TIMEOUT_S = 15
# A death is noticed by the survivors at once (killed) or after the collective timeout (silent),
# by SLURM after 25-30 s (slurm/dev-cluster.sh, SlurmdTimeout); the requeued job starts ~6 s after
# (cred_expire + 1 s, slurm/dev-cluster.sh).
DEATH_TO_REQUEUE_S = 240
JOB_TIMEOUT_S = 420
# The spare-node job's two checkpoint tiers: shared every 8 steps, node-local every 2.
SHARED_INTERVAL = 8
LOCAL_INTERVAL = 2
LAYOUT = [
    "cluster.gpus_per_node=2",
    "parallel.dp_shard=2",
    "parallel.tp=2",
    f"trainer.steps={STEPS}",
    "trainer.log_every=1",
    "checkpoint.interval=4",
    "logging.progress=false",
]
PLACEMENT = re.compile(
    r"placement: rank (\d+) local_rank (\d+) node (\S+) host (\S+) torchrun_pid (\d+) coords (\{.*\})"
)


@dataclass
class Placement:
    rank: int
    local_rank: int
    node: str
    host: str
    torchrun_pid: int
    coords: Dict[str, int]


def placements(run_dir: Path) -> List[List[Placement]]:
    """Per run of the job (rank logs are appended across requeues), every rank's placement line."""
    runs: Dict[int, List[Placement]] = defaultdict(list)
    for path in sorted((run_dir / "logs").glob("rank_*.log")):
        for i, m in enumerate(PLACEMENT.finditer(path.read_text())):
            runs[i].append(Placement(int(m[1]), int(m[2]), m[3], m[4], int(m[5]), json.loads(m[6])))
    return [runs[i] for i in sorted(runs)]


def slurmd_pid(cluster: SlurmCluster, node: str) -> int:
    conf = cluster.run(["scontrol", "show", "config"]).stdout
    pattern = re.search(r"SlurmdPidFile\s*=\s*(\S+)", conf)[1]
    return int(Path(pattern.replace("%n", node)).read_text().strip())


def node_processes(cluster: SlurmCluster, node: str) -> List[int]:
    """The processes that make up node `node` on this host: its slurmd, and every job process
    SLURM started there (SLURMD_NODENAME=node in its environment) with its slurmstepd parent."""
    pids = {slurmd_pid(cluster, node)}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
            if f"SLURMD_NODENAME={node}".encode() not in env:
                continue
            pids.add(int(proc.name))
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if (Path("/proc") / str(parent) / "comm").read_text().strip() == "slurmstepd":
                pids.add(parent)
        except (OSError, ValueError, IndexError):
            continue  # ended while we looked
    return sorted(pids)


def signal_all(pids: List[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def checkpoint_steps(run_dir: Path) -> List[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*")) if root.is_dir() else []


def second_node(cluster: SlurmCluster, job_id: str) -> str:
    """The running job's second node (the first runs the batch script; a dead batch node is
    SLURM's own NODE_FAIL, not the launcher's to handle)."""
    nodelist = cluster.job(job_id).fields["NodeList"]
    return cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()[1]


def wait_for_checkpoint_after(cluster: SlurmCluster, job_id: str, run_dir: Path, step: int) -> int:
    """Wait until the running job has written a checkpoint newer than `step` and trained one
    step past it (so its ranks are in a training step's collectives); returns that checkpoint's step."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        info = cluster.job(job_id)
        assert info.state in ("PENDING", "RUNNING"), f"job {job_id} {info.state} too early\n{job_logs(run_dir, job_id)}"
        newer = [s for s in checkpoint_steps(run_dir) if s > step]
        logged = read_metrics(run_dir)[-1]["step"] if newer and (run_dir / "metrics.jsonl").exists() else 0
        if newer and info.state == "RUNNING" and logged > newer[-1]:
            assert logged < STEPS - 2, f"the job reached step {logged} of {STEPS} before the node died: raise STEPS"
            return newer[-1]
        assert time.monotonic() < deadline, f"no checkpoint after step {step} in {JOB_TIMEOUT_S} s\n{job_logs(run_dir, job_id)}"
        time.sleep(0.2)


def wait_requeued(cluster: SlurmCluster, job_id: str, run_dir: Path, restarts: int) -> None:
    deadline = time.monotonic() + DEATH_TO_REQUEUE_S
    info = cluster.job(job_id)
    while info.restarts < restarts:
        assert info.state in ("RUNNING", "COMPLETING", "PENDING"), (
            f"job {job_id} ended {info.state} instead of requeueing\n{job_logs(run_dir, job_id)}"
        )
        assert time.monotonic() < deadline, (
            f"job {job_id} hangs: not requeued {DEATH_TO_REQUEUE_S} s after a node died ({info.state})\n"
            f"{job_logs(run_dir, job_id)}"
        )
        time.sleep(0.5)
        info = cluster.job(job_id)


@dataclass
class NodeDeathRun:
    job_id: str
    run_dir: Path
    reference_dir: Path
    killed_after: int  # checkpoint step written before a node was killed
    stopped_after: int  # ... before a node was SIGSTOPped
    killed: str  # the node killed
    stopped: str  # the node SIGSTOPped
    main_log: str
    state: str


@pytest.fixture(scope="module")
def node_death_run(slurm_cluster: SlurmCluster, tmp_path_factory) -> NodeDeathRun:
    base = tmp_path_factory.mktemp("multinode")
    run_dir, ref_dir = base / "slurm" / "run", base / "local" / "run"
    ref_dir.parent.mkdir(parents=True)
    with ThreadPoolExecutor(1) as pool:
        # The 4-rank local run of the same layout, alongside the job.
        reference = pool.submit(run_train, ["+recipe=debug", "cluster.name=local", *LAYOUT[1:], "cluster.gpus_per_node=4"], ref_dir, 600)
        job_id = submit_train(
            run_dir, f"cluster.nodes={JOB_NODES}", *LAYOUT, "cluster.requeue_on_failure=true",
            f"cluster.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", "cluster.max_requeues=2",
        )
        silent: List[int] = []
        try:
            killed_after = wait_for_checkpoint_after(slurm_cluster, job_id, run_dir, 0)
            killed = second_node(slurm_cluster, job_id)
            signal_all(node_processes(slurm_cluster, killed), signal.SIGKILL)
            wait_requeued(slurm_cluster, job_id, run_dir, 1)

            stopped_after = wait_for_checkpoint_after(slurm_cluster, job_id, run_dir, killed_after)
            stopped = second_node(slurm_cluster, job_id)
            silent = node_processes(slurm_cluster, stopped)
            signal_all(silent, signal.SIGSTOP)
            wait_requeued(slurm_cluster, job_id, run_dir, 2)
            signal_all(silent, signal.SIGKILL)  # the silent node does not come back as it was

            info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S)
        finally:
            signal_all(silent, signal.SIGKILL)
            dev_cluster_up()  # bring the dead nodes back for the other tests, whatever happened
        ref = reference.result()
        assert ref.returncode == 0, f"local reference run failed:\n{ref.stdout[-3000:]}\n{ref.stderr[-3000:]}"
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    return NodeDeathRun(
        job_id, run_dir, ref_dir, killed_after, stopped_after, killed, stopped, log, f"{info.state} {info.exit_code}"
    )


def test_two_node_job_places_one_torchrun_per_node_and_tp_groups_inside_nodes(node_death_run: NodeDeathRun):
    runs = placements(node_death_run.run_dir)
    assert len(runs) == 3, f"expected three runs of the job (two node deaths), got {len(runs)}"
    for run in runs:
        assert sorted(p.rank for p in run) == [0, 1, 2, 3], run
        by_node: Dict[str, List[Placement]] = defaultdict(list)
        for p in run:
            by_node[p.node].append(p)
        assert len(by_node) == JOB_NODES, run
        for node, ranks in by_node.items():
            assert sorted(p.local_rank for p in ranks) == [0, 1], (node, run)
            assert len({p.torchrun_pid for p in ranks}) == 1, f"node {node}: not one torchrun for its ranks: {run}"
        assert len({p.torchrun_pid for p in run}) == 2, run
        assert len({p.host for p in run}) == 1  # one host: nodes are told apart by SLURMD_NODENAME
        # A TP group: the ranks whose coordinates differ only in tp. It must not cross a node.
        groups: Dict[str, set] = defaultdict(set)
        for p in run:
            key = json.dumps({k: v for k, v in p.coords.items() if k != "tp"}, sort_keys=True)
            groups[key].add(p.node)
        assert len(groups) == 2 and all(len(nodes) == 1 for nodes in groups.values()), (groups, run)


def test_node_deaths_name_the_node_requeue_and_resume_with_the_local_losses(node_death_run: NodeDeathRun):
    run = node_death_run
    assert run.state == "COMPLETED 0:0", f"{run.state}\n{job_logs(run.run_dir, run.job_id)}"
    log = run.main_log
    # Both deaths: the job says which node, and requeues; every rerun resumes from a checkpoint.
    assert run.killed != run.stopped
    for node in (run.killed, run.stopped):
        assert log.count(f"node(s) {node} stopped responding") == 1, log
    assert log.count("cluster.requeue_on_failure: requeueing job") == 2, log
    # No in-job restart onto a dead node (cluster.max_restarts=3 is SLURM's default; no spare
    # node): each loss is recorded with its node, DOWN and so allocated to nobody while down.
    events = [json.loads(line) for line in (run.run_dir / "resilience.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["event"] == "failure"]
    assert [(e["action"], e["cause"]["lost_nodes"]) for e in failures] == [
        ("stop: node lost", [run.killed]), ("stop: node lost", [run.stopped])], events
    excluded = [(e["node"], e["action"]) for e in events if e["event"] == "exclude"]
    assert excluded == [(run.killed, EXCLUDE_DOWN), (run.stopped, EXCLUDE_DOWN)]
    assert log.count("not added to ExcNodeList: not responding") == 2, log
    rank0 = (run.run_dir / "logs" / "rank_0.log").read_text()
    resumed = re.findall(r"resumed from \S+ at step (\d+)", rank0)
    assert [int(s) for s in resumed] == [run.killed_after, run.stopped_after], resumed
    # The silent node: the survivors' collectives gave up after cluster.collective_timeout_s
    # (15 s; SLURM marks the node DOWN only after 20-30 s), so the job ended and requeued.
    survivors = "\n".join(p.read_text() for p in (run.run_dir / "logs").glob("rank_*.log"))
    assert "Timed out waiting" in survivors, "no rank's collective timed out after the node went silent"
    losses, reference = losses_by_step(run.run_dir), losses_by_step(run.reference_dir)
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 1))
    diffs = {s: abs(losses[s] - reference[s]) for s in reference}
    assert max(diffs.values()) <= 1e-6, f"2-node losses differ from the 4-rank local run: {diffs}"


@dataclass
class SpareRun:
    job_id: str
    run_dir: Path
    killed_after: int  # shared checkpoint step written before the node was killed
    local_step: int  # a node-local step (newer than killed_after) the killed node held before it died
    killed: str
    allocation: List[str]
    main_log: str
    state: str
    requeues: int
    setup_s: float  # from submission to the job's end


@pytest.fixture(scope="module")
def spare_node_run(slurm_cluster: SlurmCluster, tmp_path_factory) -> SpareRun:
    """`cluster.spare_nodes=1`: a 2-node job on 3 allocated nodes; its second node is killed as in
    node_death_run, and the job goes on in the same allocation on the first node and the spare.

    With the node-local tier (checkpoint.local_dir, every LOCAL_INTERVAL steps; the shared
    checkpoint every SHARED_INTERVAL): the node is killed once it holds a local step newer than
    the shared checkpoint, so the restart resumes from the local tier, the killed node's ranks
    from the replicas their peers on the first node keep."""
    run_dir = tmp_path_factory.mktemp("spare") / "run"
    local_dir = run_dir.parent / "node-local"
    layout = [arg for arg in LAYOUT if not arg.startswith("checkpoint.interval=")]
    t0 = time.monotonic()
    job_id = submit_train(run_dir, f"cluster.nodes={JOB_NODES}", "cluster.spare_nodes=1", *layout,
                          f"checkpoint.interval={SHARED_INTERVAL}", f"checkpoint.local_dir={local_dir}",
                          f"checkpoint.local_interval={LOCAL_INTERVAL}",
                          f"cluster.collective_timeout_s={COLLECTIVE_TIMEOUT_S}", "cluster.max_requeues=0")
    try:
        killed_after = wait_for_checkpoint_after(slurm_cluster, job_id, run_dir, 0)
        nodelist = slurm_cluster.job(job_id).fields["NodeList"]
        allocation = slurm_cluster.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()
        killed = second_node(slurm_cluster, job_id)
        local_step = wait_for_local_step_after(slurm_cluster, job_id, run_dir, local_dir / "*" / killed, killed_after)
        signal_all(node_processes(slurm_cluster, killed), signal.SIGKILL)
        info = slurm_cluster.wait(job_id, timeout=JOB_TIMEOUT_S)
    finally:
        dev_cluster_up()  # bring the dead node back for the other tests, whatever happened
    log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
    return SpareRun(job_id, run_dir, killed_after, local_step, killed, allocation, log,
                    f"{info.state} {info.exit_code}", info.restarts, round(time.monotonic() - t0, 1))


def wait_for_local_step_after(cluster: SlurmCluster, job_id: str, run_dir: Path, node_folder: Path, step: int) -> int:
    """Wait until the node's local tier holds a complete step newer than `step` (its ranks' own
    files and the replicas of the previous node's ranks); returns that step."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        full = sorted(int(folder.name[5:]) for folder in map(Path, glob.glob(str(node_folder / "*" / "step_*")))
                      if len(list(folder.glob("rank_*.pt"))) == 2 and len(list(folder.glob("replica_of_rank_*.pt"))) == 2)
        newer = [s for s in full if s > step]
        if newer:
            assert newer[-1] < step + SHARED_INTERVAL, f"the job saved shared step {step + SHARED_INTERVAL} first: raise SHARED_INTERVAL"
            return newer[-1]
        info = cluster.job(job_id)
        assert info.state == "RUNNING", f"job {job_id} {info.state} too early\n{job_logs(run_dir, job_id)}"
        assert time.monotonic() < deadline, f"no local step after {step} in {node_folder}\n{job_logs(run_dir, job_id)}"
        time.sleep(0.1)


def test_a_killed_node_is_replaced_by_the_spare_in_the_job_without_requeue(spare_node_run: SpareRun):
    run = spare_node_run
    assert run.state == "COMPLETED 0:0", f"{run.state}\n{job_logs(run.run_dir, run.job_id)}"
    assert len(run.allocation) == JOB_NODES + 1 and run.requeues == 0, (run.allocation, run.requeues)
    spare = run.allocation[JOB_NODES]
    # The second step ran on the first node and the spare, not on the killed node.
    runs = placements(run.run_dir)
    assert len(runs) == 2, f"expected two steps (one restart), got {len(runs)}"
    assert {p.node for p in runs[0]} == set(run.allocation[:JOB_NODES])
    assert {p.node for p in runs[1]} == {run.allocation[0], spare} and sorted(p.rank for p in runs[1]) == [0, 1, 2, 3]
    assert f"excluding node(s) {run.killed} for the rest of the job" in run.main_log, run.main_log
    events = [json.loads(line) for line in (run.run_dir / "resilience.jsonl").read_text().splitlines()]
    excluded = [e for e in events if e["event"] == "exclude"]
    assert [(e["node"], e["action"]) for e in excluded] == [(run.killed, "restart on a spare")], events
    assert excluded[0]["cause"].startswith("node lost")
    rank0 = (run.run_dir / "logs" / "rank_0.log").read_text()
    # The restart resumed from the node-local tier, newer than the shared checkpoint: the killed
    # node's ranks got their states from the replicas their peers (rank + 2) kept on the other node.
    resumed = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+): the node-local tier", rank0)]
    assert len(resumed) == 1 and run.killed_after < run.local_step <= resumed[0] < run.killed_after + SHARED_INTERVAL, (
        resumed, run.killed_after, run.local_step)
    lost_ranks = sorted(p.rank for p in runs[0] if p.node == run.killed)
    resumed_event = [e for e in events if e["event"] == "resumed"]
    assert [(e["step"], e["tier"], e["from_replica"]) for e in resumed_event] == [(resumed[0], "local", lost_ranks)], events
    first_nodes, second_nodes = ({p.rank: p.node for p in placed} for placed in runs)
    for rank in lost_ranks:  # the replica is on the node its peer ran on (wherever the restart put the ranks)
        log = (run.run_dir / "logs" / f"rank_{rank}.log").read_text()
        holder = re.search(r"this rank's state: the replica on the node of rank (\d+)", log)
        assert holder, log[-3000:]
        assert second_nodes[int(holder[1])] == first_nodes[(rank + 2) % 4] != run.killed, (rank, holder[1], runs)
    assert "each rank's state replicated to rank + 2" in rank0
    # Every step trained; the steps trained twice (after the local save, before the kill) give the same loss.
    rows = read_metrics(run.run_dir)
    assert sorted({r["step"] for r in rows}) == list(range(1, STEPS + 1))
    seen: Dict[int, float] = {}
    for r in rows:
        assert abs(seen.setdefault(r["step"], r["loss"]) - r["loss"]) <= 1e-6, (r, seen[r["step"]])
    restarted = [r for r in rows if "resilience/restarts" in r]
    assert [r["resilience/restarts"] for r in restarted] == [1.0], restarted
    assert [r["resilience/restored_from_local"] for r in restarted] == [1.0], restarted
    print(f"spare-node job: {run.setup_s} s from submission to the end")
