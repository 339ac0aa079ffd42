"""What the training loop tells the run's health tools: steps done, long phases, saves.

One small object the loop holds, so the loop needs three calls, not one per tool: it keeps
the failure bundle's progress current (last step, last checkpoint, phase) and feeds the hang
watchdog when one runs (trainer.hang_timeout_s != 0) and the OOM memory snapshot.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

from launcher.resilience.failure import FailureBundle
from launcher.observe.memory_snapshot import MemorySnapshot, is_oom
from launcher.resilience.watchdog import HangWatchdog


class RunHealth:
    def __init__(self, bundle: FailureBundle, watchdog: Optional[HangWatchdog] = None,
                 memory: Optional[MemorySnapshot] = None):
        self.bundle = bundle
        self.watchdog = watchdog
        self.memory = memory

    def step_done(self, step: int) -> None:
        self.bundle.progress.last_step = step
        if self.watchdog is not None:
            self.watchdog.beat(step)
        if self.memory is not None:
            self.memory.step_done(step)

    def on_exception(self, err: BaseException) -> None:
        """An exception is ending the rank: OOM evidence first (the caller re-raises it)."""
        if self.memory is not None and is_oom(err):
            self.memory.dump(self.bundle.progress.last_step + 1)

    def saved(self, step: int, path: Optional[Path]) -> None:
        """A checkpoint of `step` is complete (the last good one a failure summary names)."""
        if path is not None:
            self.bundle.progress.last_checkpoint = str(path)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A long phase (save, validation, resume) with its own hang bound."""
        if self.watchdog is None:
            previous = self.bundle.progress.phase
            self.bundle.progress.phase = name
            try:
                yield
            finally:
                self.bundle.progress.phase = previous
            return
        with self.watchdog.phase(name):
            yield

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
