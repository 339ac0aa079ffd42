"""The local executor's rules for `cluster.*` (cluster=local: the ranks run on this machine)."""

from __future__ import annotations

from typing import List

from launcher.config.schema import ClusterConfig


def local_key_problems(cluster: ClusterConfig, action: str) -> List[str]:
    """Refuse what only a job script would use, and secrets written as values."""
    problems: List[str] = []
    if action == "run" and cluster.nodes != 1:
        problems.append(
            f"cluster=local runs on this machine only, but cluster.nodes={cluster.nodes}. "
            f"Fix: cluster.nodes=1, or cluster=slurm for several nodes."
        )
    if cluster.spare_nodes:
        problems.append(
            f"cluster.spare_nodes={cluster.spare_nodes}, but cluster=local runs on this machine only: there are no "
            f"nodes to allocate as spares. Fix: cluster.spare_nodes=0, or cluster=slurm."
        )
    if cluster.setup:
        problems.append(
            f"cluster.setup has {len(cluster.setup)} line(s) but cluster=local runs no job script to put them in. "
            f"Fix: run them in your shell before `train` (or set variables with cluster.env), and remove cluster.setup."
        )
    for name in cluster.env:
        if name in cluster.secret_env:
            problems.append(
                f"cluster.env.{name} would write a secret's value into the run dir (config.yaml); remove it and "
                f"`export {name}=...` in the shell that runs `train` (the ranks inherit it)."
            )
    return problems
