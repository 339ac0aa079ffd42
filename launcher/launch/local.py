"""Run all ranks on this machine through torch's elastic launcher on loopback."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

from launcher.config.schema import JobConfig
from launcher.launch.torchrun import torchrun_argv
from launcher.plan.plan import Plan
from launcher.runtime.signals import control_dir

log = logging.getLogger(__name__)


def rank_environment(run_dir: Path, device: str) -> dict:
    """Environment for the ranks: caches and scratch folders inside the run dir where sensible."""
    env = dict(os.environ)
    scratch = Path(run_dir) / ".tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(scratch)  # torchrun leaves torchelastic_* folders in $TMPDIR
    env.setdefault("WANDB_DIR", str(run_dir))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "launcher" / "inductor"))
    if device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch_local(spec: JobConfig, plan: Plan, run_dir: Path) -> int:
    """Start cluster.gpus_per_node ranks; returns the exit code (non-zero if any rank failed).

    torchrun runs in its own process group: Ctrl-C here is passed on to it (it stops every
    rank), and if the ranks do not end within 30 s the whole group is killed, ranks included.
    torchrun tears down all ranks when one fails.
    """
    for stale in ("stop", "stopped"):  # a stop request of an earlier run in this run dir
        (control_dir(run_dir) / stale).unlink(missing_ok=True)
    argv = torchrun_argv(run_dir, nproc_per_node=spec.cluster.gpus_per_node)
    env = rank_environment(run_dir, spec.trainer.device)
    log.info("starting %d local ranks: %s", spec.cluster.gpus_per_node, " ".join(argv))
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        log.warning("interrupted: stopping all ranks")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
