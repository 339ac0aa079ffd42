"""The node-local checkpoint tier (`checkpoint.local_dir`): frequent saves that cost little to lose.

Every `checkpoint.local_interval` steps each rank writes its own state (its local shards of the
model and optimizer, the LR schedule, its RNG, the step and the data position: what the shared
checkpoint holds for it) into one file on its node, and sends the same bytes to its peer on the
next node (rank + ranks_per_node, modulo the world size), which keeps them as a replica. A lost
node therefore loses nothing: its ranks' states are still on the next node. The shared
checkpoint (`checkpoint.dir`, every `checkpoint.interval` steps) stays the one to survive a lost
job, a new layout, or the end of the run.

Layout, per node: <local_dir>/<run key>/<node>/<layout key>/step_00000010/
    rank_00002.pt             this node's rank 2 (its own state)
    replica_of_rank_00000.pt  rank 0's state, sent by rank 0 from the previous node
The run key tells runs apart (the run folder's name and a hash of its path); the node is the
scheduler's name for it (dev-cluster nodes share one machine); the layout key is the world size
and the mesh, since a shard only fits the layout it came from. Each file is written to a
temporary name, fsynced and renamed: a file that exists is complete. Each rank keeps its files
of the newest LOCAL_KEEP steps.

Restart (checkpoint.resume=auto): the ranks list what their nodes hold, agree on the newest step
that every rank can restore (its own file, or the replica on another node, whose holder then
sends it the bytes), and use it when it is newer than the newest verified shared checkpoint.
Bytes travel on the training process group (gloo on CPU, NCCL between GPUs); the listing on the
phase group.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from launcher.parallel.phase import phase_all_gather
from launcher.checkpoint.folder import step_dir_name, step_of

log = logging.getLogger(__name__)

# Step folders kept per node (the newest, and the one before in case the newest is half-replicated).
LOCAL_KEEP = 2
# Bytes per send between ranks: on a GPU one chunk each way is staged in device memory.
CHUNK_BYTES = 64 * 2**20
_OWN = re.compile(r"^rank_(\d{5})\.pt$")
_REPLICA = re.compile(r"^replica_of_rank_(\d{5})\.pt$")


class Held(NamedTuple):
    """One rank's state at one step, as found in a node's folder."""

    rank: int  # whose state it is
    step: int
    replica: bool  # True: a copy sent by that rank from another node
    size: int


@dataclass(frozen=True)
class Source:
    """Where rank `rank` gets its state from: the file `holder` (a rank) found on its node."""

    rank: int
    holder: int
    replica: bool
    size: int


@dataclass(frozen=True)
class Agreement:
    """The step every rank restores from the local tier, and where each rank's state comes from."""

    step: int
    sources: Dict[int, Source]


def peer_of(rank: int, ranks_per_node: int, world_size: int) -> int:
    """The rank on the next node that keeps `rank`'s replica (itself when there is one node)."""
    return (rank + ranks_per_node) % world_size


def agree(world_size: int, listings: Sequence[Sequence[Held]]) -> Optional[Agreement]:
    """The newest step whose state every rank 0..world_size-1 can get, or None.

    listings[h]: what rank h found on its node (ranks of one node list the same files). Each
    rank's source is its own listing when it holds its state there (no transfer), else the
    lowest rank that holds it, preferring an own file to a replica.
    """
    holders: Dict[Tuple[int, int], List[Tuple[int, Held]]] = {}
    for holder, listing in enumerate(listings):
        for held in listing:
            if 0 <= held.rank < world_size:
                holders.setdefault((held.rank, held.step), []).append((holder, held))
    steps = {step for (_, step) in holders}
    for step in sorted(steps, reverse=True):
        if not all((rank, step) in holders for rank in range(world_size)):
            continue
        sources = {}
        for rank in range(world_size):
            found = holders[(rank, step)]
            mine = [(h, held) for h, held in found if h == rank]
            holder, held = min(mine or found, key=lambda item: (item[0] != rank, item[1].replica, item[0]))
            sources[rank] = Source(rank, holder, held.replica, held.size)
        return Agreement(step, sources)
    return None


def run_key(run_dir: Path) -> str:
    """A folder name for one run: its name (readable) and a hash of its full path (unique)."""
    path = str(Path(run_dir).resolve())
    return f"{Path(path).name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def layout_key(world_size: int, mesh: Dict[str, int]) -> str:
    """A folder name for one layout: a shard restores only into the layout that wrote it."""
    digest = hashlib.sha1(json.dumps(mesh, sort_keys=True).encode()).hexdigest()[:8]
    return f"world_{world_size}-{digest}"


def state_file_name(rank: int, replica: bool) -> str:
    """The file of `rank`'s state in a step folder: its own, or the replica its peer keeps."""
    return f"replica_of_rank_{rank:05d}.pt" if replica else f"rank_{rank:05d}.pt"


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class LocalTier:
    """Saves and restores this rank's state in its node's folder, with a replica on the next node."""

    def __init__(self, local_dir: str, run_dir: Path, node: str, *, rank: int, world_size: int,
                 ranks_per_node: int, mesh: Dict[str, int], device: torch.device):
        self.base = Path(local_dir).expanduser() / run_key(run_dir)
        self.node = node
        self.folder = self.base / node / layout_key(world_size, mesh)
        self.rank = rank
        self.world_size = world_size
        self.ranks_per_node = max(1, min(ranks_per_node, world_size))
        self.peer = peer_of(rank, self.ranks_per_node, world_size)
        self.source = (rank - self.ranks_per_node) % world_size  # whose replica this rank keeps
        self.device = device  # where the bytes travel from (NCCL sends device tensors)
        self.folder.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            if self.peer == rank:
                log.info("checkpoint.local_dir: one node, so no peer replica (a lost node loses the local tier; "
                         "the shared checkpoint remains)")
            else:
                log.info("checkpoint.local_dir: %s per node, each rank's state replicated to rank + %d",
                         self.folder, self.ranks_per_node)

    # ---------------------------------------------------------------- save
    def save(self, step: int, engine: Any, trainer_state: Dict[str, Any], rng: Dict[str, Any]) -> None:
        """Write this rank's state for `step` and its peer's replica (collective over all ranks)."""
        payload = {"step": step, "rank": self.rank, "world_size": self.world_size,
                   "engine": engine.local_state(), "trainer": dict(trainer_state, step=step), "rng": rng}
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        self.save_bytes(step, buffer.getvalue())

    def save_bytes(self, step: int, data: bytes) -> None:
        """`save` once the state is serialized: this rank's file, the exchange with the peers, pruning."""
        folder = self.folder / step_dir_name(step)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomic(folder / state_file_name(self.rank, replica=False), data)
        if self.peer != self.rank:
            replica = self._exchange(data)
            _write_atomic(folder / state_file_name(self.source, replica=True), replica)
        self._prune(self._kept_steps(step))

    def _exchange(self, data: bytes) -> bytes:
        """Send `data` to the peer and receive the source rank's bytes (the sizes first), in
        chunks of CHUNK_BYTES: a GPU holds one chunk each way, never a whole state."""
        size_out = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        size_in = torch.zeros(1, dtype=torch.int64, device=self.device)
        _wait(dist.batch_isend_irecv([dist.P2POp(dist.isend, size_out, self.peer),
                                      dist.P2POp(dist.irecv, size_in, self.source)]))
        out, got = _host_bytes(data), torch.empty(int(size_in.item()), dtype=torch.uint8)
        for start in range(0, max(out.numel(), got.numel()), CHUNK_BYTES):
            ops, received = [], None
            if start < out.numel():
                ops.append(dist.P2POp(dist.isend, out[start:start + CHUNK_BYTES].to(self.device), self.peer))
            if start < got.numel():
                received = torch.empty(min(CHUNK_BYTES, got.numel() - start), dtype=torch.uint8, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received, self.source))
            _wait(dist.batch_isend_irecv(ops))
            if received is not None:
                got[start:start + received.numel()].copy_(received.cpu())
        return got.numpy().tobytes()

    def _kept_steps(self, newest: int) -> int:
        """The oldest step kept once `newest` is written (this rank's files of older ones go)."""
        steps = sorted((s for s in self._steps() if s <= newest), reverse=True)
        return steps[min(LOCAL_KEEP, len(steps)) - 1] if steps else newest

    def _steps(self) -> List[int]:
        if not self.folder.is_dir():
            return []
        return [step for step in map(step_of, self.folder.iterdir()) if step is not None]

    def _my_files(self, step: int) -> List[Path]:
        folder = self.folder / step_dir_name(step)
        return [folder / state_file_name(self.rank, replica=False), folder / state_file_name(self.source, replica=True)]

    def _prune(self, keep_from: int) -> None:
        """Remove this rank's files of steps before `keep_from`; a step folder goes when the last
        rank's files have (the ranks of a node share the folder)."""
        for step in self._steps():
            if step >= keep_from:
                continue
            for path in self._my_files(step):
                path.unlink(missing_ok=True)
            try:
                (self.folder / step_dir_name(step)).rmdir()
            except OSError:
                pass  # other ranks' files are still there

    # ---------------------------------------------------------------- restore
    def listing(self) -> List[Held]:
        """Every complete state file in this node's folder (all ranks' files, own and replicas)."""
        found = []
        for step in self._steps():
            for path in (self.folder / step_dir_name(step)).iterdir():
                own, replica = _OWN.match(path.name), _REPLICA.match(path.name)
                match = own or replica
                if match:
                    found.append(Held(int(match[1]), step, replica is not None, path.stat().st_size))
        return found

    def _other_layouts(self) -> List[str]:
        node = self.folder.parent
        if not node.is_dir():
            return []
        return sorted(p.name for p in node.iterdir() if p.is_dir() and p.name != self.folder.name and any(p.iterdir()))

    def restore(self, shared_step: int, engine: Any) -> Optional[Dict[str, Any]]:
        """Collective: restore the local tier's newest step every rank can get when it is newer
        than `shared_step` (the newest verified shared checkpoint, -1 for none); returns the
        trainer state and this rank's RNG as {"trainer", "rng", "agreement"}, or None (use the shared one)."""
        found = self.restore_bytes(shared_step)
        if found is None:
            return None
        agreement, data = found
        payload = torch.load(io.BytesIO(data), weights_only=False)
        if payload["rank"] != self.rank or payload["step"] != agreement.step:
            raise RuntimeError(f"local checkpoint of rank {payload['rank']} step {payload['step']} given to rank "
                               f"{self.rank} for step {agreement.step}")
        engine.load_local_state(payload["engine"])
        return {"trainer": payload["trainer"], "rng": payload["rng"], "agreement": agreement}

    def restore_bytes(self, shared_step: int) -> Optional[Tuple[Agreement, bytes]]:
        """`restore` before the state is deserialized (collective): the agreement and this rank's
        bytes, or None when the local tier has no step newer than `shared_step` for every rank."""
        others = self._other_layouts()
        agreement = agree(self.world_size, phase_all_gather(self.listing()))
        if self.rank == 0 and others:
            log.info("checkpoint.local_dir: ignoring node-local states of another layout (%s): this run has "
                     "world size %d and mesh %s", ", ".join(others), self.world_size, self.folder.name)
        if agreement is None or agreement.step <= shared_step:
            if self.rank == 0 and agreement is not None:
                log.info("checkpoint.local_dir: the local tier's step %d is not newer than the shared checkpoint's "
                         "step %d: resuming from the shared tier", agreement.step, shared_step)
            return None
        return agreement, self._gather_state(agreement)

    def _gather_state(self, agreement: Agreement) -> bytes:
        """This rank's bytes for the agreed step: read here, or sent by the rank whose node holds them.

        Transfers run one by one in rank order; every rank walks the same order, so the earliest
        pending transfer always has both of its ranks waiting on it (no deadlock)."""
        mine: Optional[bytes] = None
        for source in (agreement.sources[r] for r in range(self.world_size)):
            if source.holder == source.rank:
                if source.rank == self.rank:
                    mine = self._read(agreement.step, source)
                continue
            if self.rank == source.holder:
                out = _host_bytes(self._read(agreement.step, source))
                for start in range(0, out.numel(), CHUNK_BYTES):
                    dist.send(out[start:start + CHUNK_BYTES].to(self.device), dst=source.rank)
            elif self.rank == source.rank:
                got = torch.empty(source.size, dtype=torch.uint8)
                for start in range(0, source.size, CHUNK_BYTES):
                    chunk = torch.empty(min(CHUNK_BYTES, source.size - start), dtype=torch.uint8, device=self.device)
                    dist.recv(chunk, src=source.holder)
                    got[start:start + chunk.numel()].copy_(chunk.cpu())
                mine = got.numpy().tobytes()
                log.info("rank %d: node-local state of step %d received from rank %d's node (%s)",
                         self.rank, agreement.step, source.holder, "its replica" if source.replica else "its own file")
        assert mine is not None
        return mine

    def _read(self, step: int, source: Source) -> bytes:
        return (self.folder / step_dir_name(step) / state_file_name(source.rank, source.replica)).read_bytes()

    def forget_newer(self, step: int) -> None:
        """After the run settled on `step` (before its first training step): this node's files of
        later steps belong to a replaced timeline, and a later restart must not mix them with the
        new one's. Every rank of the node may remove them; no rank writes before the next step."""
        for later in self._steps():
            if later > step:
                shutil.rmtree(self.folder / step_dir_name(later), ignore_errors=True)


def _host_bytes(data: bytes) -> torch.Tensor:
    """`data` as a uint8 tensor in host memory (a writable copy: torch refuses read-only buffers)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _wait(works: List[Any]) -> None:
    for work in works:
        work.wait()
