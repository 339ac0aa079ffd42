"""The node-local checkpoint tier (checkpoint.local_dir): the ranks' agreement on the step to
restore and where each rank's state comes from (pure), one rank's save / restore on a real
native engine (one process, no peer), and the replica ring of three one-rank "nodes" (gloo), where
each rank's peer and source differ, states differ in size and span several chunks. The training
job that loses a node and resumes from its peers' replicas runs on the SLURM dev cluster
(tests/test_slurm_multinode.py, the spare-node job: two nodes, so there peer and source coincide)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.checkpoint.manager import rng_state
from launcher.checkpoint import local_tier
from launcher.runtime.dist import exit_after_shutdown
from launcher.checkpoint.local_tier import Held, LocalTier, Source, agree, peer_of


def _own(rank, *steps):
    return [Held(rank, s, False, 100 + rank) for s in steps]


def _replica(rank, *steps):
    return [Held(rank, s, True, 100 + rank) for s in steps]


def test_the_peer_is_the_same_local_rank_on_the_next_node_and_the_last_node_wraps_to_the_first():
    assert [peer_of(r, 2, 6) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [peer_of(r, 4, 4) for r in range(4)] == [0, 1, 2, 3]  # one node: no peer (no replica)


def test_a_lost_nodes_ranks_get_their_state_from_the_replicas_on_the_surviving_node():
    # 2 nodes x 2 ranks; node 2 (ranks 2, 3) was lost and its ranks run on a spare with an empty disk.
    # Node 1 keeps its own files and the replicas ranks 2 and 3 sent it, of steps 10 and 12.
    node1 = _own(0, 10, 12) + _own(1, 10, 12) + _replica(2, 10, 12) + _replica(3, 10, 12)
    agreement = agree(4, [node1, node1, [], []])
    assert agreement.step == 12
    assert agreement.sources == {0: Source(0, 0, False, 100), 1: Source(1, 1, False, 101),
                                 2: Source(2, 0, True, 102), 3: Source(3, 0, True, 103)}


def test_the_newest_step_every_rank_can_restore_wins_and_a_rank_missing_everywhere_means_an_older_one():
    node1 = _own(0, 10, 12) + _own(1, 10, 12) + _replica(2, 10) + _replica(3, 10, 12)
    node2 = _own(2, 10) + _own(3, 10, 12) + _replica(0, 10, 12) + _replica(1, 10, 12)
    # Rank 2's step 12 was written nowhere (it died while saving): step 10 for everyone.
    assert agree(4, [node1, node1, node2, node2]).step == 10
    assert agree(4, [node1, node1, [], []]).step == 10  # and node 2 lost too
    assert agree(4, [_own(0, 10), [], [], []]) is None  # ranks 1-3 have nothing anywhere
    assert agree(2, [[], []]) is None


def test_a_rank_reads_its_own_file_when_it_has_one_and_no_bytes_travel():
    node1 = _own(0, 8) + _own(1, 8) + _replica(2, 8) + _replica(3, 8)
    node2 = _own(2, 8) + _own(3, 8) + _replica(0, 8) + _replica(1, 8)
    agreement = agree(4, [node1, node1, node2, node2])
    assert all(src.holder == rank and not src.replica for rank, src in agreement.sources.items())
    # Ranks moved to other nodes (node 1 failed, a spare and node 2 run ranks 0-1 and 2-3 as before,
    # but node 2 now hosts ranks 0-1): each rank's state comes from whoever holds it, own file first.
    swapped = agree(4, [node2, node2, [], []])
    assert swapped.sources[0] == Source(0, 0, True, 100) and swapped.sources[2] == Source(2, 0, False, 102)


def _tier(tmp_path, plan, node="n1"):
    return LocalTier(str(tmp_path / "local"), tmp_path / "run", node, rank=0, world_size=1, ranks_per_node=1,
                     mesh=plan.mesh.to_dict(), device=torch.device("cpu"))


def test_one_rank_restores_its_local_state_exactly_and_keeps_the_newest_two_steps(tmp_path, debug_engine, caplog):
    engine, batches, plan = debug_engine
    tier = _tier(tmp_path, plan)
    for step in (1, 2, 3):
        engine.train_step(batches.for_step(step))
        tier.save(step, engine, {"samples_consumed": 2 * step, "world_size": 1}, rng_state())
    assert sorted(h.step for h in tier.listing()) == [2, 3]  # LOCAL_KEEP newest
    assert not list(tier.folder.rglob(".*.tmp"))  # written by rename: no temporary left
    after_3 = engine.train_step(batches.for_step(4)).loss
    engine.train_step(batches.for_step(5))  # moves the state on; the restore must undo it
    # Not newer than the shared checkpoint of step 3: the shared one is used.
    assert tier.restore(3, engine) is None
    restored = tier.restore(2, engine)
    assert restored["trainer"]["step"] == 3 and restored["agreement"].step == 3
    assert restored["trainer"]["samples_consumed"] == 6 and "python" in restored["rng"]
    assert engine.train_step(batches.for_step(4)).loss == after_3  # step 4 again, from step 3's state
    # A run resumed at step 2 drops the later local step (another timeline from then on).
    tier.forget_newer(2)
    assert sorted(h.step for h in tier.listing()) == [2]
    # Another layout of the same run finds nothing to restore, and says why.
    other = LocalTier(str(tmp_path / "local"), tmp_path / "run", "n1", rank=0, world_size=1, ranks_per_node=1,
                      mesh={**plan.mesh.to_dict(), "tp": 2}, device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="launcher.checkpoint.local_tier"):
        assert other.restore(-1, engine) is None
    assert "ignoring node-local states of another layout" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_of(rank: int, step: int) -> bytes:
    """A rank's serialized state: sizes differ per rank and span several CHUNK_BYTES."""
    return bytes([rank, step]) * (700 + 450 * rank)


def _ring_worker(rank: int, port: int, folder: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    local_tier.CHUNK_BYTES = 1000  # a state travels in several chunks

    def tier(node: str) -> LocalTier:
        return LocalTier(folder, Path(folder) / "run", node, rank=rank, world_size=3, ranks_per_node=1,
                         mesh={"dp_shard": 3}, device=torch.device("cpu"))

    try:
        # Nodes a, b, c (one rank each): rank r keeps the replica of rank r - 1.
        saving = tier("abc"[rank])
        for step in (2, 4, 6):
            saving.save_bytes(step, _state_of(rank, step))
        dist.barrier()
        # Node b is lost; its rank runs on the spare d, whose disk is empty.
        agreement, data = tier("adc"[rank]).restore_bytes(shared_step=3)
        out[rank] = (agreement.step, agreement.sources[rank], data == _state_of(rank, 6))
    except BaseException:
        dist.destroy_process_group()
        raise
    exit_after_shutdown()


@pytest.mark.multiprocess
def test_a_lost_node_in_a_ring_of_three_is_restored_from_the_next_nodes_replica(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        # forkserver: torch is imported once, by the server, and the workers are forked from a
        # process without threads (a spawn re-imports torch thrice; a fork of this process copies
        # whatever its threads held)
        mp.start_processes(_ring_worker, args=(_free_port(), str(tmp_path), out), nprocs=3, join=True,
                           start_method="forkserver")
        out = dict(out)
    # Rank 1's state came from node c, where rank 2 kept it; the others read their own files.
    assert out == {0: (6, Source(0, 0, False, len(_state_of(0, 6))), True),
                   1: (6, Source(1, 2, True, len(_state_of(1, 6))), True),
                   2: (6, Source(2, 2, False, len(_state_of(2, 6))), True)}, out
    run = next(tmp_path.glob("run-*"))
    on_c = sorted(p.name for p in run.glob("c/*/step_00000006/*"))
    assert on_c == ["rank_00002.pt", "replica_of_rank_00001.pt"]
    assert sorted(p.name for p in run.glob("a/*/step_*")) == ["step_00000004", "step_00000006"]  # the newest two
