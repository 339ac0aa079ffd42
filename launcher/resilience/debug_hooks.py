"""Test aids: make one rank misbehave at a chosen step, through environment variables.

They let the real multi-process tests produce the failures the health tools exist for
(a hang, a crash) without patching code. Each variable is "RANK:STEP"; unset, nothing happens.

- LAUNCHER_DEBUG_HANG=R:S   rank R sleeps forever before step S (before the step's first collective);
- LAUNCHER_DEBUG_RAISE=R:S  rank R raises RuntimeError before step S;
- LAUNCHER_DEBUG_OOM=R:S    rank R raises torch.OutOfMemoryError before step S;
- LAUNCHER_DEBUG_NONFINITE=R:S (or R:S-E)  rank R's training forward returns NaN at step S (steps S to E):
  its loss and gradients are non-finite, so the global gradient norm is too (install_nonfinite);
- LAUNCHER_DEBUG_SPIKE=B          every rank's training forward output is multiplied by SPIKE_FACTOR
  while it trains global batch B of the data (1-based; a rewind that skips B never sees it): a
  loss spike tied to the data, as real ones are (install_spike);
- LAUNCHER_DEBUG_SLOW_COMPUTE=R:N  rank R does N extra matmuls in every forward (install_slow_compute);
- LAUNCHER_DEBUG_PROBE=R:fail      rank R's pre-flight health probe (launcher/resilience/preflight.py)
  gets a wrong matmul result; R:slow: its probe matmuls are repeated PROBE_SLOWDOWN times. R may
  be a node name instead (n2:fail): every rank on that node, whichever ranks a restart puts there.
- LAUNCHER_DEBUG_HOLD=S:PATH       every rank, once step S is logged and saved and before the
  ranks agree on a stop, touches PATH.rank<R> and waits until PATH exists or a stop is requested
  on that rank (hold_after_step): a test signals or kills a run at a known step, however loaded
  the machine (a poller that reads the logged steps can fall behind the training).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional, Tuple

import torch

from launcher.job_env import job_facts

log = logging.getLogger(__name__)


def _target(name: str) -> Optional[Tuple[int, int]]:
    value = os.environ.get(name, "")
    if not value:
        return None
    rank, step = (int(x) for x in value.split(":"))
    return rank, step


PROBE_SLOWDOWN = 100  # far over any sensible trainer.health_factor, and over the noise floor (preflight.MIN_COMPUTE_GAP_S)


def _probe_hit(rank: int, how: str) -> bool:
    """LAUNCHER_DEBUG_PROBE=WHO:HOW names this rank: WHO is its rank number or its node's name (a
    node keeps failing after a restart moves the ranks, as a sick node would)."""
    value = os.environ.get("LAUNCHER_DEBUG_PROBE", "")
    if not value:
        return False
    who, _, wanted = value.rpartition(":")
    if wanted not in ("fail", "slow"):
        raise ValueError(f"LAUNCHER_DEBUG_PROBE={value!r}: the part after the rank or node must be fail or slow. "
                         f"Fix: e.g. LAUNCHER_DEBUG_PROBE=1:fail or LAUNCHER_DEBUG_PROBE=n2:slow.")
    if wanted != how:
        return False
    return who == str(rank) or who == job_facts().node_name


def probe_fails(rank: int) -> bool:
    """LAUNCHER_DEBUG_PROBE=R:fail (or NODE:fail): this rank's probe result is made wrong."""
    if _probe_hit(rank, "fail"):
        log.warning("LAUNCHER_DEBUG_PROBE: rank %d's health probe gets a wrong matmul result", rank)
        return True
    return False


def probe_slowdown(rank: int) -> int:
    """LAUNCHER_DEBUG_PROBE=R:slow (or NODE:slow): how many times over this rank repeats its probe's matmuls (1 elsewhere)."""
    return PROBE_SLOWDOWN if _probe_hit(rank, "slow") else 1


_current_step = 0  # the step the loop is in (before_step), for hooks that act inside the compute
_current_batch = 0  # the global batch of the data that step trains (step + batches skipped by rewinds)


def before_step(rank: int, step: int, data_batch: Optional[int] = None) -> None:
    """Called by the loop before each step's compute (`data_batch`: the data's global batch it trains)."""
    global _current_step, _current_batch
    _current_step = step
    _current_batch = step if data_batch is None else data_batch
    if _target("LAUNCHER_DEBUG_HANG") == (rank, step):
        log.warning("LAUNCHER_DEBUG_HANG: rank %d sleeps forever before step %d", rank, step)
        while True:
            time.sleep(3600)
    if _target("LAUNCHER_DEBUG_RAISE") == (rank, step):
        raise RuntimeError(f"LAUNCHER_DEBUG_RAISE: rank {rank} fails before step {step}")
    if _target("LAUNCHER_DEBUG_OOM") == (rank, step):
        raise torch.OutOfMemoryError(f"LAUNCHER_DEBUG_OOM: rank {rank} is out of memory before step {step}")


def install_slow_compute(modules, rank: int) -> None:
    """LAUNCHER_DEBUG_SLOW_COMPUTE=R:N: on rank R, every forward of the model parts first does N
    extra 256x256 matmuls (fixed work, inside the compute: the numbers trained are unchanged)."""
    target = _target("LAUNCHER_DEBUG_SLOW_COMPUTE")
    if target is None or target[0] != rank:
        return
    n = target[1]
    log.warning("LAUNCHER_DEBUG_SLOW_COMPUTE: rank %d does %d extra matmuls per forward", rank, n)

    def burn(module, args):
        a = torch.ones(256, 256)
        for _ in range(n):
            a = torch.mm(a, a).clamp_(max=1.0)

    for m in modules:
        m.register_forward_pre_hook(burn)


def _nonfinite_target() -> Optional[Tuple[int, int, int]]:
    """LAUNCHER_DEBUG_NONFINITE=R:S or R:S-E as (rank, first step, last step)."""
    value = os.environ.get("LAUNCHER_DEBUG_NONFINITE", "")
    if not value:
        return None
    rank, _, steps = value.partition(":")
    first, _, last = steps.partition("-")
    return int(rank), int(first), int(last or first)


def install_nonfinite(modules, rank: int) -> list:
    """LAUNCHER_DEBUG_NONFINITE=R:S[-E]: on rank R, every training forward of the model parts at
    steps S to E multiplies its output by NaN (evaluation forwards are untouched). The loss and every
    gradient of that rank become NaN, and so the global gradient norm of every rank."""
    target = _nonfinite_target()
    if target is None or target[0] != rank:
        return
    _, first, last = target
    log.warning("LAUNCHER_DEBUG_NONFINITE: rank %d's forward returns NaN at steps %d to %d", rank, first, last)

    def poison(module, args, output):
        if module.training and first <= _current_step <= last and torch.is_tensor(output):
            return output * float("nan")
        return None

    return [m.register_forward_hook(poison) for m in modules]


SPIKE_FACTOR = 50.0  # the logits of a 1/vocab-uniform start times this: a loss far above any window's spread


def install_spike(modules) -> list:
    """LAUNCHER_DEBUG_SPIKE=B: while any rank trains the data's global batch B, every training
    forward of the model parts multiplies its output by SPIKE_FACTOR (a real, large loss and
    gradient: grad clipping keeps the step finite)."""
    value = os.environ.get("LAUNCHER_DEBUG_SPIKE", "")
    if not value:
        return []
    batch = int(value)
    log.warning("LAUNCHER_DEBUG_SPIKE: the forward output is multiplied by %g while the data's batch %d trains",
                SPIKE_FACTOR, batch)

    def spike(module, args, output):
        if module.training and _current_batch == batch and torch.is_tensor(output):
            return output * SPIKE_FACTOR
        return None

    return [m.register_forward_hook(spike) for m in modules]


HOLD_MAX_S = 900.0  # a test that never releases its hold fails on its own timeout, not by hanging the suite


def held_marker(release: Path, rank: int) -> Path:
    """The file rank `rank` touches once it holds (LAUNCHER_DEBUG_HOLD=S:release): a test waits for it."""
    return Path(f"{release}.rank{rank}")


def hold_after_step(rank: int, step: int, stop_requested: Callable[[], object]) -> None:
    """LAUNCHER_DEBUG_HOLD=S:PATH: after step S, mark this rank as held (PATH.rank<R>) and wait
    until PATH exists or `stop_requested()` is true (at most HOLD_MAX_S). A run resumed past S, or
    started again once PATH exists, does not wait."""
    value = os.environ.get("LAUNCHER_DEBUG_HOLD", "")
    if not value:
        return
    at, _, path = value.partition(":")
    if not at.isdigit() or not path:
        raise ValueError(f"LAUNCHER_DEBUG_HOLD={value!r}: expected STEP:PATH. "
                         f"Fix: e.g. LAUNCHER_DEBUG_HOLD=3:/tmp/run/release.")
    release = Path(path)
    if int(at) != step or release.exists():
        return
    log.warning("LAUNCHER_DEBUG_HOLD: rank %d holds after step %d until %s exists or a stop is requested",
                rank, step, release)
    held_marker(release, rank).touch()
    deadline = time.monotonic() + HOLD_MAX_S
    while not release.exists() and not stop_requested():
        if time.monotonic() > deadline:
            log.warning("LAUNCHER_DEBUG_HOLD: rank %d released after %g s without %s", rank, HOLD_MAX_S, release)
            return
        time.sleep(0.05)
