"""The failure bundle: whatever ends a run abnormally leaves <run_dir>/failure/summary.json.

One JSON file says what happened (exception, hang, oom, signal), when, on which rank and
host, the last completed step and the last good checkpoint, and points at the evidence in
the same folder (per-rank Python stacks, flight-recorder traces, memory snapshots,
tracebacks). The process that writes it prints one line naming it, and W&B gets the same
dict as its `failure` summary (rank 0 only: the other ranks have no W&B run).

The first writer wins: a failing rank often takes its peers down with it (torchrun tears
the job down, collectives error out), and the later reports are consequences, not causes.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from launcher.job_env import job_facts

log = logging.getLogger(__name__)

FAILURE_DIR = "failure"
SUMMARY_FILE = "summary.json"


def failure_dir(run_dir: Path) -> Path:
    """<run_dir>/failure (created)."""
    path = Path(run_dir) / FAILURE_DIR
    path.mkdir(parents=True, exist_ok=True)
    return path


def host_name() -> str:
    """This node's name as the scheduler knows it (several nodes can share `hostname` on a dev cluster)."""
    return job_facts().node_name


@dataclass
class RunProgress:
    """What the loop has achieved so far on this rank: read when something goes wrong."""

    last_step: int = 0
    last_checkpoint: Optional[str] = None
    phase: str = "startup"


class StopWithoutCheckpoint(RuntimeError):
    """A stop was requested but checkpoints are off: the run ends with an error (nothing to resume).
    Raised by the trainer (launcher/runtime/trainer.py); a summary names it `signal`."""


class NodeBlamed(RuntimeError):
    """Every rank ends its attempt because a check named ranks' nodes as unfit: the pre-flight
    health probe (kind "health", launcher/resilience/preflight.py) or a straggler over
    trainer.straggler_factor (kind "straggler", launcher/resilience/stragglers.py). `named`: one
    {rank, host, why} per rank; the summary's blamed_hosts is what the restart decision excludes."""

    def __init__(self, kind: str, named: List[Dict[str, Any]], message: str):
        super().__init__(message)
        self.kind = kind
        self.named = named


class NonFiniteSteps(RuntimeError):
    """trainer.max_skipped_steps steps in a row had a non-finite gradient norm
    (launcher/runtime/numerics.py): every rank raises it at the same step; the summary (kind
    "nonfinite") names the step, the ranks whose own loss was not finite (all ranks when none
    was) and the first parameter whose gradient was not."""

    def __init__(self, step: int, ranks: List[int], first_nonfinite: Optional[str], consecutive: int):
        super().__init__(
            f"{consecutive} steps in a row up to step {step} had a non-finite gradient norm and were skipped "
            f"(rank(s) {ranks}, first non-finite gradient: {first_nonfinite}). Fix: look at the data of those steps "
            f"and the learning rate; trainer.max_skipped_steps sets how many skips in a row end the run (0: never).")
        self.step = step
        self.ranks = ranks
        self.first_nonfinite = first_nonfinite
        self.consecutive = consecutive


class LossSpike(RuntimeError):
    """trainer.on_spike=rewind: a logged loss was a spike (launcher/runtime/numerics.py). Every
    rank raises it at the same step (the logged loss is the global batch's); the summary (kind
    "spike") carries what the restart decision (launcher/resilience/restarts.py) needs to rewind:
    the first step of the logging window that spiked (`onset_step`), how many global batches to
    skip (None: those from the checkpoint through the spike) and the run's rewind budget."""

    def __init__(self, step: int, onset_step: int, loss: float, zscore: float, skip_batches: Optional[int],
                 max_rewinds: int):
        super().__init__(
            f"loss spike at step {step}: {loss:.4f} is {zscore:.1f} standard deviations over the window's mean; "
            f"trainer.on_spike=rewind: resuming from the newest checkpoint before step {onset_step} and skipping "
            f"the batches up to the spike.")
        self.step = step
        self.onset_step = onset_step
        self.skip_batches = skip_batches
        self.max_rewinds = max_rewinds


def _attempt() -> List[Any]:
    """Which run of the ranks this is: the scheduler's job id and requeue count, the in-job restart."""
    facts = job_facts()
    return [facts.job_id, facts.restart_count, facts.in_job_restarts]


def classify(err: BaseException) -> str:
    """The `what` of a summary for an exception: oom, signal (a stop that could not save), a
    NodeBlamed's kind (health, straggler), nonfinite (NonFiniteSteps), spike (LossSpike) or exception."""
    import torch  # lazy: the host imports this module (launch/local.py reads the summary) and stays torch-free

    if isinstance(err, NodeBlamed):
        return err.kind
    if isinstance(err, NonFiniteSteps):
        return "nonfinite"
    if isinstance(err, LossSpike):
        return "spike"
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
        return "oom"
    if isinstance(err, StopWithoutCheckpoint):
        return "signal"
    return "exception"


@dataclass
class FailureBundle:
    """Writes the failure folder for one rank; `publish` callbacks (rank 0: W&B) get the summary."""

    run_dir: Path
    rank: int
    world_size: int
    progress: RunProgress = field(default_factory=RunProgress)
    publishers: List[Callable[[Dict[str, Any]], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _recorded: bool = False

    @property
    def folder(self) -> Path:
        return failure_dir(self.run_dir)

    def base_summary(self, what: str) -> Dict[str, Any]:
        """The fields every summary has."""
        return {
            "what": what,
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "unix_time": round(time.time(), 3),  # the start of an in-job restart's downtime (restarts.py)
            "rank": self.rank,
            "host": host_name(),
            "world_size": self.world_size,
            "last_step": self.progress.last_step,
            "last_checkpoint": self.progress.last_checkpoint,
            "phase": self.progress.phase,
            "attempt": _attempt(),
        }

    def evidence(self) -> Dict[str, List[str]]:
        """Paths (relative to the run dir) of what the failure folder holds, by kind."""
        kinds = {"stacks": ("stacks_rank_",), "traces": ("fr_trace_rank_",),
                 "snapshots": ("memory_snapshot_rank_", "memory_prediction_rank_"),
                 "tracebacks": ("traceback_rank_",), "reports": ("rank_",)}
        out: Dict[str, List[str]] = {k: [] for k in kinds}
        for path in sorted(self.folder.iterdir()):
            for kind, prefixes in kinds.items():
                if path.name.startswith(prefixes):
                    out[kind].append(str(path.relative_to(self.run_dir)))
                    break
        return out

    def write_summary(self, summary: Dict[str, Any], overwrite: bool = False) -> Optional[Path]:
        """Write summary.json unless one exists (the first failure is the cause); announce it.

        Returns the path, or None when another rank's summary was there first.
        """
        path = self.folder / SUMMARY_FILE
        summary = dict(summary, files=self.evidence())
        with self._lock:
            tmp = path.with_name(f".summary.rank{self.rank}.tmp")
            tmp.write_text(json.dumps(summary, indent=1, default=str))
            if overwrite:
                tmp.replace(path)
            else:
                try:
                    os.link(tmp, path)  # atomic "create if absent" on a shared file system
                except FileExistsError:
                    earlier = self._read(path)
                    if earlier is not None and earlier.get("attempt") != summary.get("attempt"):
                        # A requeued job's earlier run left it (an in-job restart sets it aside): stale,
                        # and keeping it would hide this attempt's cause from the restart decision.
                        tmp.replace(path)
                        return self._announce(path, summary)
                    tmp.unlink(missing_ok=True)
                    # Another rank failed first (the cause): W&B, which only rank 0 has, gets that summary.
                    self._publish(self._read(path))
                    return None
                tmp.unlink(missing_ok=True)
        return self._announce(path, summary)

    def _announce(self, path: Path, summary: Dict[str, Any]) -> Path:
        where = f"rank {summary.get('rank')} on {summary.get('host')}"
        sys.stderr.write(f"[rank{self.rank}] run failed ({summary['what']}, {where}, last step "
                         f"{summary.get('last_step')}): see {path}\n")
        sys.stderr.flush()
        self._publish(summary)
        return path

    @staticmethod
    def _read(path: Path) -> Optional[Dict[str, Any]]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def _publish(self, summary: Optional[Dict[str, Any]]) -> None:
        if summary is None:
            return
        for publish in self.publishers:
            try:
                publish(summary)
            except Exception as err:  # noqa: BLE001 - reporting must never mask the failure
                log.warning("could not publish the failure summary: %s", err)

    def record_exception(self, err: BaseException, traceback_text: str) -> Optional[Path]:
        """An exception is ending this rank: its traceback to failure/, then the summary (once per rank)."""
        if self._recorded:
            return None
        self._recorded = True
        tb = self.folder / f"traceback_rank_{self.rank}.txt"
        tb.write_text(traceback_text)
        what = classify(err)
        summary = self.base_summary(what)
        summary["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        summary["failed_ranks"] = [self.rank]
        if isinstance(err, NodeBlamed):
            # Every rank raises the same verdict: the summary names the unfit rank, not the writer.
            first = err.named[0]
            summary.update(rank=first["rank"], host=first["host"], failed_ranks=[n["rank"] for n in err.named],
                           blamed_hosts=sorted({n["host"] for n in err.named}), named=err.named)
        if isinstance(err, NonFiniteSteps):
            # Every rank raises the same verdict: the summary names the ranks the numbers point at.
            summary.update(step=err.step, rank=err.ranks[0], failed_ranks=err.ranks,
                           first_nonfinite=err.first_nonfinite, skipped_in_a_row=err.consecutive)
        if isinstance(err, LossSpike):  # every rank sees the same global loss: no rank to blame
            summary.update(step=err.step, rewind={"spike_step": err.step, "onset_step": err.onset_step,
                                                  "skip_batches": err.skip_batches, "max_rewinds": err.max_rewinds})
        return self.write_summary(summary)
