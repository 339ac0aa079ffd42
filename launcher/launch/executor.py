"""Executors: how a planned job gets its ranks started, behind one small protocol.

`train` validates and plans, writes the run directory, then hands the job to the executor that
`cluster.name` names. An executor:
- declares its own `cluster.*` keys (a dataclass base of schema.ClusterConfig) and their checks
  (launcher/config/executors.py, so the validator needs nothing from this layer);
- `launch`es the job: runs the ranks here and waits (local), or renders a job script and submits
  it (slurm); it returns the exit code `train` ends with;
- runs `action=prepare` (tokenizing a corpus on CPUs) the same way: here, or as a one-node job;
- gives its processes an environment from which launcher/job_env.py reads the facts the runtime
  needs (job id, node name, restart count), so the runtime never reads a scheduler's variables.
docs/executors.md says how a Kubernetes or cloud batch executor plugs in.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, Protocol

from launcher.config.schema import JobConfig
from launcher.data.prepare import PrepareError, report_failure, run_prepare
from launcher.launch.eval_submit import run_local_eval_jobs
from launcher.launch.local import launch_local
from launcher.launch.prepare_job import submit_prepare
from launcher.launch.slurm import submit
from launcher.plan.present.plan import Plan
from launcher.checkpoint.folder import CheckpointDirInUse

EXIT_INVALID_INPUT = 2  # as an invalid configuration: the input is what is wrong
EXIT_CHECKPOINT_DIR_IN_USE = 3


class Executor(Protocol):
    name: str

    def launch(self, spec: JobConfig, plan: Plan, run_dir: Path) -> int:
        """Start the job of this plan in `run_dir` (written: config.yaml, plan.json); the exit code."""

    def prepare(self, spec: JobConfig, run_dir: Path) -> int:
        """Run action=prepare (prepare.*, checked) for `run_dir`; the exit code."""


class LocalExecutor:
    """cluster=local: cluster.gpus_per_node ranks on this machine through torchrun; waits for them."""

    name = "local"

    def launch(self, spec: JobConfig, plan: Plan, run_dir: Path) -> int:
        try:
            code = launch_local(spec, plan, run_dir)
        except CheckpointDirInUse as err:
            sys.stderr.write(f"{err}\n")
            return EXIT_CHECKPOINT_DIR_IN_USE
        if code != 0:
            sys.stderr.write(f"training failed (exit code {code}); rank logs: {run_dir / 'logs'}\n")
        if spec.action == "run":
            # eval.job: the due checkpoints' evaluation jobs, here, now that training is done; their
            # outcome goes to eval.jsonl and never changes training's exit code
            run_local_eval_jobs(spec, run_dir)
        return code

    def prepare(self, spec: JobConfig, run_dir: Path) -> int:
        try:
            run_prepare(spec.prepare)
        except PrepareError as err:
            report_failure(err.problems)
            return EXIT_INVALID_INPUT
        return 0


class SlurmExecutor:
    """cluster=slurm: renders slurm/sbatch.sh.j2 (or cluster.template) and submits it with sbatch."""

    name = "slurm"

    def launch(self, spec: JobConfig, plan: Plan, run_dir: Path) -> int:
        return submit(spec, plan, run_dir)

    def prepare(self, spec: JobConfig, run_dir: Path) -> int:
        """A one-node CPU job from slurm/prepare.sh.j2 (launcher/launch/prepare_job.py)."""
        return submit_prepare(spec, run_dir)


EXECUTORS: Dict[str, Executor] = {executor.name: executor for executor in (LocalExecutor(), SlurmExecutor())}


def executor_for(name: str) -> Executor:
    """The executor registered as cluster.name=`name` (the validator has refused any other name)."""
    try:
        return EXECUTORS[name]
    except KeyError:
        raise ValueError(f"cluster.name={name!r} is not one of {', '.join(EXECUTORS)}. "
                         f"Fix: cluster=local or cluster=slurm.") from None
