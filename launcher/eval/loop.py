"""One downstream evaluation at a training step: lm-eval's tasks on the live model -> metrics.

`DownstreamEval.run()` is collective (every rank calls it at the same steps, and every rank runs
the same requests; see lm.py). It is forward-only and leaves every random state as it found it
(lm-eval seeds Python's and numpy's generators; the engines' eval path draws none), so the
training losses and an exact resume are the same with evaluation on or off.

Metrics: lm-eval's `<metric>,<filter>` of task T becomes `eval/T/<metric>` (filter `none`) or
`eval/T/<metric>/<filter>`, its stderr `eval/T/<metric>_stderr`, plus `eval/seconds`.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any, Dict

import numpy as np
import torch

from launcher.eval.tasks import BOOTSTRAP_ITERS

log = logging.getLogger(__name__)


def evaluate_tasks(lm, loaded_tasks: Dict[str, Any], limit: int) -> Dict[str, Any]:
    """lm-eval's `evaluate` of `lm` on the loaded tasks (limit: documents per task, 0 all); its
    results dict. The one call the loop and the reference (HFLM) tests share."""
    from lm_eval.evaluator import evaluate  # lazy: the optional extra

    return evaluate(lm=lm, task_dict=loaded_tasks, limit=limit or None, bootstrap_iters=BOOTSTRAP_ITERS,
                    log_samples=False, verbosity="ERROR")


def metric_rows(results: Dict[str, Any]) -> Dict[str, float]:
    """lm-eval's results -> {eval/<task>/<metric>: value} (numbers only; stderr 'N/A' is left out)."""
    out: Dict[str, float] = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            if "," not in key or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            metric, _, filt = key.partition(",")
            name = f"eval/{task}/{metric}" + ("" if filt == "none" else f"/{filt}")
            if math.isfinite(float(value)) or not metric.endswith("_stderr"):
                out[name] = float(value)
    return out


class RandomStates:
    """Python's, numpy's and torch's (CPU and CUDA) generators, restored on exit."""

    def __enter__(self):
        self.py, self.np, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return self

    def __exit__(self, *exc):
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        return False


class DownstreamEval:
    """eval.tasks every eval.every steps on the live model (tasks built once, at construction)."""

    def __init__(self, lm, loaded_tasks: Dict[str, Any], every: int, limit: int, model_parts=()):
        self.lm = lm
        self.tasks = loaded_tasks
        self.every = every
        self.limit = limit
        self.model_parts = list(model_parts)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def run(self) -> Dict[str, float]:
        """eval/<task>/<metric> and eval/seconds (same on every rank; collective)."""
        start = time.perf_counter()
        modes = [part.training for part in self.model_parts]
        for part in self.model_parts:
            part.eval()
        try:
            with RandomStates(), torch.no_grad():
                results = evaluate_tasks(self.lm, self.tasks, self.limit)
        finally:
            for part, mode in zip(self.model_parts, modes):
                part.train(mode)
        row = metric_rows(results or {})
        row["eval/seconds"] = time.perf_counter() - start
        return row
