"""Validation loss: the same held-out batches evaluated every trainer.val_every steps.

The batches are fixed at start (the first trainer.val_steps global batches of the held-out
data, each rank taking its data-parallel slice exactly as in training), so values are
comparable across steps and runs. Evaluation is forward-only and touches neither the
training sampler nor any random state, so training and exact resume are unchanged.
"""

from __future__ import annotations

import math
from typing import Dict, List

from launcher.data.dataset import StepBatches
from launcher.engines.base import Microbatch

MAX_EXP = 700.0  # math.exp overflows a float a little above 709


class Validator:
    """Runs engine.eval_step over fixed batches; returns val_loss and val_ppl (same on every rank)."""

    def __init__(self, engine, batches: List[List[Microbatch]]):
        self.engine = engine
        self.batches = batches

    @classmethod
    def from_step_batches(cls, engine, source: StepBatches, val_steps: int) -> "Validator":
        return cls(engine, [source.for_step(i) for i in range(1, val_steps + 1)])

    def run(self) -> Dict[str, float]:
        """Mean token loss over the validation batches (collective: every rank calls it)."""
        losses = [self.engine.eval_step(mbs) for mbs in self.batches]
        loss = sum(losses) / len(losses)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, MAX_EXP))}
