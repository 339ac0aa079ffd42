"""Muon's gather to the owner and scatter back: each matrix's update moves only to its one owner.

`launcher/engines/muon.py` decides which rank of a group of ranks (the mesh dimensions that split a
parameter's matrices) owns each matrix. Here every rank sends its shard of each matrix to that
matrix's owner, and the owner sends each rank its shard of the orthogonalised result, with one
`all_to_all` per bucket of parameters and direction:

- *which elements go where* comes from DTensor itself: once per parameter, a code tensor
  (holding rank, flat position in its local shard) is redistributed like the update would be, so
  every rank knows, for each element of the whole matrices, who holds it and where (any
  placement: Shard(0), Shard(1), FSDP over TP's `_StridedShard`, uneven shards);
- the update travels in bf16: `torch.optim.Muon`'s Newton-Schulz casts its input to bf16 first and
  returns bf16, so sending bf16 both ways changes no bit of the result and halves the bytes;
- buckets are pipelined: the next bucket's gather is in flight while the owner orthogonalises the
  current one, and each bucket's scatter back runs while the next is computed.

Per rank and step, with T the fp32 bytes of the Muon matrices split over a group of N ranks
(owners balanced so each owns about T/N): it sends (N-1)/N x T/(2N) to the owners and receives as
much, and the same again on the way back: (N-1)/N x T/N received in all, against
2 (N-1)/N x T for an all-gather plus reduce-scatter (docs/optimizers.md).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Bytes (bf16) of updates per bucket at most; the step is cut into about PIPELINE_BUCKETS buckets
# below that, so that a gather is in flight while the previous bucket is orthogonalised.
BUCKET_BYTES = 64 << 20
PIPELINE_BUCKETS = 4
_RANK_SHIFT = 40  # code = holder rank << 40 | flat position: positions below 2^40 elements

_GROUPS: Dict[Tuple[int, ...], dist.ProcessGroup] = {}


def owner_group(mesh, owner_dims: Sequence[int]) -> Tuple[dist.ProcessGroup, List[int]]:
    """(process group of the ranks sharing this rank's matrices over `owner_dims`, each owner index's
    rank in that group). Owner index: row-major over `owner_dims` (as `_GatherPlan._my_owner_index`)."""
    coord = mesh.get_coordinate()
    ranks = mesh.mesh
    # Fix this rank's coordinate on every other dimension; keep the owner dimensions, in order.
    index = tuple(slice(None) if d in owner_dims else coord[d] for d in range(mesh.ndim))
    by_owner = [int(r) for r in ranks[index].reshape(-1).tolist()]
    if len(owner_dims) == 1:
        group = mesh.get_group(owner_dims[0])
    else:
        key = tuple(sorted(by_owner))
        if key not in _GROUPS:
            # Only the members create it (under PP the other stages are busy elsewhere).
            _GROUPS[key] = dist.new_group(list(key), use_local_synchronization=True)
        group = _GROUPS[key]
    return group, [dist.get_group_rank(group, r) for r in by_owner]


Blocks = List[Tuple[int, int, int, int]]  # (offset, rows, row length, row stride) of a flat tensor


def to_blocks(index: torch.Tensor) -> Blocks:
    """A list of flat positions as strided 2-D blocks, in order: a shard's positions are runs of
    consecutive elements (a row slice of a Shard(1) matrix, a whole Shard(0) block) at a constant
    stride, so a matrix takes one block or a few instead of one int64 per element."""
    if index.numel() == 0:
        return []
    idx = index.to("cpu", torch.int64)
    breaks = torch.nonzero(idx[1:] - idx[:-1] != 1).reshape(-1) + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks]).tolist()
    ends = breaks.tolist() + [idx.numel()]
    first = idx[starts].tolist()
    blocks: Blocks = []
    for a, b, off in zip(starts, ends, first):
        length = b - a
        if blocks:
            o, rows, ln, stride = blocks[-1]
            if ln == length and (off - o >= ln if rows == 1 else off - (o + (rows - 1) * stride) == stride):
                blocks[-1] = (o, rows + 1, ln, off - o if rows == 1 else stride)
                continue
        blocks.append((off, 1, length, length))
    return blocks


def _numel(blocks: Blocks) -> int:
    return sum(rows * ln for _, rows, ln, _ in blocks)


def _take(flat: torch.Tensor, blocks: Blocks) -> List[torch.Tensor]:
    return [flat.as_strided((rows, ln), (stride, 1), flat.storage_offset() + o).reshape(-1)
            for o, rows, ln, stride in blocks]


def _put(flat: torch.Tensor, blocks: Blocks, values: torch.Tensor) -> None:
    at = 0
    for o, rows, ln, stride in blocks:
        flat.as_strided((rows, ln), (stride, 1), flat.storage_offset() + o).copy_(
            values[at:at + rows * ln].view(rows, ln))
        at += rows * ln


class Exchange:
    """One parameter's routes between its shards and its matrices' owners (fixed while the owners are).

    send[r]: blocks of this rank's flat local update holding the elements owner index r needs;
    recv[s]: blocks of the whole matrices (the gathered local frame, flat) that owner index s sends
    this rank, for the matrices this rank owns. Both in the frame's element order on both sides, so
    the sender's and the receiver's lists pair up. Kept as strided blocks (`to_blocks`): a few
    integers per matrix, not one per element."""

    def __init__(self, update: DTensor, gather: list, owner_dims: Tuple[int, ...], owners: List[int],
                 me: int, matrix_shape: Tuple[int, int]):
        mesh = update.device_mesh
        self.group, self.group_rank = owner_group(mesh, owner_dims)
        self.n = len(self.group_rank)
        self.me = me
        local = update.to_local()
        self.local_shape = tuple(local.shape)
        pos = torch.arange(local.numel(), dtype=torch.int64, device=local.device)
        code = DTensor.from_local((pos | (me << _RANK_SHIFT)).view(local.shape), mesh, update.placements,
                                  run_check=False, shape=update.shape, stride=update.stride())
        frame = code.redistribute(mesh, gather).to_local()
        self.frame_shape = tuple(frame.shape)
        flat = frame.reshape(-1)
        holder, where = flat >> _RANK_SHIFT, flat & ((1 << _RANK_SHIFT) - 1)
        per_matrix = matrix_shape[0] * matrix_shape[1]
        owner_of = torch.tensor(owners, dtype=torch.int64, device=flat.device)[
            torch.arange(flat.numel(), device=flat.device) // per_matrix]
        mine = holder == me
        self.send = [to_blocks(where[mine & (owner_of == r)]) for r in range(self.n)]
        owned = owner_of == me
        self.recv = [to_blocks(torch.nonzero(owned & (holder == s)).reshape(-1)) for s in range(self.n)]
        self.send_numel = [_numel(b) for b in self.send]
        self.recv_numel = [_numel(b) for b in self.recv]
        self.owned = [i for i, o in enumerate(owners) if o == me]
        self.frame_numel = flat.numel()
        self.matrix_shape = matrix_shape


class Item:
    """One parameter's part of a bucket: its update, its routes, and (after the scatter) its result."""

    def __init__(self, update: DTensor, exchange: Exchange, ns):
        self.update = update
        self.ex = exchange
        self.ns = ns  # a bf16 matrix -> its orthogonalised bf16 matrix (the group's Newton-Schulz)
        self.result: Optional[torch.Tensor] = None


def _buckets(items: List[Item]) -> List[List[Item]]:
    """Items cut in order into about PIPELINE_BUCKETS buckets of at most BUCKET_BYTES (bf16) each."""
    sizes = [2 * it.ex.frame_numel for it in items]
    cap = max(1, min(BUCKET_BYTES, -(-sum(sizes) // PIPELINE_BUCKETS)))
    out, cur, held = [], [], 0
    for it, size in zip(items, sizes):
        if cur and held + size > cap:
            out.append(cur)
            cur, held = [], 0
        cur.append(it)
        held += size
    return out + ([cur] if cur else [])


class _Bucket:
    """A bucket's two all_to_alls: shards to owners, results back."""

    def __init__(self, items: List[Item]):
        self.items = items
        ex0 = items[0].ex
        self.group, self.order, self.n = ex0.group, ex0.group_rank, ex0.n
        # splits by group rank (all_to_all's order), from the owner indices' lists
        self.to_owner = [0] * self.n
        self.from_holder = [0] * self.n
        for it in items:
            for k in range(self.n):
                self.to_owner[self.order[k]] += it.ex.send_numel[k]
                self.from_holder[self.order[k]] += it.ex.recv_numel[k]
        self.self_rank = self.order[ex0.me]
        self.received: Optional[torch.Tensor] = None
        self.work = None

    def _by_group_rank(self, parts_by_owner: List[List[torch.Tensor]], like: torch.Tensor) -> torch.Tensor:
        """Concatenate, in group-rank order, the per-owner-index lists of pieces."""
        chunks: List[List[torch.Tensor]] = [[] for _ in range(self.n)]
        for k in range(self.n):
            chunks[self.order[k]] = parts_by_owner[k]
        flat = [c for per in chunks for c in per]
        return torch.cat(flat) if flat else like.new_empty(0)

    def start_gather(self) -> None:
        """Send this rank's shard of every matrix to its owner (bf16; asynchronous)."""
        locals_ = [it.update.to_local().reshape(-1).bfloat16() for it in self.items]
        send = self._by_group_rank([[piece for it, u in zip(self.items, locals_) for piece in _take(u, it.ex.send[k])]
                                    for k in range(self.n)], locals_[0])
        self.received = torch.empty(sum(self.from_holder), dtype=torch.bfloat16, device=send.device)
        self.work = dist.all_to_all_single(self.received, send, self.from_holder, self.to_owner,
                                           group=self.group, async_op=True)

    def orthogonalise_and_start_scatter(self) -> None:
        """Wait for the shards, orthogonalise the owned matrices (each item's `ns`), send each rank its shard of the results (asynchronous)."""
        self.work.wait()
        # Received pieces, grouped by group rank, then by item in bucket order.
        offsets = [0] * self.n
        start = 0
        for g in range(self.n):
            offsets[g] = start
            start += self.from_holder[g]
        results = []
        for it in self.items:
            ex = it.ex
            frame = torch.empty(ex.frame_numel, dtype=torch.bfloat16, device=self.received.device)
            for k in range(self.n):
                g, m = self.order[k], ex.recv_numel[k]
                _put(frame, ex.recv[k], self.received[offsets[g]:offsets[g] + m])
                offsets[g] += m
            mats = frame.view(-1, *ex.matrix_shape)
            out = torch.empty_like(frame).view(-1, *ex.matrix_shape)
            for i in ex.owned:
                out[i] = it.ns(mats[i])
            results.append(out.reshape(-1))
        send = self._by_group_rank([[piece for it, o in zip(self.items, results) for piece in _take(o, it.ex.recv[k])]
                                    for k in range(self.n)], results[0])
        self.received = torch.empty(sum(self.to_owner), dtype=torch.bfloat16, device=send.device)
        self.work = dist.all_to_all_single(self.received, send, self.to_owner, self.from_holder,
                                           group=self.group, async_op=True)

    def finish_scatter(self) -> None:
        """Wait for the results and place them in each item's local shard (the update's dtype)."""
        self.work.wait()
        offsets, start = [0] * self.n, 0
        for g in range(self.n):
            offsets[g] = start
            start += self.to_owner[g]
        for it in self.items:
            ex = it.ex
            local = torch.empty(ex.local_shape, dtype=it.update.dtype, device=self.received.device)
            flat = local.view(-1)
            for k in range(self.n):
                g, m = self.order[k], ex.send_numel[k]
                _put(flat, ex.send[k], self.received[offsets[g]:offsets[g] + m])
                offsets[g] += m
            u = it.update
            it.result = DTensor.from_local(local, u.device_mesh, u.placements, run_check=False,
                                           shape=u.shape, stride=u.stride())
        self.received = self.work = None


def exchange_and_orthogonalise(items: List[Item]) -> Tuple[int, int]:
    """Orthogonalise every item's matrices on their owners and set each item's `result` (placed like
    its update). Buckets per process group, in the items' order (the same on every rank of a group);
    bucket k+1's gather is started before bucket k is orthogonalised, bucket k's scatter runs while
    bucket k+1 is.

    Returns (bytes this rank received from other ranks, bytes an all-gather of the same updates
    plus a reduce-scatter of the results would have had it receive: 2 x (whole - local) fp32)."""
    by_group: Dict[int, List[Item]] = {}
    for it in items:
        by_group.setdefault(id(it.ex.group), []).append(it)
    buckets = [_Bucket(b) for group_items in by_group.values() for b in _buckets(group_items)]
    if not buckets:
        return 0, 0
    buckets[0].start_gather()
    for k, b in enumerate(buckets):
        if k + 1 < len(buckets):
            buckets[k + 1].start_gather()
        b.orthogonalise_and_start_scatter()
        if k > 0:
            buckets[k - 1].finish_scatter()
    buckets[-1].finish_scatter()
    received = sum(2 * (sum(b.from_holder) + sum(b.to_owner) - b.from_holder[b.self_rank] - b.to_owner[b.self_rank])
                   for b in buckets)
    allgather = sum(2 * 4 * (it.ex.frame_numel - it.update.to_local().numel()) for it in items)
    return received, allgather
