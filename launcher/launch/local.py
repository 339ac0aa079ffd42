"""Run all ranks on this machine through torch's elastic launcher on loopback."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from launcher import PROCESS_STARTED
from launcher.compat import TorchCapabilities, ranks_capabilities
from launcher.config.schema import JobConfig
from launcher.job_env import IN_JOB_RESTARTS_ENV
from launcher.launch.torchrun import SHUTDOWN_TIMEOUT, shutdown_timeout_of, torchrun_argv
from launcher.plan.present.plan import Plan
from launcher.checkpoint.folder import CheckpointDirInUse, checkpoint_dir_holder, checkpoint_root
from launcher.observe.goodput import LAUNCH_TIME_ENV, finish_run
from launcher.resilience.restarts import decide
from launcher.resilience.failure import FAILURE_DIR, SUMMARY_FILE
from launcher.resilience.watchdog import HANG_EXIT_CODE, REPORT_GRACE_S, flight_recorder_env
from launcher.runtime.stop_control import STOP_FILE, STOPPED_FILE, StopSignals, control_dir

log = logging.getLogger(__name__)

# Signals that ask a local run to stop gracefully (checkpoint, then exit): Ctrl-C, what `kill`,
# a closed terminal or a process supervisor sends to `train`. A second Ctrl-C stops at once.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# What torchrun waits after forwarding a signal before it SIGKILLs the ranks when it has no
# --shutdown-timeout (torch < 2.12; launcher/compat.py).
TORCHRUN_DEFAULT_SHUTDOWN_S = 30
# `train`'s exit code when a second Ctrl-C (or a stop the ranks did not honour) ended the ranks
# at once: the shell's code for an interrupt (128 + SIGINT). A graceful stop exits 0.
INTERRUPTED_EXIT_CODE = 130


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
    """While installed, Ctrl-C, SIGTERM and SIGHUP to `train` become one graceful stop of the job.

    torchrun and the ranks run in sessions of their own (a terminal's Ctrl-C reaches `train`
    alone), so `train` asks the ranks itself: it writes <run dir>/control/stop with the reason,
    and every rank finishes its step, saves a checkpoint and exits 0 (runtime/signals.py), so
    torchrun ends cleanly, with no signal and no traceback. That works on every torch, with or
    without torchrun's --shutdown-timeout. Only if the ranks are still running once the plan's
    predicted stop time (`grace_s`) has passed is torchrun sent SIGTERM, and SIGKILL follows
    after torchrun's own wait (`term_grace_s`). A repeated SIGTERM or SIGHUP is the same
    request; a second Ctrl-C stops at once (the last good checkpoint stays; a save in flight is
    left as an .incomplete folder, which resume skips).
    """

    def __init__(self, torchrun_pid: int, run_dir: Path, grace_s: float, term_grace_s: float):
        super().__init__(STOP_SIGNALS)
        self.pid = torchrun_pid
        self.run_dir = Path(run_dir)
        self.grace_s = grace_s
        self.term_grace_s = term_grace_s
        self.asked_at: Optional[float] = None
        self.terminated_at: Optional[float] = None
        self.abort = False

    def on_stop_signal(self, name: str) -> None:
        self.asked_at = time.monotonic()
        request_stop(self.run_dir, f"{name} to train")
        print(f"{name}: the ranks finish their step, save a checkpoint and stop"
              f"{' (Ctrl-C again stops at once)' if name == 'SIGINT' else ''}", file=sys.stderr, flush=True)

    def on_repeat(self, name: str) -> None:
        if name != "SIGINT":
            super().on_repeat(name)
            return
        print("SIGINT again: stopping at once (the last complete checkpoint is kept)", file=sys.stderr, flush=True)
        self.abort = True
        kill_job(self.pid)

    def escalate(self) -> None:
        """Called while waiting: SIGTERM to torchrun once the grace is over, SIGKILL after its own wait."""
        if self.asked_at is None or self.abort:
            return
        now = time.monotonic()
        if self.terminated_at is None and now - self.asked_at > self.grace_s:
            log.warning("the ranks have not stopped %.0f s after the stop request (the plan predicted less): "
                        "sending SIGTERM to torchrun", now - self.asked_at)
            self.terminated_at = now
            _signal_group(self.pid, signal.SIGTERM)
        elif self.terminated_at is not None and now - self.terminated_at > self.term_grace_s + 10:
            log.error("torchrun and the ranks are still running %.0f s after SIGTERM: killing them", now - self.terminated_at)
            self.abort = True
            kill_job(self.pid)


def request_stop(run_dir: Path, reason: str) -> None:
    """Ask the ranks of this run dir to checkpoint and stop at the end of a step (control/stop)."""
    path = control_dir(run_dir) / STOP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(reason + "\n")


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:  # already ended
        pass


def _children(pid: int) -> List[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere or once it ended)."""
    found: List[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return found


def kill_job(torchrun_pid: int) -> None:
    """SIGKILL torchrun's group and its ranks (each rank runs in a session of its own)."""
    ranks = _children(torchrun_pid)
    _signal_group(torchrun_pid, signal.SIGKILL)
    for pid in ranks:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
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

    torchrun and the ranks run in sessions of their own. Ctrl-C, SIGTERM and SIGHUP ask for a
    graceful stop (StopForwarder: every rank saves and exits; a second Ctrl-C stops at once); a run
    whose ranks checkpointed and stopped returns 0. torchrun tears down all ranks when one fails;
    then, while cluster.max_restarts allows and the failure is not a repeat of the last one, the
    ranks are started again and resume from the newest checkpoint (launcher/resilience/restarts.py).
    """
    if spec.checkpoint.enabled:
        # Refuse before any rank starts (the ranks' own lock is the real guard).
        refusal = checkpoint_dir_holder(checkpoint_root(spec.checkpoint.dir, run_dir))
        if refusal:
            raise CheckpointDirInUse(refusal)
    for stale in (STOP_FILE, STOPPED_FILE):  # a stop request of an earlier run in this run dir
        (control_dir(run_dir) / stale).unlink(missing_ok=True)
    caps = ranks_capabilities()  # the ranks run this interpreter
    shutdown_s = shutdown_timeout_of(plan)
    argv = local_torchrun_argv(spec, plan, run_dir, caps)
    env = rank_environment(run_dir, spec.trainer.device, spec.cluster.env)
    env[LAUNCH_TIME_ENV] = repr(PROCESS_STARTED)  # goodput: this launch began when `train` started
    try:
        return _launch_attempts(spec, argv, env, run_dir, shutdown_s, caps)
    finally:
        try:
            line = finish_run(run_dir)
        except OSError as err:  # an accounting that cannot be written must not change the exit
            line = f"goodput: not written ({err})"
        if line:
            log.info("%s", line)


def _launch_attempts(spec: JobConfig, argv: List[str], env: Dict[str, str], run_dir: Path, shutdown_s: int,
                     caps: TorchCapabilities) -> int:
    """Start the ranks, and again after each failure the restart decision restarts; the exit code."""
    restarts = 0
    while True:
        env[IN_JOB_RESTARTS_ENV] = str(restarts)
        log.info("starting %d local ranks%s: %s", spec.cluster.gpus_per_node,
                 f" (restart {restarts})" if restarts else "", " ".join(argv))
        started = time.time()
        code, asked_to_stop = _run_once(argv, env, run_dir, stop_grace_s(shutdown_s), caps)
        outcome = stop_outcome(run_dir, code)
        # A stop asked for (signal, Ctrl-C) or a clean end is never restarted.
        if outcome == 0 or asked_to_stop:
            return outcome
        decision = decide(run_dir, restarts, spec.cluster.max_restarts, code, attempt_started=started)
        (log.warning if decision.restart else log.error)("%s", decision.message)
        if not decision.restart:
            return code
        restarts += 1


def local_torchrun_argv(spec: JobConfig, plan: Plan, run_dir: Path, caps: TorchCapabilities) -> List[str]:
    """torchrun for the local ranks: one node, loopback rendezvous, this interpreter."""
    return torchrun_argv(run_dir, nproc_per_node=spec.cluster.gpus_per_node,
                         shutdown_timeout_s=shutdown_timeout_of(plan), capabilities=caps)


def stop_grace_s(shutdown_timeout_s: int) -> float:
    """How long `train` lets the ranks finish a step and save after a stop request before it
    signals torchrun: the plan's stop time (torchrun's --shutdown-timeout where it has one)."""
    return float(max(shutdown_timeout_s, TORCHRUN_DEFAULT_SHUTDOWN_S))


def _run_once(argv: List[str], env: Dict[str, str], run_dir: Path, grace_s: float,
              caps: TorchCapabilities) -> Tuple[int, bool]:
    """One torchrun with its ranks, to its end: (exit code, whether a stop or Ctrl-C was asked for)."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=_stop_when_train_dies)
    # After SIGTERM torchrun waits its --shutdown-timeout (the grace) where it has the option, else 30 s.
    term_grace_s = grace_s if caps.has(SHUTDOWN_TIMEOUT) else float(TORCHRUN_DEFAULT_SHUTDOWN_S)
    forwarder = StopForwarder(proc.pid, run_dir, grace_s, term_grace_s).install()
    try:
        code = _wait_ending_hangs(proc, run_dir, forwarder)
    finally:
        forwarder.uninstall()
    return (INTERRUPTED_EXIT_CODE if forwarder.abort else code), forwarder.first_signal is not None


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


def _wait_ending_hangs(proc: subprocess.Popen, run_dir: Path, forwarder: StopForwarder, poll_s: float = 1.0) -> int:
    """proc.wait(), except after a hang: a rank frozen for good (SIGSTOP, a stuck driver call in
    the kernel) cannot take torchrun's SIGTERM, and torchrun would wait its whole --shutdown-timeout
    (the plan's save time) before its SIGKILL. Once the watchdog has fired and its grace passed,
    the attempt is ended here, ranks included, so a restart (or the exit) comes without that wait.
    Meanwhile the forwarder escalates a stop request the ranks did not honour in time."""
    started = time.time()
    failure = Path(run_dir) / FAILURE_DIR
    stacks_seen: Optional[float] = None
    summary_seen: Optional[float] = None
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        forwarder.escalate()
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
    """0 when the ranks checkpointed and stopped (whatever torchrun's own exit code)."""
    stopped = stopped_step(run_dir)
    if stopped is None:
        return code
    if code != 0:
        log.info("torchrun exited with %d after the ranks had stopped cleanly", code)
    log.warning("the ranks checkpointed and stopped at step %s (%s); resume with: %s",
                stopped.get("step"), stopped.get("reason"), resume_command())
    return 0


def resume_command(argv: Optional[List[str]] = None) -> str:
    """The command that resumes this run: this `train` command as it was typed, less any
    checkpoint.resume= (none would start over again, an older PATH go back to it; the default auto
    resumes). The run's checkpoints are in a folder named after the run, not after the time of
    the command (launcher/checkpoint/run_folder.py), so the same command finds them."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if not a.lstrip("+~").startswith("checkpoint.resume=")]
    return " ".join(shlex.quote(a) for a in ["train", *args])
