"""The development SLURM cluster for tests: started once per session by slurm/dev-cluster.sh.

Every SLURM test runs on the same cluster of NODES (4) nodes, n1..n4, on this one host
(`slurm/dev-cluster.sh up --nodes 4`): single-node jobs take one of them, multi-node jobs
JOB_NODES (2). Four, not two, so that the node-death test can resume a 2-node job on nodes that
did not die: a node brought back at once would receive SLURM's queued terminate request for
the job that ran there, and kill that job's rerun (docs/slurm.md).

Import the fixture into a test module (`from slurm_cluster import slurm_cluster`). It brings
the cluster up (installing the Debian packages on a fresh machine) and fails the test, never
skips it, when that is impossible. The cluster is left running at the end (another pytest
session may be using it; `up` is instant the next time); `slurm/dev-cluster.sh down` stops it.

There is no accounting daemon on the dev cluster, so job state is read with
`scontrol show job` (finished jobs stay visible for an hour: MinJobAge=3600).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List

import pytest

from launcher.paths import slurm_dir

DEV_CLUSTER = slurm_dir() / "dev-cluster.sh"
NODES = 4  # nodes of the cluster every SLURM test uses
JOB_NODES = 2  # nodes of the multi-node jobs
UP_TIMEOUT_S = 500  # a fresh machine installs the packages first (about 15 s, more on a slow mirror)
FINAL_STATES = {
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
}


def _dev_cluster(command: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess:
    argv = ["bash", str(DEV_CLUSTER), command] + (["--nodes", str(NODES)] if command == "up" else [])
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def dev_cluster_up() -> subprocess.CompletedProcess:
    """`slurm/dev-cluster.sh up --nodes NODES`: instant when up; restarts a killed node's slurmd."""
    return _dev_cluster("up")


def _conf_path() -> str:
    out = _dev_cluster("env", timeout=30).stdout  # "export SLURM_CONF=/path"
    return out.strip().split("=", 1)[1].strip("'\"")


@dataclass
class JobInfo:
    job_id: str
    state: str
    exit_code: str  # "rc:signal"
    restarts: int
    fields: Dict[str, str]

    @property
    def rc(self) -> int:
        return int(self.exit_code.split(":")[0])


class SlurmCluster:
    """Helpers over the real cluster's client commands."""

    def __init__(self, conf: str):
        self.conf = conf

    def run(self, argv: List[str], timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def job(self, job_id: str) -> JobInfo:
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", out))
        return JobInfo(
            job_id=str(job_id),
            state=fields.get("JobState", "?"),
            exit_code=fields.get("ExitCode", "0:0"),
            restarts=int(fields.get("Restarts", "0") or 0),
            fields=fields,
        )

    def job_ids(self, name: str = "") -> List[str]:
        """Ids of all jobs squeue still shows (any state), optionally only those named `name`."""
        argv = ["squeue", "-h", "-t", "all", "-o", "%i %j"]
        rows = [line.split(None, 1) for line in self.run(argv).stdout.splitlines() if line.strip()]
        return [r[0] for r in rows if not name or (len(r) > 1 and r[1] == name)]

    def wait(self, job_id: str, timeout: float, states: Iterable[str] = FINAL_STATES, poll: float = 0.5) -> JobInfo:
        """Wait until the job reaches one of `states`; fail with its last state and logs if not."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        info = self.job(job_id)
        while info.state not in wanted:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} still {info.state} after {timeout:.0f} s (waiting for {sorted(wanted)}); "
                    f"reason={info.fields.get('Reason')}; stdout={info.fields.get('StdOut')}"
                )
            time.sleep(poll)
            info = self.job(job_id)
        return info

    def sbatch_wrap(self, command: str, *extra: str) -> str:
        out = self.run(["sbatch", "--parsable", *extra, "--wrap", command]).stdout
        return out.strip().split(";")[0]


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    t0 = time.monotonic()
    proc = _dev_cluster("up")
    if proc.returncode != 0:
        pytest.fail(
            f"slurm/dev-cluster.sh up failed ({proc.returncode}) after {time.monotonic() - t0:.0f} s:\n"
            f"{proc.stdout}\n{proc.stderr}"
        )
    conf = _conf_path()
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf  # clients (and `train` subprocesses) find this cluster
    yield SlurmCluster(conf)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
