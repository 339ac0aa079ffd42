"""Run all ranks on this machine through torch's elastic launcher on loopback."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from launcher.config.schema import JobConfig
from launcher.job_env import IN_JOB_RESTARTS_ENV
from launcher.launch.torchrun import shutdown_timeout_of, torchrun_argv
from launcher.plan.present.plan import Plan
from launcher.checkpoint.folder import CheckpointDirInUse, checkpoint_dir_holder, checkpoint_root
from launcher.resilience.restarts import decide
from launcher.resilience.failure import FAILURE_DIR, SUMMARY_FILE
from launcher.resilience.watchdog import HANG_EXIT_CODE, REPORT_GRACE_S, flight_recorder_env
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
    and stopped returns 0. torchrun tears down all ranks when one fails; then, while
    cluster.max_restarts allows and the failure is not a repeat of the last one, the ranks are
    started again and resume from the newest checkpoint (launcher/resilience/restarts.py).
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
    restarts = 0
    while True:
        env[IN_JOB_RESTARTS_ENV] = str(restarts)
        log.info("starting %d local ranks%s: %s", spec.cluster.gpus_per_node,
                 f" (restart {restarts})" if restarts else "", " ".join(argv))
        started = time.time()
        code, asked_to_stop = _run_once(argv, env, run_dir)
        outcome = stop_outcome(run_dir, code)
        # A stop asked for (signal, Ctrl-C) or a clean end is never restarted.
        if outcome == 0 or asked_to_stop:
            return outcome
        decision = decide(run_dir, restarts, spec.cluster.max_restarts, code, attempt_started=started)
        (log.warning if decision.restart else log.error)("%s", decision.message)
        if not decision.restart:
            return code
        restarts += 1


def _run_once(argv: List[str], env: Dict[str, str], run_dir: Path) -> Tuple[int, bool]:
    """One torchrun with its ranks, to its end: (exit code, whether a stop or Ctrl-C was asked for)."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_stop_when_train_dies)
    forwarder = StopForwarder(proc.pid).install()
    try:
        return _wait_ending_hangs(proc, run_dir), forwarder.first_signal is not None
    except KeyboardInterrupt:
        log.warning("interrupted: stopping all ranks")
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(timeout=30), True
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(), True
    finally:
        forwarder.uninstall()


# After the hang watchdog's evidence, how long the ranks' own way out (launcher/resilience/watchdog.py)
# may take before the executor ends the attempt: from the first rank's stacks, rank 0's wait for
# the others' reports plus their wait for its summary; from rank 0's hang summary, the exits.
HANG_EXIT_GRACE_S = REPORT_GRACE_S + 45.0
HANG_SUMMARY_GRACE_S = 15.0


def _hang_summary_written(failure: Path, since: float) -> bool:
    path = failure / SUMMARY_FILE
    try:
        return path.stat().st_mtime >= since - 1.0 and json.loads(path.read_text()).get("what") == "hang"
    except (OSError, ValueError):
        return False


def _wait_ending_hangs(proc: subprocess.Popen, run_dir: Path, poll_s: float = 1.0) -> int:
    """proc.wait(), except after a hang: a rank frozen for good (SIGSTOP, a stuck driver call in
    the kernel) cannot take torchrun's SIGTERM, and torchrun would wait its whole --shutdown-timeout
    (the plan's save time) before its SIGKILL. Once the watchdog has fired and its grace passed,
    the attempt is ended here, ranks included, so a restart (or the exit) comes without that wait."""
    started = time.time()
    failure = Path(run_dir) / FAILURE_DIR
    stacks_seen: Optional[float] = None
    summary_seen: Optional[float] = None
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if stacks_seen is None and any(p.stat().st_mtime >= started - 1.0 for p in failure.glob("stacks_rank_*.txt")):
            stacks_seen = now
        if stacks_seen is not None and summary_seen is None and _hang_summary_written(failure, started):
            summary_seen = now
        if (summary_seen is not None and now - summary_seen > HANG_SUMMARY_GRACE_S) or (
                stacks_seen is not None and now - stacks_seen > HANG_EXIT_GRACE_S):
            log.error("the hang watchdog fired %.0f s ago and torchrun still waits for its ranks (one is frozen "
                      "and cannot take SIGTERM): killing torchrun and the ranks", now - stacks_seen)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return HANG_EXIT_CODE


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
