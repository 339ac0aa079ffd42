"""The config side of the executors: each `cluster.name` and the checks of its `cluster.*` keys.

The executors themselves (render, launch or submit) live in launcher/launch/executor.py, above
the config layer; the validator needs only their key checks, registered here under the same
names (tests/test_executors.py keeps the two registries equal).
"""

from __future__ import annotations

from typing import Callable, Dict, List

from launcher.config.local_keys import local_key_problems
from launcher.config.schema import ClusterConfig
from launcher.config.slurm_keys import slurm_key_problems

# cluster.name -> every problem of its cluster.* keys for this action.
KEY_CHECKS: Dict[str, Callable[[ClusterConfig, str], List[str]]] = {
    "local": local_key_problems,
    "slurm": lambda cluster, action: slurm_key_problems(cluster),
}

EXECUTOR_NAMES = tuple(KEY_CHECKS)


def common_key_problems(cluster: ClusterConfig) -> List[str]:
    """The problems of the keys every executor reads (schema.ClusterKeys) that no other rule checks."""
    problems: List[str] = []
    if cluster.max_restarts < 0:
        problems.append(
            f"cluster.max_restarts={cluster.max_restarts} must be >= 0 (in-job restarts after a failure; "
            f"0: a failure ends the run). Fix: e.g. cluster.max_restarts=3, or cluster.max_restarts=0."
        )
    return problems


def cluster_key_problems(cluster: ClusterConfig, action: str) -> List[str]:
    """The problems of the common keys and of the chosen executor's own (an unknown cluster.name
    is the validator's own rule)."""
    check = KEY_CHECKS.get(cluster.name)
    return common_key_problems(cluster) + (check(cluster, action) if check else [])
