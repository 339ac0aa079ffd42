"""In-job restarts, recorded: <run_dir>/resilience.jsonl, the restart decision and the metrics after one.

Torch-free: the executor's side (`train` for a local run, the SLURM batch script through
`python -m launcher.runtime.resilience decide`) reads the failure bundle of the attempt that
just ended, decides whether to start the ranks again and writes one event; the ranks of the next
attempt read that event back and report what the restart cost (`resilience/*` metrics on their
first logged step). One JSON object per line in resilience.jsonl:

    {"time": ..., "event": "failure", "node": "n2", "rank": 1, "cause": {...}, "action": "restart", "restart": 1}
    {"time": ..., "event": "resumed", "node": "n1", "rank": 0, "step": 8, "lost_steps": 2, "restart": 1}

A failure that repeats identically after a restart (same kind, same error text, same last step)
is a bug in the run, not a fault of the machine: restarting again would fail the same way, so
the decision is to stop, and the log says "repeating failure".
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)

RESILIENCE_FILE = "resilience.jsonl"
# Failure kinds whose repetition at the same step proves a bug (a hang's or a lost rank's does not).
DETERMINISTIC_KINDS = ("exception", "oom")

RESTART, STOP_REPEATING, STOP_EXHAUSTED = "restart", "stop: repeating failure", "stop: max_restarts reached"
STOP_NODE_LOST = "stop: node lost"


def _now() -> Dict[str, Any]:
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "unix_time": round(time.time(), 3)}


def append_event(run_dir: Path, event: Dict[str, Any]) -> Dict[str, Any]:
    """Append one event (with its time) to resilience.jsonl; returns what was written."""
    record = {**_now(), **event}
    with open(Path(run_dir) / RESILIENCE_FILE, "a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
    return record


def read_events(run_dir: Path) -> List[Dict[str, Any]]:
    """Every event of the run so far (a torn last line, from a crash while writing it, is skipped)."""
    path = Path(run_dir) / RESILIENCE_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def _last_logged_step(run_dir: Path) -> Optional[int]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return max(steps) if steps else None


def failure_cause(run_dir: Path, exit_code: int, attempt_started: Optional[float] = None) -> Dict[str, Any]:
    """What ended the attempt: the failure bundle's summary (launcher/runtime/failure.py) when a
    rank wrote one, else what the executor saw (a rank killed by a signal writes nothing).

    A summary older than `attempt_started` (unix time) is an earlier launch's, left in the run
    directory: not this attempt's cause.
    """
    summary_path = Path(run_dir) / "failure" / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
        if attempt_started is not None and summary_path.stat().st_mtime < attempt_started - 1.0:
            summary = None
    except (OSError, ValueError):
        summary = None
    if summary is None:
        return {"what": "exit", "error": f"the ranks ended with exit code {exit_code} and wrote no failure summary "
                                         f"(a rank killed by a signal, or its node lost)",
                "rank": None, "node": None, "last_step": _last_logged_step(run_dir), "exit_code": exit_code}
    return {"what": summary.get("what"), "error": summary.get("error"), "rank": summary.get("rank"),
            "node": summary.get("host"), "last_step": summary.get("last_step"),
            "failure_unix_time": summary.get("unix_time"), "exit_code": exit_code}


def signature(cause: Dict[str, Any]) -> Optional[tuple]:
    """What makes two failures "the same": kind, error text and step, for deterministic kinds only.

    Numbers in the text do not count: the summary names whichever rank failed first, and ranks
    word the same error with their own numbers (each rank's token id, shard offset or byte count),
    so which rank won the race must not turn a repeating bug into "a new failure".
    """
    if cause.get("what") not in DETERMINISTIC_KINDS or not cause.get("error"):
        return None
    return cause["what"], re.sub(r"\d+", "#", str(cause["error"])), cause.get("last_step")


@dataclass
class Decision:
    action: str  # RESTART, STOP_REPEATING or STOP_EXHAUSTED
    message: str
    event: Dict[str, Any]

    @property
    def restart(self) -> bool:
        return self.action == RESTART


def _set_failure_aside(run_dir: Path, restart: int) -> None:
    """failure/* -> failure/before_restart_<n>/: the next attempt's bundle starts empty (its first
    writer names its own cause), and the evidence of this one is kept."""
    folder = Path(run_dir) / "failure"
    if not folder.is_dir():
        return
    aside = folder / f"before_restart_{restart}"
    aside.mkdir(exist_ok=True)
    for path in folder.iterdir():
        if path.is_file():
            shutil.move(str(path), aside / path.name)


def decide(run_dir: Path, restarts_done: int, max_restarts: int, exit_code: int,
           attempt_started: Optional[float] = None, lost_nodes: Optional[List[str]] = None) -> Decision:
    """After a failed attempt: restart (the ranks resume from the newest checkpoint) or stop.

    `lost_nodes`: nodes of the allocation the scheduler no longer hears from; a new attempt would
    include them (no spare nodes yet), so the job is not restarted in place.
    Writes the failure event to resilience.jsonl and, on a restart, sets the failure bundle aside.
    """
    cause = failure_cause(run_dir, exit_code, attempt_started)
    if lost_nodes:
        cause["lost_nodes"] = list(lost_nodes)
    previous = [e for e in read_events(run_dir) if e.get("event") == "failure"]
    same = signature(cause) is not None and previous and signature(previous[-1].get("cause", {})) == signature(cause)
    where = f"rank {cause.get('rank')} on {cause.get('node')}" if cause.get("rank") is not None else "no rank named"
    what = f"{cause.get('what')} ({where}, last step {cause.get('last_step')}): {cause.get('error')}"
    if lost_nodes:
        action = STOP_NODE_LOST
        message = (f"the ranks failed: {what}; SLURM no longer hears from {' '.join(lost_nodes)}: not restarting "
                   f"in the job (a new step would include it; spare nodes are not built yet). "
                   f"cluster.requeue_on_failure=true requeues the job onto live nodes.")
    elif same:
        action = STOP_REPEATING
        message = (f"repeating failure: the same {what} happened again at the same step after a restart. "
                   f"This is a bug in the run, not a fault of a node: not restarting. Fix the cause "
                   f"(failure/summary.json and its traceback), then run again to resume from the newest checkpoint.")
    elif restarts_done >= max_restarts:
        action = STOP_EXHAUSTED
        message = (f"the ranks failed: {what}; not restarting: cluster.max_restarts={max_restarts} "
                   f"{'reached' if max_restarts else '(in-job restarts off)'}.")
    else:
        action = RESTART
        message = (f"the ranks failed: {what}; restarting them (restart {restarts_done + 1} of "
                   f"{max_restarts}), they resume from the newest checkpoint.")
    event = append_event(run_dir, {
        "event": "failure", "node": cause.get("node"), "rank": cause.get("rank"), "cause": cause,
        "action": action, "restart": restarts_done + 1 if action == RESTART else restarts_done,
    })
    if action == RESTART:
        _set_failure_aside(run_dir, restarts_done + 1)
    return Decision(action, message, event)


class RestartReport:
    """On the ranks of a restarted attempt: what the restart cost, once, on the first logged step.

    `resilience/restarts` (in-job restarts so far), `resilience/lost_steps` (steps done before the
    failure that the resumed checkpoint did not hold) and `resilience/downtime_s` (from the
    failure to the end of the first step after the restart).
    """

    def __init__(self, run_dir: Path, restarts: int, rank: int, node: str):
        self.run_dir = Path(run_dir)
        self.restarts = restarts
        self.rank = rank
        self.node = node
        failures = [e for e in read_events(run_dir) if e.get("event") == "failure"] if restarts else []
        self.failure = failures[-1] if failures else None
        self.resumed_step = 0
        self._done = self.failure is None

    def resumed_at(self, step: int) -> None:
        """The step the checkpoint this attempt resumed from holds (0: started from scratch); after
        a restart rank 0 records the "resumed" event (the downtime is known only after a step)."""
        self.resumed_step = step
        if self._done or self.rank != 0:
            return
        append_event(self.run_dir, {"event": "resumed", "node": self.node, "rank": self.rank, "step": step,
                                    "lost_steps": self.lost_steps(), "restart": self.restarts})

    def lost_steps(self) -> int:
        """Steps finished before the failure that the resumed checkpoint does not hold (trained again)."""
        last_step = (self.failure or {}).get("cause", {}).get("last_step")
        return max(0, int(last_step) - self.resumed_step) if last_step is not None else 0

    def metrics(self) -> Dict[str, float]:
        """The resilience/* metrics for the first logged step after a restart ({} otherwise)."""
        if self._done:
            return {}
        self._done = True
        cause = self.failure.get("cause", {})
        failed_at = cause.get("failure_unix_time") or self.failure.get("unix_time") or time.time()
        return {"resilience/restarts": float(self.restarts), "resilience/lost_steps": float(self.lost_steps()),
                "resilience/downtime_s": round(max(0.0, time.time() - float(failed_at)), 3)}


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m launcher.runtime.resilience decide ...`: the batch script's restart decision.

    Exit 0: restart; 1: stop (the reason is printed). Prints one line for the job's log.
    """
    parser = argparse.ArgumentParser(description="restart decision after a failed attempt of the ranks")
    parser.add_argument("command", choices=["decide"])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--restarts-done", required=True, type=int)
    parser.add_argument("--max-restarts", required=True, type=int)
    parser.add_argument("--exit-code", required=True, type=int)
    parser.add_argument("--attempt-started", type=float, default=None,
                        help="unix time the failed attempt started (an older failure summary is not its cause)")
    parser.add_argument("--lost-nodes", default="",
                        help="space-separated nodes the scheduler no longer hears from (no restart in the job)")
    args = parser.parse_args(argv)
    decision = decide(args.run_dir, args.restarts_done, args.max_restarts, args.exit_code, args.attempt_started,
                      args.lost_nodes.split())
    print(f"launcher: {'error: ' if not decision.restart else ''}{decision.message}", flush=True)
    return 0 if decision.restart else 1


if __name__ == "__main__":
    sys.exit(main())
