"""The SLURM executor's `cluster.*` keys (schema.SlurmKeys): the checks that need no launcher,
only the config, so that the validator (config/) does not import the launch layer above it.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import List

from launcher.config.schema import ClusterConfig

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB_ID = re.compile(r"^[0-9]+(_[0-9]+)?$")
_JOB_NAME_BAD = re.compile(r"[^A-Za-z0-9._-]+")


class SlurmConfigError(ValueError):
    """cluster.* values that cannot become a valid sbatch script; one line per problem."""

    def __init__(self, problems: List[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


def sanitize_job_name(name: str, fallback: str = "train") -> str:
    """A job name made of [A-Za-z0-9._-] only, at most 64 characters (squeue-friendly)."""
    clean = re.sub(r"-{2,}", "-", _JOB_NAME_BAD.sub("-", name)).strip("-.")[:64].strip("-.")
    return clean or fallback


# --- validation ---------------------------------------------------------------------------

# The actions that submit a job with sbatch (unless cluster.dry_run): plan, search and rehearse never do.
SUBMITTING_ACTIONS = ("run", "export", "prepare")


def sbatch_problems(cluster: ClusterConfig, action: str) -> List[str]:
    """A job that would call `sbatch` on a machine without one on PATH: the recipes of large
    models set cluster=slurm, and a user trying one on a workstation must hear it before anything
    is written. Checked where `train` checks a job before launching it (launcher/cli.py), not in
    the config rules, which also check jobs for other machines (a sweep, the search)."""
    if cluster.name != "slurm" or action not in SUBMITTING_ACTIONS or cluster.dry_run or shutil.which("sbatch"):
        return []
    return [f"cluster=slurm submits the job with sbatch, which is not on PATH here (not a SLURM login node); "
            f"the recipes of large models set cluster=slurm. Fix: cluster=local to run on this machine "
            f"(cluster.gpus_per_node = its GPUs), cluster.dry_run=true to see the job script, or run `train` "
            f"on a SLURM login node (with cluster.partition=... and data.path=... where the recipe needs them)."]


def slurm_key_problems(cluster: ClusterConfig) -> List[str]:
    """Every problem in the SLURM keys, each naming the key, the value and a fix.

    Cross-field rules of the whole job live in launcher/config/validate.py; these are the
    ones only the SLURM launcher needs, checked before anything is written or submitted.
    """
    problems: List[str] = []
    if cluster.nodes < 1:
        problems.append(f"cluster.nodes={cluster.nodes}: need at least 1 node; set cluster.nodes=1 or more")
    if cluster.gpus_per_node < 1:
        problems.append(
            f"cluster.gpus_per_node={cluster.gpus_per_node}: need at least 1 rank per node "
            "(on a CPU cluster it is the number of ranks per node); set cluster.gpus_per_node=1 or more"
        )
    if cluster.spare_nodes < 0:
        problems.append(
            f"cluster.spare_nodes={cluster.spare_nodes}: must be >= 0 (extra nodes allocated to replace a failed one). "
            f"Fix: cluster.spare_nodes=0 for none, or e.g. cluster.spare_nodes=1."
        )
    elif cluster.spare_nodes and cluster.spare_nodes >= cluster.nodes >= 1:
        problems.append(
            f"cluster.spare_nodes={cluster.spare_nodes} >= cluster.nodes={cluster.nodes}: the job would allocate "
            f"{cluster.nodes + cluster.spare_nodes} nodes and leave at least half of them idle for spares. "
            f"Fix: cluster.spare_nodes={max(0, cluster.nodes - 1)} or fewer, or raise cluster.nodes."
        )
    if cluster.max_requeues < 0:
        problems.append(f"cluster.max_requeues={cluster.max_requeues}: must be >= 0 (0 disables requeueing)")
    if cluster.signal_seconds < 0:
        problems.append(
            f"cluster.signal_seconds={cluster.signal_seconds}: must be >= 0 (0 asks for no warning signal)"
        )
    if cluster.cpus_per_task < 0:
        problems.append(f"cluster.cpus_per_task={cluster.cpus_per_task}: must be >= 0 (0 leaves it to SLURM)")
    for name in cluster.env:
        if not _ENV_NAME.match(str(name)):
            problems.append(
                f"cluster.env key {name!r} is not a valid environment variable name; "
                "use letters, digits and _ (not starting with a digit)"
            )
        if name in cluster.secret_env:
            problems.append(
                f"cluster.env.{name} would write a secret's value into the job script; remove it and "
                f"`export {name}=...` in the shell that runs `train` (cluster.secret_env forwards it by name)"
            )
    for name in cluster.secret_env:
        if not _ENV_NAME.match(str(name)):
            problems.append(f"cluster.secret_env entry {name!r} is not a valid environment variable name")
    for i, job in enumerate(cluster.after):
        if not _JOB_ID.match(str(job).strip()):
            problems.append(
                f"cluster.after[{i}]={job!r} is not a SLURM job id; use numeric ids, e.g. cluster.after=[12345]"
            )
    for i, arg in enumerate(cluster.sbatch_args):
        text = str(arg)
        if not text.startswith("-"):
            problems.append(
                f"cluster.sbatch_args[{i}]={text!r} is not an sbatch option; write one option per entry, "
                "e.g. '--reservation=big'"
            )
        if "\n" in text or "\r" in text:
            problems.append(f"cluster.sbatch_args[{i}] contains a newline; write one option per entry")
    for key in ("partition", "account", "qos", "time", "constraint", "mem", "job_name", "container"):
        value = str(getattr(cluster, key))
        if "\n" in value or "\r" in value:
            problems.append(f"cluster.{key} contains a newline: {value!r}")
    if not 0 <= cluster.rdzv_port <= 65535:
        problems.append(
            f"cluster.rdzv_port={cluster.rdzv_port}: must be a TCP port (1-65535), "
            "or 0 to derive one from the job id"
        )
    if cluster.template:
        path = Path(cluster.template).expanduser()
        if not path.is_file():
            problems.append(
                f"cluster.template={cluster.template!r}: no such file (looked at {path.resolve()}); "
                "give the path of a Jinja2 sbatch template, or leave it empty for the built-in one"
            )
    return problems
