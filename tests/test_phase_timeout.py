"""cluster.collective_timeout_s applies to every group, but not to long single-rank phases.

Two real gloo processes, set up by the rank runtime's init_distributed with a collective
timeout of COLLECTIVE_TIMEOUT_S:
1. they save a real checkpoint (CheckpointManager.save) while rank 0 publishes it for longer
   than that timeout (its `publish` slowed down): rank 1 waits in the save's closing barrier.
   The save must finish on both ranks: checkpoint waits go through the phase group
   (launcher/parallel/phase.py);
2. in a group created afterwards without a timeout (as DeviceMesh creates FSDP's and TP's
   groups), rank 1 waits for rank 0, which never comes: the wait must fail after the collective
   timeout, not torch's 30-minute default.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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


def _save_with_slow_publish(rank: int, root: str, port: int, result_dir: str) -> None:
    from launcher.parallel.phase import init_phase_group, phase_timeout_s
    from launcher.checkpoint import manager as checkpoint
    from launcher.runtime.dist import init_distributed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
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

    group = dist.new_group([0, 1])  # no timeout given, like DeviceMesh's groups
    if rank == 0:
        time.sleep(SLOW_PUBLISH_S)  # a frozen peer
        outcome = "slept"
    else:
        try:
            dist.barrier(group=group)
            outcome = "barrier passed"
        except RuntimeError as err:
            outcome = "timed out" if "Timed out" in str(err) else f"failed: {str(err).splitlines()[0]}"
    Path(result_dir, f"group_rank_{rank}.txt").write_text(outcome)
    os._exit(0)  # no teardown: after a timeout, gloo's destroy can hang


def test_single_rank_phases_outlast_the_collective_timeout_and_other_groups_keep_it(tmp_path):
    root, results = tmp_path / "checkpoints", tmp_path / "results"
    results.mkdir()
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(
        _save_with_slow_publish, args=(str(root), port, str(results)),
        nprocs=2, join=True, start_method="spawn",
    )
    outcomes = [(results / f"rank_{r}.txt").read_text() for r in (0, 1)]
    assert outcomes == ["saved step_00000004", "saved step_00000004"], outcomes
    assert (root / "step_00000004").is_dir()
    # ... while a wait in any other group still ends after the collective timeout.
    assert (results / "group_rank_1.txt").read_text() == "timed out"


LATE_START_S = 3 * COLLECTIVE_TIMEOUT_S
_LATE_RANK = '''
import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(float(sys.argv[1]))  # this rank's node is slow to start (a shared file system, a busy host)
from launcher.runtime.dist import exit_after_shutdown, init_distributed
import torch.distributed as dist
init_distributed("cpu", timeout_s=int(sys.argv[2]), startup_timeout_s=int(sys.argv[3]))
dist.barrier()
open(os.path.join(sys.argv[4], "joined_" + os.environ["RANK"]), "w").close()  # a file each: no interleaved output
exit_after_shutdown(0)
'''


def test_ranks_starting_further_apart_than_the_collective_timeout_join_under_torchrun(tmp_path):
    """Under torchrun, a rank that starts LATE_START_S after the other (more than the collective
    timeout) still joins the process group: the ranks wait for each other's start up to the
    start-up timeout, and only then does init_process_group wait with the collective timeout.
    Without that wait (start-up timeout 0) the same launch fails at init, as it did for a slow
    node of the two-node SLURM test."""
    script = tmp_path / "late_rank.py"
    script.write_text(_LATE_RANK)
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               TMPDIR=str(tmp_path))

    def launch(startup_timeout_s: int):
        out = tmp_path / f"startup_{startup_timeout_s}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
               str(LATE_START_S), str(COLLECTIVE_TIMEOUT_S), str(startup_timeout_s), str(out)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        return proc, sorted(p.name for p in out.iterdir())

    joined, files = launch(startup_timeout_s=120)
    assert joined.returncode == 0, joined.stdout[-3000:] + joined.stderr[-3000:]
    assert files == ["joined_0", "joined_1"]
    refused, files = launch(startup_timeout_s=0)
    assert refused.returncode != 0 and "DistStoreError" in refused.stdout + refused.stderr, refused.stderr[-3000:]
    assert files == []
