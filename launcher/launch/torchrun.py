"""The one place that builds the torch elastic launcher (torchrun) command line.

Every option used here exists in the torch floor's torchrun (bench/reference/torchrun_flags/,
held by tests/test_torch_compat.py), except those a `TorchCapabilities` says the ranks' torch has.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.compat import TorchCapabilities, floor_capabilities

SHUTDOWN_TIMEOUT = "torchrun_shutdown_timeout"  # the capability name in launcher/compat.py


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
    capabilities: Optional[TorchCapabilities] = None,
) -> List[str]:
    """argv that starts `nproc_per_node` ranks of the rank runtime for `run_dir`.

    Standalone (one node, loopback rendezvous) unless `rdzv_endpoint` is given or
    `rdzv_from_env` is set; then every node joins a c10d rendezvous at `host:port`. With
    `rdzv_from_env` the endpoint and id are left to PET_RDZV_ENDPOINT / PET_RDZV_ID, which a
    job script exports once it knows its first node and job id. `shutdown_timeout_s` (> 0) is
    how long torchrun waits after forwarding SIGTERM before it SIGKILLs the ranks (its own
    default is 30 s, shorter than a large checkpoint's save): the plan's `checkpoint.shutdown_timeout_s`,
    passed as an option only when `capabilities` (the ranks' torch; default: the floor's) has it
    (see `torchrun_env` for the other case).
    """
    caps = capabilities or floor_capabilities()
    with_timeout = shutdown_timeout_s > 0 and caps.has(SHUTDOWN_TIMEOUT)
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
        *([f"--shutdown-timeout={int(shutdown_timeout_s)}"] if with_timeout else []),
        "-m",
        "launcher.runtime.entry",
        "--run-dir",
        str(run_dir),
    ]
    return argv


def shutdown_timeout_of(plan: Any) -> int:
    """The plan's torchrun shutdown timeout in seconds (0: torchrun's default, for an old plan.json)."""
    return int((getattr(plan, "checkpoint", None) or {}).get("shutdown_timeout_s", 0))


def torchrun_env(shutdown_timeout_s: int, capabilities: Optional[TorchCapabilities] = None) -> Dict[str, str]:
    """Environment for torchrun when the option could not be passed: a torchrun that has
    --shutdown-timeout also reads it from PET_SHUTDOWN_TIMEOUT, and one without ignores the variable.
    Empty when the option is on the command line (or there is no timeout)."""
    caps = capabilities or floor_capabilities()
    if shutdown_timeout_s <= 0 or caps.has(SHUTDOWN_TIMEOUT):
        return {}
    return {"PET_SHUTDOWN_TIMEOUT": str(int(shutdown_timeout_s))}
