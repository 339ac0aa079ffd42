"""Test aids: make one rank misbehave at a chosen step, through environment variables.

They let the real multi-process tests produce the failures the health tools exist for
(a hang, a crash) without patching code. Each variable is "RANK:STEP"; unset, nothing happens.

- LAUNCHER_DEBUG_HANG=R:S   rank R sleeps forever before step S (before the step's first collective);
- LAUNCHER_DEBUG_RAISE=R:S  rank R raises RuntimeError before step S;
- LAUNCHER_DEBUG_OOM=R:S    rank R raises torch.OutOfMemoryError before step S;
- LAUNCHER_DEBUG_SLOW_COMPUTE=R:N  rank R does N extra matmuls in every forward (install_slow_compute).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional, Tuple

log = logging.getLogger(__name__)


def _target(name: str) -> Optional[Tuple[int, int]]:
    value = os.environ.get(name, "")
    if not value:
        return None
    rank, step = (int(x) for x in value.split(":"))
    return rank, step


def before_step(rank: int, step: int) -> None:
    """Called by the loop before each step's compute."""
    if _target("LAUNCHER_DEBUG_HANG") == (rank, step):
        log.warning("LAUNCHER_DEBUG_HANG: rank %d sleeps forever before step %d", rank, step)
        while True:
            time.sleep(3600)
    if _target("LAUNCHER_DEBUG_RAISE") == (rank, step):
        raise RuntimeError(f"LAUNCHER_DEBUG_RAISE: rank {rank} fails before step {step}")
    if _target("LAUNCHER_DEBUG_OOM") == (rank, step):
        import torch

        raise torch.OutOfMemoryError(f"LAUNCHER_DEBUG_OOM: rank {rank} is out of memory before step {step}")


def install_slow_compute(modules, rank: int) -> None:
    """LAUNCHER_DEBUG_SLOW_COMPUTE=R:N: on rank R, every forward of the model parts first does N
    extra 256x256 matmuls (fixed work, inside the compute: the numbers trained are unchanged)."""
    target = _target("LAUNCHER_DEBUG_SLOW_COMPUTE")
    if target is None or target[0] != rank:
        return
    import torch

    n = target[1]
    log.warning("LAUNCHER_DEBUG_SLOW_COMPUTE: rank %d does %d extra matmuls per forward", rank, n)

    def burn(module, args):
        a = torch.ones(256, 256)
        for _ in range(n):
            a = torch.mm(a, a).clamp_(max=1.0)

    for m in modules:
        m.register_forward_pre_hook(burn)
