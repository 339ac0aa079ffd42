"""Graceful stop: preemption, the SLURM time-limit warning, or an operator's request.

A stop is requested by SIGUSR1 or SIGTERM reaching a rank, or by the file
<run_dir>/control/stop existing (the sbatch script's USR1 trap creates it). The ranks agree
at the end of a step (one tiny all-reduce, in the background: see should_stop), save a checkpoint, rank 0 writes
<run_dir>/control/stopped as JSON {"step", "reason"}, and every process exits 0 so the batch
script can requeue the job. A repeated SIGTERM or SIGUSR1 is the same request, never an abort:
SLURM signals every process of a step and torchrun forwards its own SIGTERM, so a rank often
gets two while it saves, and cutting the save short would lose the stop's checkpoint. SIGINT
keeps Python's default (KeyboardInterrupt, which ends the rank); SIGKILL is the hard stop.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from launcher.parallel.phase import phase_group
from launcher.runtime.stop_control import STOP_FILE, StopSignals, control_dir, stop_request_reason

log = logging.getLogger(__name__)

class StopWatcher(StopSignals):
    """Collects stop requests on this rank and agrees on them across ranks."""

    def __init__(self, run_dir: Path, device: torch.device):
        super().__init__((signal.SIGUSR1, signal.SIGTERM))
        self.stop_file = control_dir(run_dir) / STOP_FILE
        self.device = device
        self.reason: Optional[str] = None
        self._agreement = None  # (async all-reduce work, its flag) started by the last should_stop

    def on_stop_signal(self, name: str) -> None:
        if self.reason is not None:  # the stop file asked first: keep stopping (and saving)
            log.warning("received %s: already stopping (%s)", name, self.reason)
            return
        self.reason = f"signal {name}"
        log.warning("received %s: will checkpoint and stop at the end of a step (the next one the ranks agree on)", name)

    def local_request(self) -> Optional[str]:
        if self.reason is None:
            self.reason = stop_request_reason(self.stop_file)
        return self.reason

    def should_stop(self) -> bool:
        """True on every rank if any rank has asked to stop (collective: every rank calls it at the same steps).

        The ranks agree through an all-reduce of a flag in host memory on the phase group (gloo)
        that runs in the background between two calls: each call reads the agreement the previous
        call started and starts the next one. So the loop never waits for this collective and the
        device is never synchronised for it (it ran every step); the price is that a request is
        acted on one check after the one where a rank first saw it (one step later).
        """
        group = phase_group() if dist.is_initialized() else None
        if group is None:  # one process, or no phase group: agree now, on the default group
            flag = torch.tensor([1.0 if self.local_request() else 0.0], device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item() > 0)
        agreed = False
        if self._agreement is not None:
            work, previous = self._agreement
            work.wait()
            agreed = bool(previous.item() > 0)
        flag = torch.tensor([1.0 if self.local_request() else 0.0])
        self._agreement = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag)
        return agreed
