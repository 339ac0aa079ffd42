"""What a rank (or the host) knows about the job its executor started, in executor-neutral terms.

The runtime asks `job_facts()`, never an executor's own variables: the job id that names the
holder of a checkpoint folder, the node a failure happened on, how often the job was restarted.
Each executor contributes one reader of the environment it gives its processes (SLURM's below);
a new executor (Kubernetes, a cloud batch service) adds its reader to ENV_READERS, and the rest
of the runtime is unchanged. docs/executors.md says what else an executor provides.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple


# How many in-job restarts of the ranks came before this attempt: every executor that restarts
# the ranks inside its job (launcher/launch/local.py, slurm/sbatch.sh.j2) sets it.
IN_JOB_RESTARTS_ENV = "LAUNCHER_RESTART"


def _in_job_restarts(env: Mapping[str, str]) -> int:
    return int(env.get(IN_JOB_RESTARTS_ENV) or 0)


@dataclass(frozen=True)
class JobFacts:
    executor: str  # the cluster.name that started this process: local | slurm | ...
    job_id: Optional[str]  # the scheduler's job id (None for a local run)
    node_name: str  # the node as the scheduler names it (dev-cluster nodes can share one hostname)
    restart_count: int  # how often the scheduler restarted (requeued) this job
    in_job_restarts: int = 0  # how often the executor restarted the ranks inside this job run


def _slurm_facts(env: Mapping[str, str]) -> Optional[JobFacts]:
    """SLURM sets SLURM_JOB_ID in the batch script and every step; SLURMD_NODENAME per node."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    return JobFacts("slurm", job_id, env.get("SLURMD_NODENAME") or socket.gethostname(),
                    int(env.get("SLURM_RESTART_COUNT") or 0), _in_job_restarts(env))


ENV_READERS: Tuple[Callable[[Mapping[str, str]], Optional[JobFacts]], ...] = (_slurm_facts,)


def job_facts(env: Optional[Mapping[str, str]] = None) -> JobFacts:
    """The facts of the job this process belongs to (a local run when no executor claims it)."""
    env = os.environ if env is None else env
    for read in ENV_READERS:
        facts = read(env)
        if facts is not None:
            return facts
    return JobFacts("local", None, socket.gethostname(), 0, _in_job_restarts(env))
