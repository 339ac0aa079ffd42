"""OOM evidence: CUDA memory history for the first steps, dumped with the plan's prediction on OOM.

On CUDA, torch's allocator records every allocation with its stack for the first
trainer.memory_snapshot_steps steps of every run (0: off); recording then stops, so it costs
nothing later. When an out-of-memory error ends the rank, the snapshot (the recorded history
plus the allocator's state at the failure) goes to <run_dir>/failure/memory_snapshot_rank_<r>.pickle
(drag it into https://pytorch.org/memory_viz) and the plan's per-category prediction beside it
(memory_prediction_rank_<r>.json), so what was predicted and what was held can be compared.
The error itself is always re-raised by the caller. On CPU there is no allocator history:
only the prediction file is written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, Optional

import torch

log = logging.getLogger(__name__)

MAX_ENTRIES = 100_000  # allocation events kept (a ring): enough for a few steps of a large model


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError)


class MemorySnapshot:
    def __init__(self, failure_dir: Path, rank: int, steps: int, device_type: str,
                 predicted: Optional[Dict[str, Any]] = None):
        self.failure_dir = Path(failure_dir)
        self.rank = rank
        self.steps = steps
        self.predicted = predicted or {}
        self.recording = False
        self._cuda = device_type == "cuda" and torch.cuda.is_available()
        self._steps_seen = 0

    def start(self) -> "MemorySnapshot":
        if self._cuda and self.steps > 0:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)
            self.recording = True
        return self

    def step_done(self, step: int) -> None:
        """Stop recording after the configured number of steps (of this process)."""
        self._steps_seen += 1
        if self.recording and self._steps_seen >= self.steps:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False

    def dump(self, step: int) -> Dict[str, Optional[str]]:
        """On OOM: the snapshot pickle (CUDA) and the prediction, into the failure folder."""
        self.failure_dir.mkdir(parents=True, exist_ok=True)
        snapshot = None
        if self._cuda:
            path = self.failure_dir / f"memory_snapshot_rank_{self.rank}.pickle"
            try:
                torch.cuda.memory._dump_snapshot(str(path))
                snapshot = str(path)
            except Exception as err:  # noqa: BLE001 - evidence is best effort; the OOM is re-raised
                log.warning("could not dump the CUDA memory snapshot: %s", err)
        prediction = self.failure_dir / f"memory_prediction_rank_{self.rank}.json"
        measured = None
        if self._cuda:
            measured = {"max_allocated": torch.cuda.max_memory_allocated(),
                        "max_reserved": torch.cuda.max_memory_reserved()}
        prediction.write_text(json.dumps({
            "rank": self.rank, "step": step, "predicted": self.predicted, "measured": measured,
            "snapshot": snapshot,
            "note": None if self._cuda else "no CUDA device: allocator history is recorded on CUDA only",
        }, indent=1, default=str))
        log.error("out of memory at step %d: evidence in %s", step, self.failure_dir)
        return {"snapshot": snapshot, "prediction": str(prediction)}
