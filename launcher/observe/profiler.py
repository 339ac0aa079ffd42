"""torch.profiler traces of chosen steps on chosen ranks: <run_dir>/profile/rank_<r>/step_<n>.json.

profile.steps = [first, last] (inclusive) picks the steps, profile.ranks the global ranks
(empty: rank 0 and the last pipeline rank, which holds the loss and, with 1F1B, the
longest critical path). Each step gets its own Chrome / Perfetto trace (open it in
https://ui.perfetto.dev or chrome://tracing). Memory and stack recording are off unless
asked for (profile.record_memory, profile.with_stack): they make traces large and slow.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from launcher.plan.degrees import MeshPlan

log = logging.getLogger(__name__)

PROFILE_DIR = "profile"


def default_profile_ranks(mesh: MeshPlan) -> List[int]:
    """Rank 0 and the first rank of the last pipeline stage (the same rank without pipelining)."""
    return sorted({0, mesh.rank_of({"pp": mesh.pp - 1})})


class StepProfiler:
    """Starts torch.profiler before each chosen step and writes its trace after it (this rank only)."""

    def __init__(self, run_dir: Path, rank: int, steps: Sequence[int], device_type: str,
                 record_memory: bool = False, with_stack: bool = False,
                 on_trace: Optional[Callable[[Path], None]] = None):
        self.folder = Path(run_dir) / PROFILE_DIR / f"rank_{rank}"
        self.first, self.last = int(steps[0]), int(steps[-1])
        self.device_type = device_type
        self.record_memory = record_memory
        self.with_stack = with_stack
        self.on_trace = on_trace
        self._active = None

    def wants(self, step: int) -> bool:
        return self.first <= step <= self.last

    def before_step(self, step: int) -> None:
        if not self.wants(step):
            return
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._active = profile(activities=activities, record_shapes=False,
                               profile_memory=self.record_memory, with_stack=self.with_stack)
        self._active.__enter__()

    def after_step(self, step: int) -> None:
        if self._active is None:
            return
        prof, self._active = self._active, None
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"step_{step}.json"
        prof.export_chrome_trace(str(path))
        log.info("profiler trace of step %d: %s", step, path)
        if self.on_trace is not None:
            self.on_trace(path)
