"""Muon for the hidden matrices and AdamW for the rest, in one optimizer, on sharded parameters.

`MuonWithAdamW` holds every group of `launcher/plan/decide/optim_groups.py` (one LR schedule
multiplies them all; one state dict for the checkpoint). AdamW groups are stepped by a
`torch.optim.AdamW` sharing the same group dicts and state. Muon groups follow
`torch.optim.Muon` step for step, with Newton-Schulz on whole matrices whatever the layout:

1. momentum and Nesterov are elementwise, so they run on each rank's shard (the momentum buffer
   stays sharded like its parameter, and is checkpointed and resharded as AdamW's moments are);
2. each matrix has one owner among the ranks that split it (the mesh dimensions of FSDP2 / HSDP's
   shard dimension and TP; a 3-D expert weight keeps its expert-parallel Shard(0): its experts'
   matrices stay on their EP rank), chosen by Newton-Schulz cost (`assign_owners`);
3. every rank sends its shard of each matrix's update to that owner only, the owner orthogonalises
   it with torch's own `_zeropower_via_newtonschulz` (bf16) and sends each rank its shard of the
   result back (`launcher/engines/muon_exchange.py`: one all_to_all per bucket and direction, in
   bf16, the next bucket's gather in flight while the current one is orthogonalised).

Per rank and step, with T the fp32 bytes of the Muon matrices split over N ranks, that receives
about (N-1)/N x T/N, where an all-gather plus a reduce-scatter receives 2 (N-1)/N x T.
The rehearsals (fake tensors or a fake process group) and a Partial update take the older path,
`_GatherPlan.orthogonalise`: an all-gather to every rank, the owner's result reduce-scattered (a sum with zeros).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over TP's dim 0; not a Shard
from torch.optim._muon import EPS, _adjust_lr, _zeropower_via_newtonschulz  # torch >= 2.9: the reference maths

from launcher.engines.muon_exchange import Exchange, Item, exchange_and_orthogonalise
from launcher.engines.optim import mesh_key
from launcher.models.init import canonical_name
from launcher.plan.decide.optim_groups import Assignment, assign_groups
from launcher.plan.estimate.muon import assign_owners, ns_flops


def named_full_shapes(module: nn.Module) -> List[Tuple[str, Tuple[int, ...], nn.Parameter]]:
    """(canonical name, full shape, parameter) of every trainable parameter, in module order.
    The full shape is the DTensor's global shape (or DeepSpeed's ``ds_shape``)."""
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad:
            out.append((canonical_name(name), tuple(getattr(p, "ds_shape", p.shape)), p))
    return out


def group_assignment(module: nn.Module, optim_cfg) -> Assignment:
    """The module's parameters assigned to `optim.groups` / the defaults of `optim.name`."""
    return assign_groups([(n, s) for n, s, _ in named_full_shapes(module)], optim_cfg)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon groups (``group["optimizer"] == "muon"``) and AdamW groups in one optimizer."""

    def __init__(self, groups: List[Dict], *, betas: Tuple[float, float], eps: float,
                 momentum: float, nesterov: bool, ns_steps: int, ns_coefficients: Sequence[float],
                 adjust_lr: str, adamw_flags: Optional[Dict[str, bool]] = None,
                 names: Optional[Dict[torch.Tensor, str]] = None):
        muon = dict(momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                    ns_coefficients=tuple(float(c) for c in ns_coefficients), adjust_lr=adjust_lr, ns_eps=EPS)
        # Muon's keys on Muon groups only: AdamW's own defaults (its eps) must reach its groups.
        groups = [{**muon, **g} if g["optimizer"] == "muon" else g for g in groups]
        super().__init__(groups, {})
        adamw_groups = [g for g in self.param_groups if g["optimizer"] == "adamw"]
        # The same group dicts: the LR schedule's writes reach AdamW; the same state: one state dict.
        self._adamw = (torch.optim.AdamW(adamw_groups, betas=betas, eps=eps, **(adamw_flags or {}))
                       if adamw_groups else None)
        self._bind_adamw()
        # Filled by step(): (sum of squared applied updates on the device, element count) per optimizer kind.
        self.update_sq: Dict[str, Tuple[torch.Tensor, float]] = {}
        self._adamw_steps: Optional[int] = None  # AdamW's step count, read from its state once (one host sync)
        # The matrices this rank orthogonalised in the last step: (parameter name, matrix index, NS FLOPs).
        self.ns_work: List[Tuple[str, int, float]] = []
        self._names = names or {}
        # (bytes received from other ranks by the last step's exchange, what an all-gather +
        # reduce-scatter of the same updates would receive): bench/muon.py reports both.
        self.exchange_bytes: Tuple[int, int] = (0, 0)
        self._exchanges: Dict[Tuple[int, Tuple[int, ...]], Exchange] = {}  # (id(param), owners) -> routes

    def _bind_adamw(self) -> None:
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if g["optimizer"] == "adamw"]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        """torch's load builds new group dicts and a new state: share them with AdamW again."""
        super().load_state_dict(state_dict)
        self._bind_adamw()
        self._adamw_steps = None

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step of the AdamW groups and one Muon step of the Muon groups."""
        if closure is not None:
            raise ValueError("MuonWithAdamW takes no closure")
        self.update_sq = {}
        if self._adamw is not None:
            self._adamw.step()
            self.update_sq["adamw"] = self._adamw_update_sq()
        muon_groups = [g for g in self.param_groups if g["optimizer"] == "muon"]
        if muon_groups:
            self.update_sq["muon"] = self._muon_step(muon_groups)
        return None

    # ------------------------------------------------------------------ AdamW's update size
    def _adamw_update_sq(self) -> Tuple[torch.Tensor, float]:
        """(sum of squares, count) of AdamW's last applied update without decay, lr m^ / (sqrt(v^) + eps),
        recomputed from its moments (no copy of the parameters; one elementwise pass over them)."""
        stepped = [(g, p) for g in self._adamw.param_groups for p in g["params"] if "exp_avg" in self.state.get(p, {})]
        if not stepped:
            return torch.zeros(()), 0.0
        # Every AdamW parameter steps together: one count for all (read once, then counted here).
        t = self._adamw_steps = (int(float(self.state[stepped[0][1]]["step"])) if self._adamw_steps is None
                                 else self._adamw_steps + 1)
        sq, n = None, 0.0
        for g, p in stepped:
            b1, b2 = g["betas"]
            st = self.state[p]
            m, v = _local(st["exp_avg"]), _local(st["exp_avg_sq"])
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_() + g["eps"])
            part = u.float().square().sum() * float(g["lr"]) ** 2
            sq, n = (part if sq is None else sq + part.to(sq.device)), n + u.numel()
        return sq, n

    # ------------------------------------------------------------------ Muon
    def _muon_step(self, groups: List[Dict]) -> torch.Tensor:
        work = []  # (group, param, update) in group order: identical on every rank of this model part
        for g in groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - g["momentum"])
                update = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                work.append((g, p, update))
        plans = [_GatherPlan.of(p) for _, p, _ in work]
        # Owners: one LPT assignment per group of ranks, carried across parameters so a rank's
        # total over the step is balanced (the same lists on every rank: the same answer).
        loads: Dict[int, List[float]] = {}
        owners: List[List[int]] = []
        for (g, p, _), plan in zip(work, plans):
            costs = [ns_flops(*plan.matrix_shape, g["ns_steps"])] * plan.n_local_matrices
            owners.append(assign_owners(costs, plan.n_owners,
                                        loads.setdefault(plan.n_owners, [0.0] * plan.n_owners)))
        # Newton-Schulz on whole matrices: sharded matrices go to their owner and back in bucketed,
        # overlapped all_to_alls (launcher/engines/muon_exchange.py); the rest is done here.
        results: List[Optional[torch.Tensor]] = [None] * len(work)
        done_by: List[List[int]] = [[] for _ in work]
        items: List[Tuple[int, Item]] = []
        for k, ((g, p, update), plan, own) in enumerate(zip(work, plans, owners)):
            if plan.exchanges(update):
                ex = self._exchange(p, update, plan, own)
                items.append((k, Item(update, ex, _ns_of(g))))
                done_by[k] = ex.owned
            else:
                results[k], done_by[k] = plan.orthogonalise(update, own, g)
        self.exchange_bytes = exchange_and_orthogonalise([it for _, it in items])
        for k, it in items:
            results[k] = it.result
        sq, n = torch.zeros(()), 0.0
        self.ns_work = []
        for (g, p, update), plan, ortho, done in zip(work, plans, results, done_by):
            flops = ns_flops(*plan.matrix_shape, g["ns_steps"])
            self.ns_work += [(self._names.get(p, ""), plan.first_matrix + i, flops) for i in done]
            lr = float(g["lr"])
            adjusted = _adjust_lr(lr, g["adjust_lr"], torch.Size(plan.matrix_shape))
            p.mul_(1 - lr * g["weight_decay"])
            p.add_(ortho, alpha=-adjusted)
            local = _local(ortho)
            part = local.float().square().sum() * adjusted ** 2
            sq, n = (part if n == 0 else sq + part.to(sq.device)), n + local.numel()
        return sq, n

    def _exchange(self, p: torch.Tensor, update: DTensor, plan: "_GatherPlan", owners: List[int]) -> Exchange:
        """The routes of `p`'s matrices to `owners` and back, built once (one all-gather of a code
        tensor) and kept while the owners stay the same."""
        key = (id(p), tuple(owners))
        if key not in self._exchanges:
            self._exchanges[key] = Exchange(update, plan.gather, plan.owner_dims, owners,
                                            plan._my_owner_index(), plan.matrix_shape)
        return self._exchanges[key]


def _ns_of(group: Dict):
    coeffs, steps, eps = group["ns_coefficients"], group["ns_steps"], group["ns_eps"]
    return lambda m: _zeropower_via_newtonschulz(m, coeffs, steps, eps)


class _GatherPlan:
    """How one parameter's update reaches whole matrices and back."""

    def __init__(self, p: torch.Tensor, gather: Optional[list], owner_dims: Tuple[int, ...]):
        self.p = p
        self.gather = gather  # placements holding whole matrices (None: a plain tensor, already whole)
        self.owner_dims = owner_dims  # mesh dims whose ranks share the matrices (owners are chosen among them)
        shape = tuple(p.shape)
        self.matrix_shape = shape[-2:]
        self.is_stack = len(shape) == 3
        mesh = getattr(p, "device_mesh", None)
        self.n_owners = 1
        for d in owner_dims:
            self.n_owners *= mesh.size(d)
        experts = shape[0] if self.is_stack else 1
        self.first_matrix = 0
        if gather is not None and self.is_stack and any(isinstance(pl, Shard) for pl in gather):
            # The expert dimension stays split (over EP, or by FSDP's Shard(0)): this rank's block of
            # experts, uneven included (3 experts over 4 ranks: 1, 1, 1, 0), and the global index of
            # its first one, from DTensor's own offsets.
            experts, self.first_matrix = _expert_block(p, gather)
        self.n_local_matrices = experts

    @classmethod
    def of(cls, p: torch.Tensor) -> "_GatherPlan":
        if not isinstance(p, DTensor):
            return cls(p, None, ())
        gather, owner_dims = [], []
        for d, pl in enumerate(p.placements):
            # A plain Shard(0) of an expert stack splits experts, not matrices: keep it.
            if p.ndim == 3 and type(pl) is Shard and pl.dim == 0:
                gather.append(pl)
            elif pl.is_shard() or isinstance(pl, _StridedShard) or pl.is_partial():
                gather.append(Replicate())
                owner_dims.append(d)
            else:
                gather.append(Replicate())
        return cls(p, gather, tuple(owner_dims))

    def exchanges(self, update: torch.Tensor) -> bool:
        """Whether the update goes to its owners by all_to_all (muon_exchange): a DTensor whose
        matrices are split over some mesh dimensions by Shard placements (not Partial), with real
        values moved by a real process group. The rehearsals (fake tensors, or real tensors on
        torch's fake process group, whose collectives leave garbage: the routes would be garbage
        too) take the all-gather path below, as do Partial updates."""
        return (self.gather is not None and bool(self.owner_dims)
                and not any(pl.is_partial() for pl in update.placements)
                and not is_fake(update.to_local())
                and dist.get_backend(update.device_mesh.get_group(self.owner_dims[0])) != "fake")

    def _my_owner_index(self) -> int:
        if not self.owner_dims:
            return 0
        mesh = self.p.device_mesh
        coord = mesh.get_coordinate()
        index = 0
        for d in self.owner_dims:
            index = index * mesh.size(d) + coord[d]
        return index

    def orthogonalise(self, update: torch.Tensor, owners: List[int], group: Dict) -> Tuple[torch.Tensor, List[int]]:
        """(The orthogonalised update placed like the parameter, the local matrices this rank
        orthogonalised)."""
        coeffs, steps, eps = group["ns_coefficients"], group["ns_steps"], group["ns_eps"]
        if self.gather is None:  # a plain tensor holds its whole matrices (one rank, or replicated)
            return _ns(update, coeffs, steps, eps, self.is_stack).to(update.dtype), list(range(self.n_local_matrices))
        mesh = self.p.device_mesh
        whole = update.redistribute(mesh, self.gather).to_local()
        mine = self._my_owner_index()
        out = torch.zeros_like(whole)
        mats = whole if self.is_stack else whole.unsqueeze(0)
        outs = out if self.is_stack else out.unsqueeze(0)
        done = [i for i in range(mats.shape[0]) if owners[i] == mine]
        for i in done:
            outs[i] = _zeropower_via_newtonschulz(mats[i], coeffs, steps, eps).to(out.dtype)
        # Non-owners hold zeros: the sum over the owner dims is the owner's result, exactly.
        contrib = [Partial() if d in self.owner_dims else pl for d, pl in enumerate(self.gather)]
        dt = DTensor.from_local(out, mesh, contrib, run_check=False, shape=update.shape, stride=update.stride())
        return dt.redistribute(mesh, self.p.placements), done


def _ns(update: torch.Tensor, coeffs, steps: int, eps: float, stack: bool) -> torch.Tensor:
    if not stack:
        return _zeropower_via_newtonschulz(update, coeffs, steps, eps)
    return torch.stack([_zeropower_via_newtonschulz(m, coeffs, steps, eps) for m in update.unbind(0)])


def _expert_block(p: DTensor, placements: list) -> Tuple[int, int]:
    """(experts, index of the first) of this rank's block of an expert stack split on dim 0
    (DTensor's own shapes and offsets)."""
    with unset_fake_temporarily():  # the mesh's rank ids are real even when the rehearsal fakes tensors
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    return int(shape[0]), int(offset[0])


def _expert_offset(p: DTensor, placements: list) -> int:
    """Index of this rank's first expert (the name before `_expert_block`; kept for its callers)."""
    return _expert_block(p, placements)[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_muon_with_adamw(module: nn.Module, cfg, adamw_flags: Dict[str, bool]) -> MuonWithAdamW:
    """The optimizer of `cfg` (an OptimConfig with optim.muon and optim.groups) over `module`."""
    assignment = group_assignment(module, cfg)
    params = [p for _, _, p in named_full_shapes(module)]
    groups = []
    for i, choice in enumerate(assignment.groups):
        # One torch group per device mesh, as `param_groups` does: the foreach / fused kernels cannot
        # batch DTensors of different meshes (experts live on their own mesh under EP).
        by_mesh: Dict[object, List[torch.Tensor]] = {}
        for j, (_, _, g) in enumerate(assignment.members):
            if g == i:
                by_mesh.setdefault(mesh_key(params[j]), []).append(params[j])
        for members in by_mesh.values():
            groups.append({"params": members, "optimizer": choice.optimizer, "lr": choice.lr,
                           "weight_decay": choice.weight_decay, "label": choice.label})
    m = cfg.muon
    names = {p: n for n, _, p in named_full_shapes(module)}
    return MuonWithAdamW(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, momentum=m.momentum,
                         nesterov=m.nesterov, ns_steps=m.ns_steps, ns_coefficients=m.ns_coefficients,
                         adjust_lr=m.adjust_lr, adamw_flags=adamw_flags, names=names)


# optim/<kind>/update_rms, in this order in the [sum of squares, count] pairs of `update_square_sums`.
UPDATE_KINDS = ("muon", "adamw")


def update_square_sums(optimizers: Sequence[torch.optim.Optimizer], device: torch.device) -> Optional[torch.Tensor]:
    """[sum of squares, count] per kind of UPDATE_KINDS over this rank's optimizers' last step, as
    one tensor to all-reduce (None when no optimizer is a MuonWithAdamW: plain AdamW reports none)."""
    grouped = [o for o in optimizers if isinstance(o, MuonWithAdamW)]
    if not grouped:
        return None
    out = torch.zeros(2 * len(UPDATE_KINDS), dtype=torch.float32, device=device)
    for o in grouped:
        for k, kind in enumerate(UPDATE_KINDS):
            if kind in o.update_sq:
                sq, n = o.update_sq[kind]
                out[2 * k] += sq.to(device)
                out[2 * k + 1] += n
    return out


def update_rms_metrics(sums: torch.Tensor) -> Dict[str, torch.Tensor]:
    """optim/muon/update_rms and optim/adamw/update_rms from the all-reduced `update_square_sums`:
    the RMS of the step each optimizer applied (learning rate included, weight decay not), over
    every element of every rank's shards. Kept on the device: StepStats reads them at log steps."""
    out = {}
    for k, kind in enumerate(UPDATE_KINDS):
        sq, n = sums[2 * k], sums[2 * k + 1]
        out[f"optim/{kind}/update_rms"] = torch.sqrt(sq / torch.clamp(n, min=1.0))
    return out


def optimizer_group_lrs(optimizers: Sequence[torch.optim.Optimizer]) -> Dict[str, float]:
    """The learning rate of each named group this step (MuonWithAdamW only): optim/muon/lr and
    optim/adamw/lr for the defaults, optim/groups.<i>/lr for the i-th optim.groups entry."""
    out: Dict[str, float] = {}
    for o in optimizers:
        if not isinstance(o, MuonWithAdamW):
            continue
        for g in o.param_groups:
            label = g.get("label", "")
            key = (f"optim/groups.{label.split('[', 1)[1].split(']', 1)[0]}/lr" if label.startswith("optim.groups[")
                   else f"optim/{g['optimizer']}/lr")
            # AdamW's no-decay group shares optim/adamw/lr: the decayed group's rate is the same
            out.setdefault(key, float(g["lr"]))
    return out
