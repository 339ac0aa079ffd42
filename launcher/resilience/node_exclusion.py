"""Bad-node exclusion for the in-job restart: which node a failure blames, and on which nodes the
next srun step runs (`cluster.spare_nodes`).

Torch-free, used by launcher/resilience/restarts.py `decide`. The job allocates `cluster.nodes +
cluster.spare_nodes` nodes; each srun step runs on `cluster.nodes` of them (an explicit
`--nodelist`). A node the failure names as the cause is excluded for the rest of the job: the next
step runs on the healthy nodes, a spare taking its place. Without a healthy spare the node goes to
the requeue instead (`scontrol update ExcNodeList=`), so the requeued job does not land on it again.

Which failures name a node:
- a lost node: SLURM no longer hears from it (`sinfo -d`, passed as `--lost-nodes`);
- a hang: the watchdog's summary names the nodes whose ranks did not arrive at the collective
  (`hosts_not_arrived`), when that is some of the step's nodes, not all;
- a crash: an exception (or OOM) on a rank names that rank's node, unless its text reports a lost
  peer (a reset connection, a collective timeout): then the peer is the cause, not this node.
- a health probe failing (kind "health": wrong or slow compute, slow all-reduce, before the first
  step) or a straggler over trainer.straggler_factor for trainer.straggler_checks log steps in a row
  (kind "straggler"): the summary's blamed_hosts. These are faults of the node, not transient: with
  no spare the job does not restart in place (it would meet the same node), see resilience.decide.
A rank killed by a signal writes no summary and names no node.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Sequence

# An exception with one of these in its text is a consequence of a peer's loss, seen on a healthy node.
PEER_LOSS_SYMPTOMS = ("connection reset", "connection closed", "closed by peer", "broken pipe", "timed out",
                      "timeout", "socket", "distbackenderror", "nccl", "gloo", "connection refused")
CRASH_KINDS = ("exception", "oom")
# Kinds whose summary names unfit nodes (blamed_hosts) measured by a check, not a crash.
NODE_FAULT_KINDS = ("health", "straggler")


def blamed_nodes(cause: Dict[str, Any], step_nodes: Sequence[str], lost_nodes: Sequence[str] = ()) -> Dict[str, str]:
    """The nodes a failure names as its cause, each with why (empty when it names none)."""
    if lost_nodes:
        return {node: "node lost: SLURM no longer hears from it" for node in lost_nodes}
    what = cause.get("what")
    if what == "hang":
        hosts = [h for h in cause.get("hosts_not_arrived") or [] if h]
        # Every node of the step stuck is no evidence against one of them.
        if hosts and set(step_nodes) - set(hosts):
            return {h: f"hang: its ranks {cause.get('ranks_not_arrived')} did not arrive at the collective"
                    for h in sorted(set(hosts))}
        return {}
    if what in NODE_FAULT_KINDS:
        whys = {n.get("host"): n.get("why") for n in cause.get("named") or []}
        return {h: f"{what}: {whys.get(h) or cause.get('error')}" for h in cause.get("blamed_hosts") or [] if h}
    node, error = cause.get("node"), str(cause.get("error") or "")
    if what in CRASH_KINDS and node and not any(s in error.lower() for s in PEER_LOSS_SYMPTOMS):
        return {node: f"crash: {what} on rank {cause.get('rank')}: {error}"}
    return {}


@dataclass
class NodeSet:
    """The job's nodes: its allocation (SLURM's order), those excluded so far, and how many a step needs."""

    allocation: List[str]
    needed: int
    step: List[str] = field(default_factory=list)  # the nodes of the step that just failed
    excluded: List[str] = field(default_factory=list)

    def healthy(self, also_bad: Sequence[str] = ()) -> List[str]:
        """Nodes not excluded: the surviving nodes of the last step first, then the spares (each in allocation order)."""
        bad = set(self.excluded) | set(also_bad)
        ok = [n for n in self.allocation if n not in bad]
        return [n for n in ok if n in self.step] + [n for n in ok if n not in self.step]

    def next_step(self, also_bad: Sequence[str] = ()) -> List[str]:
        """The nodes of the next step (allocation order: its first node hosts the rendezvous);
        [] when fewer than `needed` healthy nodes are left."""
        chosen = set(self.healthy(also_bad)[:self.needed])
        if len(chosen) < self.needed:
            return []
        return [n for n in self.allocation if n in chosen]


@dataclass
class NodeOutcome:
    """What the decision does with the job's nodes; written for the batch script (`write_state`)."""

    step_nodes: List[str]  # the next step's nodes ([] when not restarting)
    excluded: List[str]  # excluded for the rest of this job run
    exclude_on_requeue: List[str] = field(default_factory=list)  # for `scontrol update ExcNodeList=` before a requeue

    def write_state(self, path: Path) -> None:
        """A file the batch script sources: STEP_NODES (comma-separated, srun --nodelist), EXCLUDED_NODES
        and REQUEUE_EXCLUDE (both comma-separated). Values are shell-quoted."""
        lines = {"STEP_NODES": ",".join(self.step_nodes), "EXCLUDED_NODES": ",".join(self.excluded),
                 "REQUEUE_EXCLUDE": ",".join(self.exclude_on_requeue)}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in lines.items()))
        tmp.replace(path)


def split_nodes(text: str) -> List[str]:
    """Node names from a space- or comma-separated list (the batch script's variables)."""
    return [n for n in text.replace(",", " ").split() if n]
