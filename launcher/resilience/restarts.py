"""In-job restarts, recorded: <run_dir>/resilience.jsonl, the restart decision and the metrics after one.

Torch-free: the executor's side (`train` for a local run, the SLURM batch script through
`python -m launcher.resilience.restarts decide`) reads the failure bundle of the attempt that
just ended, decides whether to start the ranks again and writes one event; the ranks of the next
attempt read that event back and report what the restart cost (`resilience/*` metrics on their
first logged step). One JSON object per line in resilience.jsonl:

    {"time": ..., "event": "failure", "node": "n2", "rank": 1, "cause": {...}, "action": "restart", "restart": 1}
    {"time": ..., "event": "resumed", "node": "n1", "rank": 0, "step": 8, "lost_steps": 2, "restart": 1}
    {"time": ..., "event": "exclude", "node": "n2", "cause": "node lost: ...", "action": "restart on a spare"}
    {"time": ..., "event": "health", "node": "n1", "rank": 0, "ok": true, "ranks": [...], "named": []}

(the last written by rank 0 at each pre-flight health check, launcher/resilience/preflight.py). A
health check or a straggler that names a node (kind "health" / "straggler") restarts on a spare;
with none the decision stops ("stop: unfit node": in place the same node would fail again) and the
node goes to the requeue's ExcNodeList.

A failure that names a node (launcher/resilience/node_exclusion.py) excludes it for the rest of the job:
the next srun step runs on the healthy nodes, a spare (`cluster.spare_nodes`) taking its place;
without one the node goes to the requeue's `scontrol update ExcNodeList=`.

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
from typing import Any, Dict, List, Optional, Sequence

from launcher.resilience.node_exclusion import NODE_FAULT_KINDS, NodeOutcome, NodeSet, blamed_nodes, split_nodes

log = logging.getLogger(__name__)

RESILIENCE_FILE = "resilience.jsonl"
# Failure kinds whose repetition at the same step proves a bug (a hang's or a lost rank's does not);
# non-finite gradients again at the same step are the data's or the settings', not a flaky machine's.
DETERMINISTIC_KINDS = ("exception", "oom", "nonfinite")

RESTART, STOP_REPEATING, STOP_EXHAUSTED = "restart", "stop: repeating failure", "stop: max_restarts reached"
# trainer.on_spike=rewind (kind "spike"): start the ranks again from before the spike; a budget of
# its own (trainer.max_rewinds over the whole run), not cluster.max_restarts'.
REWIND, STOP_REWINDS = "rewind", "stop: max_rewinds reached"
STOP_NODE_LOST = "stop: node lost"
STOP_NODE_UNFIT = "stop: unfit node"
# What an "exclude" event did with the node.
EXCLUDE_RESTART, EXCLUDE_REQUEUE, EXCLUDE_NONE = "restart on a spare", "excluded from the requeued job", \
    "none: the job is not requeued"
# A node not responding: SLURM marks it DOWN and allocates it to nobody while down, and the batch
# script does not wait on such a job to set its ExcNodeList (slurm/sbatch.sh.j2 requeue_excluding).
EXCLUDE_DOWN = "none: not responding (DOWN, not allocated while down)"


def _now() -> Dict[str, Any]:
    return {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "unix_time": round(time.time(), 3)}


def append_event(run_dir: Path, event: Dict[str, Any]) -> Dict[str, Any]:
    """Append one event (with its time) to resilience.jsonl; returns what was written."""
    record = {**_now(), **event}
    with open(Path(run_dir) / RESILIENCE_FILE, "a") as handle:
        handle.write(json.dumps(record, default=str) + "\n")
    return record


def read_json_lines(path: Path) -> List[Dict[str, Any]]:
    """Every record of a JSON-lines file (resilience.jsonl, metrics.jsonl) written so far; a torn
    line, from a crash or a write in progress, is skipped. [] when the file does not exist."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def read_events(run_dir: Path) -> List[Dict[str, Any]]:
    """Every event of the run so far."""
    return read_json_lines(Path(run_dir) / RESILIENCE_FILE)


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
    """What ended the attempt: the failure bundle's summary (launcher/resilience/failure.py) when a
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
            "failure_unix_time": summary.get("unix_time"), "exit_code": exit_code,
            "hosts_not_arrived": summary.get("hosts_not_arrived"), "ranks_not_arrived": summary.get("ranks_not_arrived"),
            "blamed_hosts": summary.get("blamed_hosts"), "named": summary.get("named"),
            **({"rewind": summary["rewind"]} if summary.get("rewind") else {})}


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
    action: str  # RESTART, REWIND, STOP_REPEATING, STOP_EXHAUSTED, STOP_REWINDS, STOP_NODE_LOST or STOP_NODE_UNFIT
    message: str
    event: Dict[str, Any]
    nodes: Optional[NodeOutcome] = None  # with a NodeSet: the next step's nodes and the exclusions

    @property
    def restart(self) -> bool:
        return self.action in (RESTART, REWIND)


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
           attempt_started: Optional[float] = None, lost_nodes: Optional[List[str]] = None,
           nodes: Optional[NodeSet] = None, requeue: bool = False) -> Decision:
    """After a failed attempt: restart (the ranks resume from the newest checkpoint) or stop.

    `lost_nodes`: nodes of the allocation the scheduler no longer hears from. `nodes` (SLURM): the
    job's allocation, the nodes excluded so far and how many a step needs; a node the failure names
    (node_exclusion.blamed_nodes) is excluded and the restart runs on a spare, or, with no healthy
    spare, the job stops and the node is excluded from the requeued job (`requeue`: the batch
    script will requeue). Without `nodes` (a local run) a lost node stops the job.
    Writes the failure event (and one "exclude" event per newly excluded node) to resilience.jsonl
    and, on a restart, sets the failure bundle aside.
    """
    cause = failure_cause(run_dir, exit_code, attempt_started)
    lost_nodes = [n for n in (lost_nodes or []) if nodes is None or n not in nodes.excluded]
    if lost_nodes:
        cause["lost_nodes"] = list(lost_nodes)
    previous = [e for e in read_events(run_dir) if e.get("event") == "failure"]
    rewinds_before = sum(1 for e in previous if e.get("action") == REWIND)
    # This job's earlier restarts are the last `restarts_done` decisions that restarted; its
    # rewinds among them do not count against cluster.max_restarts.
    restarted = [e for e in previous if e.get("action") in (RESTART, REWIND)]
    faults_done = restarts_done - sum(1 for e in restarted[max(0, len(restarted) - restarts_done):] if e.get("action") == REWIND) \
        if restarts_done else 0
    rewind = cause.get("rewind") if cause.get("what") == "spike" and not lost_nodes else None
    # A lost node explains the failure whatever the survivors' errors say.
    same = (not lost_nodes and signature(cause) is not None and previous
            and signature(previous[-1].get("cause", {})) == signature(cause))
    where = f"rank {cause.get('rank')} on {cause.get('node')}" if cause.get("rank") is not None else "no rank named"
    what = f"{cause.get('what')} ({where}, last step {cause.get('last_step')}): {cause.get('error')}"
    blamed: Dict[str, str] = {}
    if nodes is not None and not same:  # a repeating failure is a bug: no node is to blame
        blamed = {n: why for n, why in blamed_nodes(cause, nodes.step, lost_nodes).items()
                  if n in nodes.allocation and n not in nodes.excluded}
    on_spare = nodes.next_step(list(blamed)) if nodes is not None and blamed else []
    if rewind is not None:
        budget = int(rewind.get("max_rewinds") or 0)
        if rewinds_before >= budget:
            action = STOP_REWINDS
            message = (f"the ranks stopped for a loss spike: {what}; not rewinding: trainer.max_rewinds={budget} "
                       f"reached ({rewinds_before} rewind(s) in this run). Fix: look at the data and the learning "
                       f"rate around step {rewind.get('spike_step')}, then run again to resume from the newest "
                       f"checkpoint (or raise trainer.max_rewinds).")
        else:
            action = REWIND
            skip = rewind.get("skip_batches")
            message = (f"loss spike at step {rewind.get('spike_step')}: rewinding (rewind {rewinds_before + 1} of "
                       f"{budget}): the ranks resume from the newest checkpoint before step {rewind.get('onset_step')} "
                       f"and skip {'the batches from it through the spike' if skip is None else f'{skip} global batches'}.")
    elif lost_nodes and not on_spare:
        action = STOP_NODE_LOST
        spare = ("no spare node left (cluster.spare_nodes: allocate more to continue in the job)" if nodes is not None
                 else "a new step would include it")
        message = (f"the ranks failed: {what}; SLURM no longer hears from {' '.join(lost_nodes)}: not restarting "
                   f"in the job ({spare}). cluster.requeue_on_failure=true requeues the job onto live nodes.")
    elif same:
        action = STOP_REPEATING
        message = (f"repeating failure: the same {what} happened again at the same step after a restart. "
                   f"This is a bug in the run, not a fault of a node: not restarting. Fix the cause "
                   f"(failure/summary.json and its traceback), then run again to resume from the newest checkpoint.")
    elif cause.get("what") in NODE_FAULT_KINDS and not on_spare:
        # A node the health probe or the straggler check measured as unfit fails the same way on a
        # restart in place: only a spare, or the requeue (which excludes it), gets past it.
        action = STOP_NODE_UNFIT
        spare = ("no spare node left (cluster.spare_nodes: allocate more to continue in the job)" if nodes is not None
                 else "a local run has no other node")
        message = (f"the ranks failed: {what}; not restarting in place: the same node would fail the same check "
                   f"({spare}). cluster.requeue_on_failure=true requeues the job without that node.")
    elif faults_done >= max_restarts:
        action = STOP_EXHAUSTED
        message = (f"the ranks failed: {what}; not restarting: cluster.max_restarts={max_restarts} "
                   f"{'reached' if max_restarts else '(in-job restarts off)'}.")
    elif blamed and on_spare:
        action = RESTART
        message = (f"the ranks failed: {what}; excluding node(s) {' '.join(blamed)} for the rest of the job "
                   f"({'; '.join(f'{n}: {why}' for n, why in blamed.items())}) and restarting on "
                   f"{','.join(on_spare)} (restart {restarts_done + 1} of {max_restarts}, no requeue); "
                   f"the ranks resume from the newest checkpoint.")
    else:
        # A crash or hang that names a live node, with no spare: restart on the same nodes (the
        # fault may be transient); the node is excluded only if the job ends up requeued.
        action = RESTART
        message = (f"the ranks failed: {what}; restarting them (restart {restarts_done + 1} of "
                   f"{max_restarts}), they resume from the newest checkpoint.")
    event = append_event(run_dir, {
        "event": "failure", "node": cause.get("node"), "rank": cause.get("rank"), "cause": cause,
        "action": action, "restart": restarts_done + 1 if action in (RESTART, REWIND) else restarts_done,
        **({"rewind": rewinds_before + 1} if action == REWIND else {}),
    })
    outcome = _node_outcome(run_dir, nodes, blamed, action, on_spare, requeue, lost_nodes)
    if action in (RESTART, REWIND):
        _set_failure_aside(run_dir, restarts_done + 1)
    return Decision(action, message, event, outcome)


def _node_outcome(run_dir: Path, nodes: Optional[NodeSet], blamed: Dict[str, str], action: str,
                  on_spare: List[str], requeue: bool, lost_nodes: Sequence[str] = ()) -> Optional[NodeOutcome]:
    """The nodes after the decision, each exclusion recorded ("exclude" events). `on_spare`: the
    next step's nodes chosen without the blamed ones ([] when no healthy spare is left);
    `lost_nodes`: those not responding (DOWN: a requeue leaves them out of its ExcNodeList)."""
    if nodes is None:
        return None
    if action in (RESTART, REWIND) and on_spare:
        excluded = [*nodes.excluded, *blamed]
        for node, why in blamed.items():
            append_event(run_dir, {"event": "exclude", "node": node, "cause": why, "action": EXCLUDE_RESTART})
        return NodeOutcome(on_spare, excluded)
    if action in (RESTART, REWIND):  # no node excluded now; the suspects stay in the step
        return NodeOutcome(nodes.next_step() or list(nodes.step), list(nodes.excluded))
    # Stopping: every bad node of this job run goes to the requeued job's ExcNodeList.
    bad = [*nodes.excluded, *blamed]
    for node, why in blamed.items():
        done = (EXCLUDE_NONE if not requeue else EXCLUDE_DOWN if node in lost_nodes else EXCLUDE_REQUEUE)
        append_event(run_dir, {"event": "exclude", "node": node, "cause": why, "action": done})
    return NodeOutcome([], bad, bad if requeue else [])


class RestartReport:
    """On the ranks of a restarted attempt: what the restart cost, once, on the first logged step.

    `resilience/restarts` (in-job restarts so far), `resilience/lost_steps` (steps done before the
    failure that the resumed checkpoint did not hold), `resilience/downtime_s` (from the
    failure to the end of the first step after the restart) and `resilience/restored_from_local`
    (1: the node-local tier of checkpoint.local_dir gave the state, 0: the shared checkpoint).
    """

    def __init__(self, run_dir: Path, restarts: int, rank: int, node: str):
        self.run_dir = Path(run_dir)
        self.restarts = restarts
        self.rank = rank
        self.node = node
        failures = [e for e in read_events(run_dir) if e.get("event") == "failure"] if restarts else []
        self.failure = failures[-1] if failures else None
        self.resumed_step = 0
        self.tier = "shared"
        self._done = self.failure is None

    def resumed_at(self, step: int, tier: str = "shared", from_replica: Optional[List[int]] = None) -> None:
        """The step the checkpoint this attempt resumed from holds (0: started from scratch); after
        a restart rank 0 records the "resumed" event (the downtime is known only after a step).
        tier: "local" (checkpoint.local_dir) or "shared"; from_replica: the ranks whose local
        state came from their peer node's replica."""
        self.resumed_step = step
        self.tier = tier
        if self._done or self.rank != 0:
            return
        append_event(self.run_dir, {"event": "resumed", "node": self.node, "rank": self.rank, "step": step,
                                    "lost_steps": self.lost_steps(), "restart": self.restarts, "tier": tier,
                                    "from_replica": list(from_replica or [])})

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
                "resilience/downtime_s": round(max(0.0, time.time() - float(failed_at)), 3),
                "resilience/restored_from_local": 1.0 if self.tier == "local" else 0.0}


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m launcher.resilience.restarts decide ...`: the batch script's restart decision.

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
                        help="space-separated nodes the scheduler no longer hears from")
    parser.add_argument("--allocation", default="", help="the job's nodes (space- or comma-separated); "
                        "with it the decision chooses the next step's nodes (cluster.spare_nodes)")
    parser.add_argument("--step-nodes", default="", help="the failed step's nodes")
    parser.add_argument("--excluded", default="", help="nodes excluded earlier in this job run")
    parser.add_argument("--nodes-needed", type=int, default=0, help="nodes a step needs (cluster.nodes)")
    parser.add_argument("--requeue", type=int, default=0, help="1: the script requeues the job if it stops")
    parser.add_argument("--state-file", type=Path, default=None,
                        help="where to write STEP_NODES / EXCLUDED_NODES / REQUEUE_EXCLUDE for the script to source")
    args = parser.parse_args(argv)
    nodes = None
    if args.allocation.strip():
        nodes = NodeSet(split_nodes(args.allocation), args.nodes_needed, split_nodes(args.step_nodes),
                        split_nodes(args.excluded))
    decision = decide(args.run_dir, args.restarts_done, args.max_restarts, args.exit_code, args.attempt_started,
                      split_nodes(args.lost_nodes), nodes, bool(args.requeue))
    if args.state_file is not None and decision.nodes is not None:
        decision.nodes.write_state(args.state_file)
    print(f"launcher: {'error: ' if not decision.restart else ''}{decision.message}", flush=True)
    return 0 if decision.restart else 1


if __name__ == "__main__":
    sys.exit(main())
