"""The background half of `checkpoint.async=true`: a dedicated process group and DCP writers.

An asynchronous save (CheckpointManager.save with async_save) blocks training only while the
engine stages its state into host memory; DCP's `async_save` then writes the staged copy from
its own thread, and a finisher thread of the CheckpointManager runs the usual protocol
(checksums, manifest, atomic rename, pruning) once every rank's write is done. Both background
threads talk to the other ranks through `CheckpointGroup`, a gloo group of their own: sharing
the default or the phase group with the training loop's collectives, issued from another
thread, would interleave the two streams of collectives differently on different ranks.

Test aid: LAUNCHER_DEBUG_SLOW_CKPT_WRITE=STEP:SECONDS[,STEP:SECONDS...] makes every rank's DCP
writer of the asynchronous save of step STEP sleep SECONDS before it writes any data (the
tests kill a run while such a write is in flight; a slow write also shows that the staged copy,
not the live parameters, is what gets written).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

SLOW_WRITE_ENV = "LAUNCHER_DEBUG_SLOW_CKPT_WRITE"


class CheckpointGroup:
    """barrier / broadcast / all_gather of Python values on a gloo group kept for checkpoint threads.

    Creating it is collective (every rank, same point of the run); without a process group
    (one process) every call is local.
    """

    def __init__(self, timeout_s: int):
        self.group: Optional[Any] = None
        if dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=int(timeout_s)))

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather(self, value: Any) -> List[Any]:
        """Every rank's `value`, in rank order."""
        if self.group is None:
            return [value]
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered


def slow_write_seconds(step: int) -> float:
    """Seconds the test aid LAUNCHER_DEBUG_SLOW_CKPT_WRITE adds to the write of `step` (0: none)."""
    table: Dict[int, float] = {}
    for item in filter(None, os.environ.get(SLOW_WRITE_ENV, "").split(",")):
        at, seconds = item.split(":")
        table[int(at)] = float(seconds)
    return table.get(step, 0.0)


def storage_writer(directory: str, step: int):
    """The DCP FileSystemWriter of one save (the same files a synchronous `dcp.save` writes)."""
    # lazy: DCP (~0.5 s): manager.py imports this module on every rank; a DeepSpeed rank loads DCP nowhere else
    from torch.distributed.checkpoint import FileSystemWriter

    seconds = slow_write_seconds(step)
    if seconds <= 0:
        return FileSystemWriter(directory)

    class SlowWriter(FileSystemWriter):
        """FileSystemWriter that waits before writing (LAUNCHER_DEBUG_SLOW_CKPT_WRITE)."""

        def write_data(self, plan, planner):
            log.warning("%s: the write of step %d waits %g s", SLOW_WRITE_ENV, step, seconds)
            time.sleep(seconds)
            return super().write_data(plan, planner)

    return SlowWriter(directory)
