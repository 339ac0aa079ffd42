"""Expert parallelism: the routed experts of each MoE layer are split over ``ep`` ranks.

The expert weights [n_experts, ...] become DTensors sharded along the expert dim on the ep
mesh (rank j holds experts j*E/ep .. (j+1)*E/ep - 1), so checkpoints reshard freely between
ep layouts. The MoE layer itself is unchanged: it routes its own tokens, sorts them by
expert and calls ``experts(x_sorted, counts, sizes)``. Hooks around that call do the dispatch:

1. exchange per-expert counts with an all-to-all (each rank learns how many tokens it will
   receive for each of its experts from each peer), then read what is sent and received to
   the host with one ``.tolist()``: the layer's only host sync (the splits of step 2 and the
   experts' chunk sizes all come from it). With balanced routing (``MoE.routing``, used
   where tensors have no values) the counts are known on the host and this step is skipped;
2. all-to-all the token rows (variable splits, autograd-aware: backward sends the
   gradients back the same way);
3. regroup the received rows by local expert, run the local experts, undo the regrouping;
4. all-to-all the results back; the MoE layer combines them with the routing weights.

The ep ranks are carved out of dp_shard*cp (``launcher.parallel.device_mesh.expert_meshes``); the
experts are FSDP-sharded over the remaining dp_shard*cp/ep ranks. Expert gradients collect
every ep rank's tokens through step 2's backward, which is why data-parallel gradients are
summed (not averaged) in launcher/parallel/fsdp.py.

Experts folded over TP (an MoE model with tp > 1, ``Layout.experts_folded``): each TP rank
routes only its own tokens (launcher/models/llama/tp.py folded_moe_plan), so the ep ranks are
carved out of dp_shard*cp*tp and may include the TP ranks: every expert has one owner in its ep
group, whose tokens it computes once. The ranks holding the same expert shard (the expert
data-parallel mesh) include TP ranks too, and see different tokens: FSDP sums their gradients,
and without FSDP (no data-parallel rank) the experts are replicated DTensors over that mesh
whose gradients arrive Partial (launcher/models/moe.py ``_local``) and are summed. With ep=1 the
experts are only placed on those meshes: there is nothing to dispatch.
Capacity dropping happens before dispatch, on each rank's own tokens: the dropped rows sit
after the kept ones and stay on their rank (zero output).
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

from launcher.parallel.device_mesh import expert_grid, expert_meshes, token_group

from launcher.models.mtp import mtp_blocks

log = logging.getLogger(__name__)


def _all_to_all_rows(x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x, out_splits, in_splits, group))


class _Dispatch:
    """Input/output functions for one experts module (state lives between the two calls)."""

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.local = n_experts // self.ep
        self.rank = ep_mesh.get_local_rank()
        self.state = None

    def partition(self, name, module, mesh):
        # A 2-D mesh is (expert data-parallel ranks, ep): replicated over the first (see the module doc).
        placements = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(0)]
        for pname, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, placements)))

    def _splits(self, counts: torch.Tensor, sizes: Optional[List[int]]):
        """(send_splits, recv_matrix [source rank][local expert]) as host ints.

        Routed counts: one all-to-all of the per-expert counts, then ONE .tolist() of a
        tensor holding what this rank sends and what it receives (the layer's only host
        sync). Static counts (``sizes``, from balanced routing: every ep rank routes the same
        number of tokens the same way) need neither: each peer sends what this rank would."""
        if sizes is not None:
            send = [sum(sizes[r * self.local:(r + 1) * self.local]) for r in range(self.ep)]
            mine = sizes[self.rank * self.local:(self.rank + 1) * self.local]
            return send, [list(mine) for _ in range(self.ep)]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        host = torch.cat([counts.view(self.ep, self.local).sum(1), recv_counts]).tolist()
        send, recv = host[:self.ep], host[self.ep:]
        return send, [recv[r * self.local:(r + 1) * self.local] for r in range(self.ep)]

    def dispatch(self, module, inputs, mesh):
        x, counts = inputs[0], inputs[1].to(torch.int64)
        sizes = inputs[2] if len(inputs) > 2 else None
        send_splits, recv_rows = self._splits(counts, sizes)
        recv_splits = [sum(r) for r in recv_rows]
        n_send = sum(send_splits)  # rows after it are capacity padding: they stay here
        rows = _all_to_all_rows(x[:n_send], recv_splits, send_splits, self.group)
        # Received rows are ordered (source, expert); the experts want (expert, source).
        recv_flat = [c for r in recv_rows for c in r]
        recv_matrix = torch.tensor(recv_flat, dtype=torch.int64, device=x.device).view(self.ep, self.local)
        seg = torch.arange(self.ep * self.local, device=x.device).view(self.ep, self.local)
        seg_of_row = torch.repeat_interleave(seg.reshape(-1), recv_matrix.reshape(-1),
                                             output_size=sum(recv_splits))
        expert_of_seg = seg % self.local
        perm = torch.argsort(expert_of_seg.reshape(-1)[seg_of_row], stable=True)
        self.state = (perm, send_splits, recv_splits, x.shape[0] - n_send)
        local_sizes = [sum(r[e] for r in recv_rows) for e in range(self.local)]
        return rows[perm], recv_matrix.sum(0), local_sizes

    def combine(self, module, out, mesh):
        perm, send_splits, recv_splits, n_pad = self.state
        self.state = None
        unperm = torch.empty_like(out)
        unperm = unperm.index_copy(0, perm, out)
        back = _all_to_all_rows(unperm, send_splits, recv_splits, self.group)
        if n_pad:
            back = torch.cat([back, back.new_zeros(n_pad, back.shape[1])])
        return back


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, replica_mesh: Optional[DeviceMesh] = None) -> nn.Module:
    """Shard the routed experts of every MoE block over ``ep_mesh`` and install the dispatch.

    ``replica_mesh``: the 2-D (expert data-parallel, ep) mesh when the experts are folded over TP
    and no FSDP sums their gradients: they are placed replicated over its first dimension. With
    ep=1 (folded experts only) nothing is dispatched."""
    n = 0
    place_mesh = replica_mesh if replica_mesh is not None else ep_mesh
    for block in [*model.layers.values(), *mtp_blocks(model)]:
        moe = getattr(block, "moe", None)
        if moe is None:
            continue
        if moe.n_experts % ep_mesh.size():
            raise ValueError(
                f"model.n_experts={moe.n_experts} is not divisible by parallel.ep={ep_mesh.size()}; "
                f"choose ep among the divisors of {moe.n_experts}"
            )
        d = _Dispatch(ep_mesh, moe.n_experts)
        if ep_mesh.size() > 1:
            distribute_module(moe.experts, place_mesh, partition_fn=d.partition,
                              input_fn=d.dispatch, output_fn=d.combine)
        else:
            distribute_module(moe.experts, place_mesh, partition_fn=d.partition)
        n += 1
    log.info("applied expert parallelism (ep=%d) to %d MoE blocks: experts sharded on dim 0%s%s", ep_mesh.size(), n,
             ", all-to-all token dispatch" if ep_mesh.size() > 1 else "",
             f", replicated over {replica_mesh.shape[0]} ranks (gradients summed)" if replica_mesh is not None else "")
    return model


def apply_moe_parallel(model: nn.Module, world: DeviceMesh, *, ep: int, folded: bool, fsdp: bool) -> Optional[DeviceMesh]:
    """The MoE side of the Layout on ``world`` (launcher.parallel.device_mesh.build_device_mesh),
    after TP: expert parallelism over ``ep`` ranks, the experts folded over TP (``folded``:
    Layout.experts_folded) and the load-balancing token group. Returns the expert data-parallel
    mesh FSDP shards the routed experts over (``fsdp``: whether FSDP wraps the model), or None
    when the experts are neither sharded nor folded."""
    expert_dp = None
    if ep > 1 or folded:
        ep_mesh, expert_dp = expert_meshes(world, ep, folded)
        # Without FSDP nothing sums the gradients of an expert shard's replicas (folded: TP ranks
        # that computed other tokens): place them replicated, gradients Partial.
        grid = expert_grid(world, ep, folded) if not fsdp and expert_dp.size() > 1 else None
        apply_expert_parallel(model, ep_mesh, replica_mesh=grid)
    if world["cp"].size() * world["tp"].size() > 1:
        set_token_group(model, token_group(world).get_group())
    return expert_dp


def set_token_group(model: nn.Module, group) -> None:
    """Give every MoE layer of ``model`` the process group of the ranks holding the other slices of
    its sequences (launcher.parallel.device_mesh.token_group: cp x tp), over which its load-balancing
    losses sum their statistics (launcher/models/moe.py)."""
    for m in model.modules():
        if hasattr(m, "token_group") and hasattr(m, "router"):
            m.token_group = group
