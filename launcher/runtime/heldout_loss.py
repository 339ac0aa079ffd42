"""Held-out loss (validation): the same held-out batches evaluated every trainer.val_every steps.

The batches are fixed at start (the first trainer.val_steps global batches of the held-out
data, each rank taking its data-parallel slice exactly as in training), so values are
comparable across steps and runs. Evaluation is forward-only and touches neither the
training sampler nor any random state, so training and exact resume are unchanged.

With data.val_mix the held-out batches blend its sources by weight and each source's loss is
reported too (`val_loss/<name>`, token-weighted over the batches), from the engine's
`eval_stats` where it has one.
"""

from __future__ import annotations

import math
from typing import Dict, List, Sequence

from launcher.data.batch import Microbatch
from launcher.data.dataset import StepBatches

MAX_EXP = 700.0  # math.exp overflows a float a little above 709


class Validator:
    """Runs the engine's forward-only loss over fixed batches; returns val_loss and val_ppl (same
    on every rank), plus val_loss/<name> per mixture source when `names` are given."""

    def __init__(self, engine, batches: List[List[Microbatch]], names: Sequence[str] = ()):
        self.engine = engine
        self.batches = batches
        self.names = list(names)

    @classmethod
    def from_step_batches(cls, engine, source: StepBatches, val_steps: int) -> "Validator":
        names = source.names if getattr(source, "mixture", False) else ()
        return cls(engine, [source.for_step(i) for i in range(1, val_steps + 1)], names)

    def run(self) -> Dict[str, float]:
        """Mean token loss over the validation batches (collective: every rank calls it)."""
        if self.names and hasattr(self.engine, "eval_stats"):
            return self._run_per_source()
        losses = [self.engine.eval_step(mbs) for mbs in self.batches]
        loss = sum(losses) / len(losses)
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, MAX_EXP))}

    def _run_per_source(self) -> Dict[str, float]:
        stats = [self.engine.eval_stats(mbs) for mbs in self.batches]
        loss = sum(s.loss for s in stats) / len(stats)
        out = {"val_loss": loss, "val_ppl": math.exp(min(loss, MAX_EXP))}
        for index, name in enumerate(self.names):
            tokens = sum(s.source_tokens.get(index, 0.0) for s in stats)
            if tokens > 0:
                total = sum(s.source_loss.get(index, 0.0) * s.source_tokens.get(index, 0.0) for s in stats)
                out[f"val_loss/{name}"] = total / tokens
        return out
