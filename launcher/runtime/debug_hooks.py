"""Test aids: make one rank misbehave at a chosen step, through environment variables.

They let the real multi-process tests produce the failures the health tools exist for
(a hang, a crash) without patching code. Each variable is "RANK:STEP"; unset, nothing happens.

- LAUNCHER_DEBUG_HANG=R:S   rank R sleeps forever before step S (before the step's first collective);
- LAUNCHER_DEBUG_RAISE=R:S  rank R raises RuntimeError before step S.
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
