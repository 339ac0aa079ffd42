"""Downtime and lost steps of a failure: in-job restart (with and without the node-local tier) vs requeue-and-resume, on the dev SLURM cluster, in one run.

    SLURM_CONF=... .venv/bin/python bench/restart_time.py [--steps 24] [--timeout 600]

Submits three identical 2-node x 1-rank debug jobs at once (a shared checkpoint every 4 steps, a
metrics row every step; tests/test_slurm_train.py's settings and helpers):

- in-job: `cluster.max_restarts=1` (the batch script starts a new srun step in the allocation);
- in-job+local: the same with the node-local tier, `checkpoint.local_dir=<out>/local
  checkpoint.local_interval=1` (each rank saves every step on its node and to its peer's);
- requeue: `cluster.max_restarts=0 cluster.requeue_on_failure=true` (the job goes back to the
  queue, SLURM starts it again, the ranks resume from the newest checkpoint).

In each, global rank 1 is SIGKILLed once the step-4 shared checkpoint exists and step 7 is logged:
three steps after the shared checkpoint, so the sides without the local tier lose 3 steps and the
local tier at most the step whose local save the kill interrupted. The downtime is from the kill
to the end of the first step the resumed ranks finish (the time rank 0 writes its metrics row);
the steps lost are the last step logged before the kill minus the step the resumed ranks start
from (rank 0's "resumed from" line). All include the pre-flight health check
(trainer.health_check=auto is on for 2 nodes). The last lines are `restart time ratio R`,
R = requeue downtime / in-job downtime, and the same for in-job+local. The dev cluster is shared
and left as it is (never `up` with other --nodes, never `down`); the jobs run to their end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
for path in (REPO, REPO / "tests"):  # run as a script from a checkout; the SLURM tests' helpers
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from slurm_cluster import JOB_NODES, SlurmCluster, _conf_path  # noqa: E402
from test_slurm_train import job_logs, rank_pid, submit_train  # noqa: E402

from launcher.resilience.restarts import read_json_lines  # noqa: E402

# Three steps after the step-4 shared checkpoint (and before the step-8 one): the steps the shared
# tier loses and the node-local tier (a save every step) keeps.
KILL_AFTER_STEP = 7
CHECKPOINT_STEP = 4


def _rows(run_dir: Path) -> List[dict]:
    return read_json_lines(run_dir / "metrics.jsonl")


def _resumes(run_dir: Path) -> List[int]:
    """The steps rank 0 resumed from so far (its log's "resumed from ... at step N" lines)."""
    log = run_dir / "logs" / "rank_0.log"
    return [int(m) for m in re.findall(r"resumed from \S+ at step (\d+)", log.read_text())] if log.exists() else []


def _resumed_tier(run_dir: Path) -> str:
    """Which tier rank 0's last resume used: "local" (the node-local tier's log line) or "shared"."""
    log = run_dir / "logs" / "rank_0.log"
    lines = re.findall(r"resumed from .*", log.read_text()) if log.exists() else []
    if not lines:
        return "none"
    return "local" if "the node-local tier" in lines[-1] else "shared"


def measure(cluster: SlurmCluster, jobs: Dict[str, str], dirs: Dict[str, Path], timeout: float) -> Dict[str, dict]:
    """Kill rank 1 of each job at the same point, then time until each finishes its first step after the resume.

    The resumed rank 0 rewrites metrics.jsonl from its checkpoint's step on (rows after it are
    dropped and written again), so the end is the row of step N+1 (N: the step it resumed from)
    in the file as modified after the resume was logged; its time is the file's modification time.
    """
    deadline = time.monotonic() + timeout
    killed: Dict[str, dict] = {}
    resumed: Dict[str, dict] = {}
    finished: Dict[str, dict] = {}
    while len(finished) < len(jobs):
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: killed {sorted(killed)}, finished {sorted(finished)}\n"
                             + "\n".join(job_logs(dirs[n], jobs[n]) for n in jobs))
        for name, job_id in jobs.items():
            run_dir = dirs[name]
            if name not in killed:
                rows = _rows(run_dir)
                state = cluster.job(job_id).state
                if state not in ("PENDING", "RUNNING"):
                    raise SystemExit(f"{name} job {job_id} {state} before the kill\n{job_logs(run_dir, job_id)}")
                if (run_dir / "checkpoints" / f"step_{CHECKPOINT_STEP:08d}").is_dir() and \
                        any(r["step"] >= KILL_AFTER_STEP for r in rows):
                    os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
                    killed[name] = {"at": time.time(), "last_step": max(r["step"] for r in _rows(run_dir)),
                                    "resumes": len(_resumes(run_dir))}
            elif name not in resumed:
                steps = _resumes(run_dir)
                if len(steps) > killed[name]["resumes"]:
                    resumed[name] = {"at": time.time(), "step": steps[-1]}
            elif name not in finished:
                path = run_dir / "metrics.jsonl"
                mtime = path.stat().st_mtime if path.exists() else 0.0
                if mtime > resumed[name]["at"] and any(r["step"] == resumed[name]["step"] + 1 for r in _rows(run_dir)):
                    finished[name] = {"at": mtime}
        time.sleep(0.1)
    out = {}
    for name in jobs:
        k, r = killed[name], resumed[name]
        out[name] = {"downtime_s": round(finished[name]["at"] - k["at"], 1),
                     "resume_logged_after_s": round(r["at"] - k["at"], 1), "last_step_before_kill": k["last_step"],
                     "resumed_from_step": r["step"], "steps_lost": k["last_step"] - r["step"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the jobs to be killed and resume")
    parser.add_argument("--out", type=Path, default=Path("/tmp/restart_time"))
    args = parser.parse_args(argv)
    os.environ["SLURM_CONF"] = _conf_path()
    cluster = SlurmCluster(os.environ["SLURM_CONF"])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    run = args.out / stamp
    dirs = {"in-job": run / "in_job" / "run", "in-job+local": run / "in_job_local" / "run",
            "requeue": run / "requeue" / "run"}
    local_dir = run / "local"  # the dev cluster's nodes share this machine's /tmp
    local_dir.mkdir(parents=True, exist_ok=True)
    common = [f"cluster.nodes={JOB_NODES}", "cluster.gpus_per_node=1", f"trainer.steps={args.steps}"]
    jobs = {"in-job": submit_train(dirs["in-job"], *common, "cluster.max_restarts=1"),
            "in-job+local": submit_train(dirs["in-job+local"], *common, "cluster.max_restarts=1",
                                         f"checkpoint.local_dir={local_dir}", "checkpoint.local_interval=1"),
            "requeue": submit_train(dirs["requeue"], *common, "cluster.max_restarts=0",
                                    "cluster.requeue_on_failure=true")}
    print(f"submitted {jobs} (run dirs under {run})", flush=True)
    results = measure(cluster, jobs, dirs, args.timeout)
    for name, job_id in jobs.items():
        info = cluster.wait(job_id, timeout=args.timeout)
        results[name].update(job_id=job_id, state=info.state, slurm_restarts=info.restarts,
                             tier=_resumed_tier(dirs[name]))
    print(f"{'side':<13} {'downtime':>9} {'last step':>9} {'resumed at':>10} {'lost':>5}  {'tier':<6} job")
    for name, r in results.items():
        print(f"{name:<13} {r['downtime_s']:>8.1f}s {r['last_step_before_kill']:>9} {r['resumed_from_step']:>10} "
              f"{r['steps_lost']:>5}  {r['tier']:<6} {r['job_id']} {r['state']} (SLURM restarts {r['slurm_restarts']})")
    print(json.dumps({"date": stamp, "host": platform.node(), "cpus": os.cpu_count(), "results": results}))
    for name in ("in-job", "in-job+local"):
        ratio = results["requeue"]["downtime_s"] / max(results[name]["downtime_s"], 1e-9)
        print(f"restart time ratio {ratio:.2f} (requeue / {name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
