"""Waiting for a long single-rank phase without tripping `cluster.collective_timeout_s`.

The default process group fails any collective that waits longer than collective_timeout_s,
so that the survivors of a dead or frozen node give up quickly. Some waits are long by design:
one rank works alone (rank 0 publishing a checkpoint and pruning old ones, tokenizing a corpus,
writing the consolidated export, waiting for the checkpoint-folder lock) while the others wait
for it in a barrier or broadcast. Those waits go through a separate gloo group whose timeout is
the phase timeout (longer), created once per run by `init_phase_group`; without it (one
process, or before init) they fall back to the default group.
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional

import torch.distributed as dist

# At least torch's own default collective timeout: a phase may legitimately take this long.
MIN_PHASE_TIMEOUT_S = 1800

_group: Optional[Any] = None


def phase_timeout_s(collective_timeout_s: int, save_timeout_s: int = 0) -> int:
    """The phase group's timeout: the collective timeout plus the plan's shutdown timeout (a
    bound on one step + a checkpoint save), and never below MIN_PHASE_TIMEOUT_S."""
    return max(MIN_PHASE_TIMEOUT_S, int(collective_timeout_s) + int(save_timeout_s))


def init_phase_group(timeout_s: int) -> None:
    """Collective (every rank, after init_process_group): create the group phase waits use."""
    global _group
    if dist.is_initialized() and dist.get_world_size() > 1:
        _group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=int(timeout_s)))


def phase_group() -> Optional[Any]:
    """The phase group (gloo, host memory), or None before init_phase_group / with one process."""
    return _group


def destroy_phase_group() -> None:
    """Forget the group (the process group itself is destroyed with the default one)."""
    global _group
    _group = None


def phase_barrier() -> None:
    """A barrier that waits as long as the phase timeout (for one rank's long work)."""
    if dist.is_initialized():
        dist.barrier(group=_group)


def phase_broadcast(value: Any, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank, waiting as long as the phase timeout."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src, group=_group)
    return box[0]


def phase_all_gather(value: Any) -> List[Any]:
    """Every rank's `value` in rank order, waiting as long as the phase timeout."""
    if not dist.is_initialized():
        return [value]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_group)
    return gathered
