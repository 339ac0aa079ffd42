"""Loading off the critical path: the next step's micro-batches are read (and pinned) in a
background thread while the current step computes.

One worker thread, one step ahead: the mixture assignment advances in step order on that thread
only, and a step's batches are what `StepBatches.for_step` gives, so prefetching changes no
sample. `get(step)` returns the batches and how long the training loop waited for them
(`data_wait_ms`: ~0 when loading keeps up). An error while loading is raised by `get`, in the
training loop, with its own message.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Tuple

import torch

from launcher.data.batch import Microbatch


def pinned(mbs: List[Microbatch]) -> List[Microbatch]:
    """Page-locked copies, so the host-to-device copies can run asynchronously."""
    return [Microbatch(*(None if t is None else t.pin_memory() for t in mb)) for mb in mbs]


class Prefetcher:
    """`get(step)` for steps first..last in order, each prepared while the previous one trains."""

    def __init__(self, batches, first: int, last: int, pin: bool = False):
        self.batches = batches
        self.last = last
        self.pin = pin
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        self._pending: Dict[int, Future] = {}
        if first <= last:
            self._submit(first)

    def _load(self, step: int) -> List[Microbatch]:
        mbs = self.batches.for_step(step)
        return pinned(mbs) if self.pin else mbs

    def _submit(self, step: int) -> None:
        if step <= self.last and step not in self._pending:
            self._pending[step] = self._pool.submit(self._load, step)

    def get(self, step: int) -> Tuple[List[Microbatch], float]:
        """(this rank's micro-batches of `step`, milliseconds waited for them)."""
        t0 = time.perf_counter()
        future = self._pending.pop(step, None)
        if future is None:
            self._pending.clear()  # out of order (not expected): drop what was prepared
            future = self._pool.submit(self._load, step)
        mbs = future.result()
        waited = (time.perf_counter() - t0) * 1000.0
        self._submit(step + 1)
        return mbs, waited

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def should_pin(device_type: str) -> bool:
    return device_type == "cuda" and torch.cuda.is_available()
