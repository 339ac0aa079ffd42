"""The one place that builds the torch elastic launcher (torchrun) command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional


def torchrun_argv(
    run_dir: Path,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: str = "launcher",
    rdzv_from_env: bool = False,
    python: str = "",
    max_restarts: int = 0,
    shutdown_timeout_s: int = 0,
) -> List[str]:
    """argv that starts `nproc_per_node` ranks of the rank runtime for `run_dir`.

    Standalone (one node, loopback rendezvous) unless `rdzv_endpoint` is given or
    `rdzv_from_env` is set; then every node joins a c10d rendezvous at `host:port`. With
    `rdzv_from_env` the endpoint and id are left to PET_RDZV_ENDPOINT / PET_RDZV_ID, which a
    job script exports once it knows its first node and job id. `shutdown_timeout_s` (> 0) is
    how long torchrun waits after forwarding SIGTERM before it SIGKILLs the ranks (its own
    default is 30 s, shorter than a large checkpoint's save): the plan's `checkpoint.shutdown_timeout_s`.
    """
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if rdzv_endpoint is None and not rdzv_from_env:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [f"--nnodes={nnodes}", "--rdzv_backend=c10d"]
        if not rdzv_from_env:
            argv += [f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id}"]
    argv += [
        f"--nproc_per_node={nproc_per_node}",
        f"--max_restarts={max_restarts}",
        *([f"--shutdown-timeout={int(shutdown_timeout_s)}"] if shutdown_timeout_s > 0 else []),
        "-m",
        "launcher.runtime.entry",
        "--run-dir",
        str(run_dir),
    ]
    return argv


def shutdown_timeout_of(plan: Any) -> int:
    """The plan's torchrun shutdown timeout in seconds (0: torchrun's default, for an old plan.json)."""
    return int((getattr(plan, "checkpoint", None) or {}).get("shutdown_timeout_s", 0))
