"""A long single-rank phase must not trip cluster.collective_timeout_s.

Two real gloo processes whose default group times out after COLLECTIVE_TIMEOUT_S save a real
checkpoint (CheckpointManager.save) while rank 0 publishes it for longer than that timeout
(its `publish` slowed down): rank 1 waits in the save's closing barrier. The save must finish
on both ranks, because checkpoint waits go through the phase group (launcher/parallel/phase.py).
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 2
SLOW_PUBLISH_S = 3 * COLLECTIVE_TIMEOUT_S


class TinyEngine:
    """Only what CheckpointManager.save calls: write this rank's state into a folder."""

    def __init__(self, rank: int):
        self.rank = rank

    def save(self, path: Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.full((4,), float(self.rank))}, Path(path) / f"rank_{self.rank}.pt")


def _save_with_slow_publish(rank: int, root: str, init_file: str, result_dir: str) -> None:
    from launcher.parallel.phase import init_phase_group, phase_timeout_s
    from launcher.runtime import checkpoint

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    init_phase_group(phase_timeout_s(COLLECTIVE_TIMEOUT_S))
    if rank == 0:
        publish = checkpoint.publish

        def slow_publish(tmp, final):  # rank 0 alone, e.g. a slow file system's rename + fsync
            time.sleep(SLOW_PUBLISH_S)
            publish(tmp, final)

        checkpoint.publish = slow_publish
    manager = checkpoint.CheckpointManager(Path(root), keep=2, verify_checksums=True, rank=rank, world_size=2)
    try:
        final = manager.save(4, TinyEngine(rank), {"samples_consumed": 32})
        outcome = f"saved {final.name}"
    except Exception as err:  # the test reads what happened on each rank
        outcome = f"failed: {type(err).__name__}: {str(err).splitlines()[0]}"
    Path(result_dir, f"rank_{rank}.txt").write_text(outcome)
    os._exit(0)  # no teardown: after a timeout, gloo's destroy can hang


def test_a_single_rank_phase_longer_than_the_collective_timeout_does_not_fail_the_save(tmp_path):
    root, results = tmp_path / "checkpoints", tmp_path / "results"
    results.mkdir()
    mp.start_processes(
        _save_with_slow_publish, args=(str(root), str(tmp_path / "init"), str(results)),
        nprocs=2, join=True, start_method="spawn",
    )
    outcomes = [(results / f"rank_{r}.txt").read_text() for r in (0, 1)]
    assert outcomes == ["saved step_00000004", "saved step_00000004"], outcomes
    assert (root / "step_00000004").is_dir()
