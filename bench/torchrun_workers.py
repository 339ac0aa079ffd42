"""The launch shared by the bench scripts that time the launcher inside torchrun workers.

The calling script is started again as N local ranks with ``--worker --out FILE`` followed by its
own arguments; rank 0 writes its result there as JSON. Everything the workers write (W&B, temp
files, run dirs) stays in one temporary folder removed afterwards.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Sequence

REPO = Path(__file__).resolve().parents[1]


def run_workers(script: str, ranks: int, argv: Sequence[str], prefix: str) -> Dict[str, Any]:
    """Run ``script`` as ``ranks`` torchrun workers with ``argv`` and return rank 0's JSON result.

    A failed launch prints the tail of the workers' output and exits with their exit code."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(Path(script).resolve()), "--worker", "--out", str(out), *argv]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   WANDB_DIR=tmp, WANDB_SILENT="true", TMPDIR=tmp)
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(proc.returncode or 1)
        return json.loads(out.read_text())


def end_worker() -> None:
    """A worker whose result is written leaves the process group and then the process, without
    the interpreter's teardown of torch (about 0.8 s of CPU per process)."""
    from launcher.runtime.dist import exit_after_shutdown

    exit_after_shutdown(0)
