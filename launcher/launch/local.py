"""Run all ranks on this machine through torch's elastic launcher on loopback."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
from pathlib import Path
from typing import Mapping, Optional

from launcher.config.schema import JobConfig
from launcher.launch.torchrun import shutdown_timeout_of, torchrun_argv
from launcher.plan.plan import Plan
from launcher.runtime.checkpoint_folder import CheckpointDirInUse, checkpoint_dir_holder, checkpoint_root
from launcher.runtime.watchdog import flight_recorder_env
from launcher.runtime.stop_control import STOPPED_FILE, StopSignals, control_dir

log = logging.getLogger(__name__)

# Signals that ask a local run to stop gracefully (checkpoint, then exit): what `kill`,
# a closed terminal or a process supervisor sends to `train`.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU while NVIDIA's driver is loaded


def visible_gpu_count(gpus_dir: Path = NVIDIA_GPUS) -> int:
    """The NVIDIA GPUs the ranks would see, without importing torch (the host side stays light):
    the driver's GPU folders, narrowed by CUDA_VISIBLE_DEVICES when it is set."""
    try:
        present = sum(1 for _ in Path(gpus_dir).iterdir())
    except OSError:  # no driver: no GPU
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    # CUDA stops at the first invalid entry ("-1" hides every GPU).
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, present)


def rank_environment(run_dir: Path, device: str, extra: Optional[Mapping[str, str]] = None) -> dict:
    """Environment for the ranks: caches and scratch folders inside the run dir where sensible.

    `extra` (cluster.env) is applied last: a variable the user set explicitly wins.
    """
    env = dict(os.environ)
    scratch = Path(run_dir) / ".tmp"
    scratch.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(scratch)  # torchrun leaves torchelastic_* folders in $TMPDIR
    env.setdefault("WANDB_DIR", str(run_dir))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "launcher" / "inductor"))
    if device == "cpu":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env["PYTHONUNBUFFERED"] = "1"
    # torchrun sets 1 when unset, with a banner on every start; the same value, said by us, is quiet.
    env.setdefault("OMP_NUM_THREADS", "1")
    for name, value in flight_recorder_env().items():  # the hang watchdog's collective record
        env.setdefault(name, value)
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    return env


class StopForwarder(StopSignals):
    """While installed, SIGTERM / SIGHUP to `train` become one graceful stop of the job.

    torchrun and the ranks run in sessions of their own, so a signal to `train` alone would
    leave them training as orphans. The first signal is sent on to torchrun as SIGTERM
    (SIGHUP too: the ranks checkpoint on SIGTERM, while SIGHUP would kill them); torchrun
    forwards it to every rank and waits --shutdown-timeout for their save. Repeats are the
    same request and are not forwarded again (each would restart torchrun's shutdown).
    """

    def __init__(self, torchrun_pid: int):
        super().__init__(STOP_SIGNALS)
        self.pid = torchrun_pid

    def on_stop_signal(self, name: str) -> None:
        log.warning("received %s: asking the ranks to checkpoint and stop", name)
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:  # torchrun already ended
            pass


def stopped_step(run_dir: Path) -> Optional[dict]:
    """The ranks' record of a graceful stop in this run ({"step", "reason"}), if any."""
    path = control_dir(run_dir) / STOPPED_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop_when_train_dies() -> None:
    """In torchrun's process, before it starts: the kernel sends it SIGTERM when `train` dies,
    even by SIGKILL. torchrun runs in a session of its own (so a terminal's signals reach it only
    through `train`), and without this a killed `train` would leave the ranks training as orphans
    that hold the devices and the checkpoint folder's lock; with it they checkpoint and stop, as on
    any SIGTERM. Not available off Linux: there the ranks outlive a killed `train`."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def launch_local(spec: JobConfig, plan: Plan, run_dir: Path) -> int:
    """Start cluster.gpus_per_node ranks; returns the exit code (non-zero if any rank failed).

    Raises CheckpointDirInUse, before starting anything, when another job holds the checkpoint folder.

    torchrun runs in its own process group: Ctrl-C here is passed on to it (it stops every
    rank), and if the ranks do not end within 30 s the whole group is killed, ranks included.
    SIGTERM / SIGHUP ask for a graceful stop (StopForwarder); a run whose ranks checkpointed
    and stopped returns 0. torchrun tears down all ranks when one fails.
    """
    if spec.checkpoint.enabled:
        # Refuse before any rank starts (the ranks' own lock is the real guard).
        refusal = checkpoint_dir_holder(checkpoint_root(spec.checkpoint.dir, run_dir))
        if refusal:
            raise CheckpointDirInUse(refusal)
    for stale in ("stop", "stopped"):  # a stop request of an earlier run in this run dir
        (control_dir(run_dir) / stale).unlink(missing_ok=True)
    argv = torchrun_argv(run_dir, nproc_per_node=spec.cluster.gpus_per_node,
                         shutdown_timeout_s=shutdown_timeout_of(plan))
    env = rank_environment(run_dir, spec.trainer.device, spec.cluster.env)
    log.info("starting %d local ranks: %s", spec.cluster.gpus_per_node, " ".join(argv))
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_stop_when_train_dies)
    forwarder = StopForwarder(proc.pid).install()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        log.warning("interrupted: stopping all ranks")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()
    finally:
        forwarder.uninstall()
    return stop_outcome(run_dir, code)


def stop_outcome(run_dir: Path, code: int) -> int:
    """0 when the ranks checkpointed and stopped (torchrun exits non-zero after a SIGTERM)."""
    stopped = stopped_step(run_dir)
    if stopped is None:
        return code
    if code != 0:
        log.info("torchrun exited with %d after the ranks had stopped cleanly", code)
    log.warning("the ranks checkpointed and stopped at step %s (%s); run the same command to resume",
                stopped.get("step"), stopped.get("reason"))
    return 0
