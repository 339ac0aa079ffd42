"""FSDP2 (``fully_shard``) and HSDP for the decoder: one unit per block plus the root.

ZeRO mapping on the native path: zero_stage=3 reshards parameters after forward (params,
grads and optimizer states sharded); zero_stage=2 keeps the block's parameters gathered
between forward and backward (grads and optimizer states sharded, one all-gather per step).
ZeRO-1 and 0 are not native: the backend resolver routes them to DeepSpeed
(``backend.sharding=deepspeed``).

Gradients are SUMMED across data-parallel ranks (divide factor 1): the engine scales each
rank's loss by 1 / (tokens in the global batch), so the sum is the gradient of the mean
loss over the global batch, also for expert weights, which receive the tokens of every
expert-parallel rank through all-to-all.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from launcher.models.mtp import mtp_blocks

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


def check_zero_stage(zero_stage: int) -> None:
    """Refuse ZeRO stages the native FSDP2 path does not implement."""
    if zero_stage not in (2, 3):
        raise ValueError(
            f"parallel.zero_stage={zero_stage} is not served by native FSDP2, which implements "
            f"ZeRO-2 (parallel.zero_stage=2) and ZeRO-3 (parallel.zero_stage=3); for ZeRO-0/1 "
            f"set backend.sharding=deepspeed, or choose parallel.zero_stage=2"
        )


def mixed_precision_policy(precision: str, reduce_dtype: str = "fp32") -> MixedPrecisionPolicy:
    """bf16 (and fp8, whose non-fp8 parts run in bf16): bf16 params + reduce in reduce_dtype."""
    if precision in ("bf16", "fp8"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=_DTYPES[reduce_dtype])
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    zero_stage: int,
    mp_policy: MixedPrecisionPolicy,
    cpu_offload: bool = False,
    pin_memory: bool = False,
    expert_dp_mesh: Optional[DeviceMesh] = None,
) -> nn.Module:
    """Shard each block, then the root (embeddings, final norm, output), over ``dp_mesh``.

    ``dp_mesh``: 1-D dp_shard_cp mesh (FSDP) or 2-D (dp_replicate, dp_shard_cp) (HSDP).
    ``expert_dp_mesh``: with expert parallelism, the mesh the (already ep-sharded) routed
    experts are FSDP-sharded over; they form their own unit inside their block.
    """
    check_zero_stage(zero_stage)
    reshard = zero_stage == 3
    kw = dict(mp_policy=mp_policy, reshard_after_forward=reshard)
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    n_blocks = 0
    for block in [*model.layers.values(), *mtp_blocks(model)]:
        moe = getattr(block, "moe", None)
        if expert_dp_mesh is not None and moe is not None:
            fully_shard(moe.experts, mesh=expert_dp_mesh, shard_placement_fn=expert_shard_placement(expert_dp_mesh),
                        **kw)
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=even_shard_placement(dp_mesh), **kw)
        n_blocks += 1
    fully_shard(model, mesh=dp_mesh, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Sum, do not average: the loss is already normalised by the global token count.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    log.info(
        "applied FSDP2 to %d blocks + root on mesh %s (%s), reshard_after_forward=%s, "
        "param_dtype=%s, reduce_dtype=%s%s%s",
        n_blocks, dict(zip(dp_mesh.mesh_dim_names, dp_mesh.shape)),
        "HSDP" if dp_mesh.ndim == 2 else "FSDP", reshard, mp_policy.param_dtype,
        mp_policy.reduce_dtype, ", CPU offload" if cpu_offload else "",
        ", experts on their own mesh" if expert_dp_mesh is not None else "",
    )
    return model



def even_shard_placement(dp_mesh: DeviceMesh):
    """FSDP2's placement for a block's parameters: dim 0 (its default) unless dim 0 does not
    divide over the sharding ranks and dim 1 does (an MoE router [n_experts, dim] with fewer
    experts than ranks: dim 0 would give the first ranks a row each and the others nothing),
    so every rank holds the same bytes and the planner's per-rank figure is exact."""
    ranks = dp_mesh.shape[-1]  # the sharding dim (HSDP: (replicate, shard))

    def place(param: nn.Parameter):
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.dim() < 2 or local.shape[0] % ranks == 0 or local.shape[1] % ranks:
            return None
        return Shard(1)

    return place


def expert_shard_placement(expert_dp_mesh: DeviceMesh):
    """FSDP2's placement for the routed-expert tensors [local experts, ...]: dim 0 (its default)
    when the ep rank's experts divide over the expert data-parallel ranks, else dim 1. With
    fewer local experts than ranks (Mixtral: 8 experts, ep=8, 2 expert-dp ranks) dim 0 would
    leave the first rank the whole expert and the others nothing (found by action=rehearse)."""
    ranks = expert_dp_mesh.shape[-1]  # the sharding dim (HSDP: (replicate, shard))

    def place(param: nn.Parameter):
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.dim() < 2 or local.shape[0] % ranks == 0:
            return None
        return Shard(1)

    return place


def fsdp_modules(parts: Sequence[nn.Module]) -> List[FSDPModule]:
    """Every FSDP2 unit of the model parts (blocks, expert groups, roots)."""
    return [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]


class UnshardedAccumulation:
    """Gradient accumulation held unsharded (Layout.memory.accumulate_unsharded): one all-gather and one
    reduce-scatter of each unit per step instead of per micro-batch.

    ``before(last)`` runs before each micro-batch. Before every micro-batch but the last, the
    units skip the gradient reduce-scatter (gradients accumulate unsharded) and do not reshard
    after backward. At ZeRO-3 they also stay gathered after forward for the whole step (else
    each backward would gather them again; the root too, which apply_fsdp shards with an
    explicit reshard_after_forward). Before the last micro-batch they sync and reshard after
    backward, so the states are sharded between steps; ``after()`` restores the ZeRO stage's
    reshard-after-forward (no communication: the parameters are resharded by then).
    """

    def __init__(self, parts: Sequence[nn.Module], zero_stage: int):
        self.units = fsdp_modules(parts)
        self.reshard_after_forward = zero_stage == 3

    def before(self, last: bool) -> None:
        """Set the units for the next micro-batch (``last``: the step's final one)."""
        for m in self.units:
            # recurse=False: every unit is in the list; nested units would be set twice.
            m.set_requires_gradient_sync(last, recurse=False)
            m.set_reshard_after_backward(last, recurse=False)
            if self.reshard_after_forward:
                m.set_reshard_after_forward(False, recurse=False)

    def after(self) -> None:
        """After the last backward of the step: back to the configured resharding."""
        if self.reshard_after_forward:
            for m in self.units:
                m.set_reshard_after_forward(True, recurse=False)
