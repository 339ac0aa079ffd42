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


def cluster_key_problems(cluster: ClusterConfig, action: str) -> List[str]:
    """The problems of the chosen executor's keys (an unknown cluster.name is the validator's own rule)."""
    check = KEY_CHECKS.get(cluster.name)
    return check(cluster, action) if check else []
