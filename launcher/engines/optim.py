"""AdamW, the LR schedule, and gradient-norm clipping that is correct for sharded grads."""

from __future__ import annotations

import math
from functools import partial
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from launcher.config.schema import ADAMW_IMPLEMENTATIONS


def mesh_key(p: torch.Tensor):
    """The identity of a DTensor parameter's device mesh (None for a plain tensor): one optimizer group
    per mesh, since foreach kernels cannot batch DTensors of different meshes."""
    mesh = getattr(p, "device_mesh", None)  # DTensor parameters carry their mesh
    if mesh is None:
        return None

    with unset_fake_temporarily():  # the rank ids are real even when the rehearsal fakes tensors
        return (tuple(mesh.mesh.flatten().tolist()), mesh.mesh_dim_names)


def param_groups(module: nn.Module, weight_decay: float) -> List[Dict]:
    """AdamW parameter groups: no weight decay on 1-D parameters (norm gains), one group per
    device mesh (experts live on a different mesh from the rest under EP) so each group can
    use the multi-tensor (foreach) kernels on GPU, which cannot batch DTensors of different
    meshes. The dimensionality is that of the full parameter (``ds_shape`` for DeepSpeed
    ZeRO-3 shards, which are flat); empty groups are dropped.
    """
    groups: Dict[Tuple, Dict] = {}
    for p in module.parameters():
        if not p.requires_grad:
            continue
        decay = len(getattr(p, "ds_shape", p.shape)) >= 2
        key = (mesh_key(p), decay)
        group = groups.setdefault(key, {"params": [], "weight_decay": weight_decay if decay else 0.0})
        group["params"].append(p)
    return list(groups.values())


def adamw_kernel_flags(implementation: str, device_type: str) -> Dict[str, bool]:
    """torch.optim.AdamW's `fused` / `foreach` arguments for ``optim.implementation``.

    auto: fused on CUDA (one kernel reads each parameter, gradient and state once; foreach makes
    several passes, which measured 15 % of a 1B model's step on an H100, docs/benchmarks.md),
    torch's own default elsewhere (fake tensors of the rehearsal and CPU runs keep it)."""
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(f"optim.implementation={implementation!r}: choose one of {', '.join(ADAMW_IMPLEMENTATIONS)}")
    if implementation == "auto":
        return {"fused": True} if device_type == "cuda" else {}
    if implementation == "fused":
        return {"fused": True}
    return {"foreach": implementation == "foreach"}


def build_adamw(module: nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW from an ``OptimConfig`` over `param_groups`, with the kernels of
    ``cfg.implementation`` (`adamw_kernel_flags`) for the device the parameters live on."""
    groups = param_groups(module, cfg.weight_decay)
    device_type = next((p.device.type for g in groups for p in g["params"]), "cpu")
    flags = adamw_kernel_flags(getattr(cfg, "implementation", "auto"), device_type)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **flags)


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, schedule: str,
              min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based optimizer step ``step``.

    Linear warm-up from lr/warmup to lr over ``warmup_steps``, then decay to
    ``min_lr_ratio * lr`` at ``total_steps`` (cosine or linear), or constant.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1 - min_lr_ratio) * progress
    raise ValueError(f"optim.schedule={schedule!r} is not one of cosine|linear|constant")


def build_scheduler(opt: torch.optim.Optimizer, cfg, total_steps: int):
    fn = partial(lr_factor, warmup_steps=cfg.warmup_steps, total_steps=total_steps,
                 schedule=cfg.schedule, min_lr_ratio=cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(opt, fn)


def _same_kind_groups(grads: List[torch.Tensor]) -> Tuple[List[List[torch.Tensor]], List[torch.Tensor]]:
    """(DTensor gradients grouped by mesh and placements, plain tensors): a foreach op takes one
    group at a time, since DTensor refuses lists that mix plain tensors or meshes (a pipeline
    stage under TP holds both)."""
    by_mesh: Dict[Tuple, List[torch.Tensor]] = {}
    plain: List[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_mesh.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
        else:
            plain.append(g)
    return list(by_mesh.values()), plain


def _sq_norm_local_view(grads: List[torch.Tensor]) -> torch.Tensor:
    """Sum of squared entries, counting every element of every full tensor once."""
    dtensor_groups, plain = _same_kind_groups(grads)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for gs in dtensor_groups:
        # The DTensor norm knows its placements: Shard dims are summed across ranks,
        # Replicate dims are counted once. full_tensor() does that reduction.
        # One foreach call per mesh: a per-tensor norm costs one DTensor dispatch per parameter.
        # In fp32, without _foreach_norm's dtype argument: torch 2.14's DTensor sharding rule for it
        # reads that argument as a dimension and fails (bench/torch_compat.sh). Gradients are fp32
        # here (FSDP2 reduces into the fp32 shards; autocast keeps fp32 parameters), so no copy is made.
        gs = [g if g.dtype == torch.float32 else g.float() for g in gs]
        n = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(gs, 2)))
        n = n.full_tensor() if isinstance(n, DTensor) else n
        total = total + n.to(device) ** 2
    for g in plain:
        total = total + torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    return total


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float,
                   pp_group: Optional[dist.ProcessGroup] = None, uncounted: Iterable[torch.Tensor] = ()) -> torch.Tensor:
    """Clip to a global L2 norm over all shards and pipeline stages; return the norm before, as a
    0-dim tensor on the gradients' device (reading it is the caller's host sync, at log steps).

    Parameters replicated across tensor-parallel ranks (plain tensors or Replicate DTensors)
    count once; pipeline stages hold disjoint parameters, so their squared norms are summed
    over ``pp_group``. ``max_norm <= 0`` only measures. The gradients are always multiplied by
    min(1, max_norm / norm), computed on the device, as torch's own clip_grad_norm_ does: deciding
    on the host whether to scale would wait for the device every step. A non-finite norm leaves
    the gradients as they are (coefficient 1): the step is skipped (launcher/engines/native.py; counted in launcher/runtime/numerics.py)
    and `first_nonfinite_grad` must still find the parameter that went wrong, not a NaN everywhere.
    `uncounted`: parameters of `params` that another stage holds too (a pipeline's last-stage copy of
    the embedding, whose gradient equals stage 0's): scaled, not counted twice.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    skip = {id(p) for p in uncounted}
    sq = _sq_norm_local_view([p.grad for p in params if id(p) not in skip])
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, group=pp_group)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
        dtensor_groups, plain = _same_kind_groups(grads)
        for group in [*dtensor_groups, plain]:
            if group:
                # one dispatch per group, not one per (DTensor) gradient; a 0-dim coefficient
                # replicates implicitly onto DTensors
                torch._foreach_mul_(group, coef.to(group[0].device))
    return norm


def first_nonfinite_grad(named_params: Iterable[Tuple[str, torch.Tensor]]) -> Optional[str]:
    """The name of the first parameter (in module order) whose local gradient shard holds a NaN or
    an inf, or None. One host read per parameter: called only once a step is skipped."""
    for name, p in named_params:
        if p.grad is None:
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if grad.numel() and not bool(torch.isfinite(grad).all()):
            return name
    return None
