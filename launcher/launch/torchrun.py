"""The one place that builds the torch elastic launcher (torchrun) command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional


def torchrun_argv(
    run_dir: Path,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: str = "launcher",
    python: str = "",
    max_restarts: int = 0,
) -> List[str]:
    """argv that starts `nproc_per_node` ranks of the rank runtime for `run_dir`.

    With rdzv_endpoint=None the launcher runs standalone (one node, loopback rendezvous);
    otherwise every node joins a c10d rendezvous at `host:port`.
    """
    argv = [python or sys.executable, "-m", "torch.distributed.run"]
    if rdzv_endpoint is None:
        argv += ["--standalone", "--nnodes=1"]
    else:
        argv += [
            f"--nnodes={nnodes}",
            "--rdzv_backend=c10d",
            f"--rdzv_endpoint={rdzv_endpoint}",
            f"--rdzv_id={rdzv_id}",
        ]
    argv += [
        f"--nproc_per_node={nproc_per_node}",
        f"--max_restarts={max_restarts}",
        "-m",
        "launcher.runtime.entry",
        "--run-dir",
        str(run_dir),
    ]
    return argv
