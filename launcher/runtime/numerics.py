"""Numerical health: count the steps an engine skipped for a non-finite gradient norm, and end the
run after too many in a row.

The engines decide the skip (the global norm is the same on every rank, so every rank skips the
same steps: launcher/engines/native.py); this module keeps the count logged as
`health/skipped_steps` and, after `trainer.max_skipped_steps` consecutive skips, raises
`NonFiniteSteps`, which the failure bundle (launcher/resilience/failure.py) records as kind
"nonfinite" naming the step, the rank(s) whose own loss was not finite, and the first parameter
whose gradient was not.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Callable, Dict, List, Optional

from launcher.engines.base import NonFiniteStep
from launcher.resilience.failure import LossSpike, NonFiniteSteps

log = logging.getLogger(__name__)

SKIPPED_KEY = "health/skipped_steps"
SPIKE_KEY = "health/loss_spike"
SPIKE_MIN_HISTORY = 10  # logged losses needed before a z-score means anything


def blame(views: List[NonFiniteStep]) -> Dict[str, Any]:
    """Which ranks a skipped step points at, from every rank's view (index = rank): those whose own
    loss was not finite (the gradients of every rank are non-finite once reduced, so only the loss
    before the all-reduce tells the origin); all ranks when each loss was finite (the gradient went
    wrong in the backward or the reduction). The tensor named is the first blamed rank's."""
    ranks = [r for r, v in enumerate(views) if not v.local_loss_finite] or list(range(len(views)))
    tensor = next((views[r].first_nonfinite for r in ranks if views[r].first_nonfinite), None)
    return {"ranks": ranks, "first_nonfinite": tensor}


class NumericalHealth:
    """One per rank; `observe` after every step (host-only bookkeeping: the engine already read the norm)."""

    def __init__(self, max_skipped_steps: int, rank: int, gather: Optional[Callable[[Any], List[Any]]] = None):
        self.max_skipped_steps = max_skipped_steps  # 0: never end the run for skips
        self.rank = rank
        self.gather = gather or (lambda obj: [obj])  # all_gather_object over the world (collective)
        self.skipped = 0
        self.consecutive = 0

    def observe(self, step: int, skipped: Optional[NonFiniteStep]) -> None:
        """Count a skipped step; raise NonFiniteSteps at the max_skipped_steps-th in a row (every
        rank at the same step: the decision is global)."""
        if skipped is None:
            self.consecutive = 0
            return
        self.skipped += 1
        self.consecutive += 1
        log.warning("step %d skipped: the gradient norm is not finite (rank %d: own loss %s, first non-finite "
                    "gradient %s; %d in a row)", step, self.rank,
                    "finite" if skipped.local_loss_finite else "NOT finite", skipped.first_nonfinite, self.consecutive)
        if self.max_skipped_steps and self.consecutive >= self.max_skipped_steps:
            found = blame(self.gather(skipped))
            raise NonFiniteSteps(step, found["ranks"], found["first_nonfinite"], self.consecutive)

    def metrics(self) -> Dict[str, int]:
        """The log record's share: skipped steps since this process started."""
        return {SKIPPED_KEY: self.skipped}


class SpikeDetector:
    """Loss spikes (`trainer.spike_zscore` > 0): a logged loss more than `zscore` standard
    deviations above the mean of the previous `window` logged finite losses is a spike, logged as
    `health/loss_spike` = 1 (else 0) with a warning. It looks at the logged losses only, which the
    trainer reads anyway (trainer.log_every=1 looks at every step): no extra device wait.

    `on_spike="rewind"`: after the spike's record is logged, `rewind_if_spiked` raises LossSpike
    (every rank at the same step: the logged loss is the global batch's), and the restart decision
    rewinds the run (launcher/resilience/restarts.py, launcher/runtime/rewind.py)."""

    def __init__(self, zscore: float, window: int, on_spike: str = "log", skip_batches: Optional[int] = None,
                 max_rewinds: int = 0):
        self.zscore = zscore
        self.history: deque = deque(maxlen=window)
        self.on_spike = on_spike
        self.skip_batches = skip_batches
        self.max_rewinds = max_rewinds
        self.last_logged_step: Optional[int] = None
        self.spiked: Optional[LossSpike] = None

    def rewind_if_spiked(self) -> None:
        """trainer.on_spike=rewind: end the attempt for the rewind once the spike's step is logged."""
        if self.spiked is not None and self.on_spike == "rewind":
            raise self.spiked

    def observe(self, step: int, loss: float) -> Dict[str, int]:
        """`health/loss_spike` for this logged step; the loss then joins the window (a spike too:
        a loss that stays up becomes the new level, not a spike at every later step)."""
        spike = 0
        if math.isfinite(loss):
            if len(self.history) >= min(SPIKE_MIN_HISTORY, self.history.maxlen):
                mean = sum(self.history) / len(self.history)
                std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / len(self.history))
                if std > 0 and (loss - mean) / std > self.zscore:
                    spike = 1
                    # The spike began after the previous logged step (log_every > 1: somewhere in the window).
                    onset = step if self.last_logged_step is None else self.last_logged_step + 1
                    self.spiked = LossSpike(step, onset, loss, (loss - mean) / std, self.skip_batches,
                                            self.max_rewinds)
                    log.warning("loss spike at step %d: %.4f is %.1f standard deviations over the mean %.4f of the "
                                "last %d logged losses (trainer.spike_zscore=%g)", step, loss, (loss - mean) / std,
                                mean, len(self.history), self.zscore)
            self.history.append(loss)
        self.last_logged_step = step
        return {SPIKE_KEY: spike}
