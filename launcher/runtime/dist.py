"""Process-group set-up and tear-down for one rank."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def resolve_device_type(requested: str) -> str:
    """trainer.device: auto picks cuda when this node has a GPU, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but no CUDA device is visible on this node. Fix: trainer.device=cpu or auto.")
    return requested


def init_distributed(device_type: str, timeout_s: int = 1800, cpu_collectives: bool = False,
                     startup_timeout_s: int = 0) -> RankInfo:
    """Join the process group torchrun prepared (gloo on CPU, nccl on GPU).

    cpu_collectives: on GPU, also give the groups a gloo backend for CPU tensors (FSDP2's CPU
    offload keeps gradient shards on the host, and clipping reduces their norms there).
    startup_timeout_s: how long the ranks of a torchrun launch wait for each other to start
    (wait_for_every_rank) before the process group, whose own wait for its peers is `timeout_s`.
    """
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        backend = "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        wait_for_every_rank(world, startup_timeout_s)
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device_type == "cuda" else None,
        )
    use_timeout_for_new_groups(timeout_s)
    return RankInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def wait_for_every_rank(world: int, timeout_s: int) -> None:
    """Before the process group: wait until every rank of this torchrun launch has started.

    init_process_group waits for its peers only as long as the collective timeout
    (cluster.collective_timeout_s), which is kept short to catch hangs; ranks whose starts differ
    by more (a node importing torch from a slow shared file system, an oversubscribed machine)
    would fail the launch at step 0. The ranks count themselves on torchrun's own store (the
    agent's, which every rank of a torchrun launch reaches at MASTER_ADDR:MASTER_PORT), under a
    key of this launch and restart, and wait up to `timeout_s` (0: no wait). Outside torchrun
    (no agent store) nothing waits.
    """
    if world <= 1 or timeout_s <= 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=int(timeout_s)))
    key = "launcher/started/{}/{}".format(os.environ.get("TORCHELASTIC_RUN_ID", ""),
                                           os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    started = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while started < world:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {started} of {world} ranks started within {timeout_s} s. Fix: see the missing ranks' logs "
                f"(their node may be down or still starting); the wait is the plan's phase timeout "
                f"(cluster.collective_timeout_s plus the save time, at least 1800 s).")
        time.sleep(0.05)
        started = store.add(key, 0)


def use_timeout_for_new_groups(timeout_s: int) -> None:
    """Make `timeout_s` the timeout of every group created from now on without one.

    init_process_group's timeout covers the default group only: groups made later without an
    explicit timeout (DeviceMesh's per-dimension groups, which carry FSDP's and TP's
    collectives; DeepSpeed's) get torch's module default, 30 minutes, so a frozen peer would
    hold them that long. torch reads that default from these module globals at group creation.
    """
    timeout = datetime.timedelta(seconds=int(timeout_s))
    c10d = dist.distributed_c10d
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def shutdown_distributed() -> None:
    """Leave cleanly. The barrier + destroy + gc + short sleep avoids gloo's abort at interpreter exit
    ("terminate called without an active exception"), seen on 2 of 6 plain runs without it."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
    gc.collect()
    time.sleep(0.1)


def exit_after_shutdown(code: int = 0) -> NoReturn:
    """shutdown_distributed, then end the process at once, skipping the interpreter's teardown.

    For worker processes whose results are already written (test workers under mp.spawn or
    torchrun). Workers that had written their results died of gloo's abort at exit in CI,
    failing the test: on 2026-11-26 after a barrier and destroy, on 2026-11-27 after a destroy
    alone. The abort happens in C++ destructors at interpreter exit, which os._exit skips. Call
    it only once the work succeeded, so that a failure during the work still fails the run."""
    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
