"""The narrow, flat input of the estimators: one parallel layout plus the knobs that matter.

`Layout` is built from a spec + mesh + batch + backend choices (`layout_from_plan`) for
`action=plan`, and directly from numbers by the search, which evaluates tens of thousands
of layouts and cannot afford to build a JobConfig for each. Both paths then call the same
estimators (memory.py, perf.py), so there is one formula for each number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple


@dataclass(frozen=True)
class Layout:
    # Mesh degrees (see launcher/plan/mesh.py for the rank order: pp, dp_replicate, dp_shard, cp, tp).
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    sp: bool = False
    vpp: int = 1  # model chunks per pipeline rank
    schedule: str = "1f1b"
    pp_layers: Tuple[int, ...] = ()
    # Batch.
    micro_batch_size: int = 1
    microbatches: int = 1  # micro-batches per optimizer step on each data-parallel rank
    seq_len: int = 2048
    # Memory knobs.
    zero_stage: int = 3
    ac_mode: str = "none"  # none | selective | full
    ac_selective: str = "op"  # op | N (every N-th block fully)
    precision: str = "bf16"  # fp32 | bf16 | fp8
    reduce_dtype: str = "fp32"
    fp8_all_gather: bool = True
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_params: str = "none"
    # Who implements what (from the resolver's decision in the plan).
    sharding_backend: str = "native"  # native (FSDP2) | deepspeed (ZeRO)
    offload_backend: str = "native"  # native (FSDP2 CPUOffloadPolicy) | deepspeed (ZeRO-Offload)
    pp_backend: str = "native"
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    zeropp_quantized_weights: bool = False
    zeropp_quantized_gradients: bool = False
    zeropp_hierarchical_partition: int = 0
    gpus_per_node: int = 8

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: fp8 training keeps bf16 activations between layers."""
        return 4 if self.precision == "fp32" else 2

    @property
    def fsdp_degree(self) -> int:
        """Ranks one parameter is sharded over (ZeRO partition size) for non-expert parameters.

        Native FSDP2 shards over dp_shard * cp and replicates over dp_replicate (HSDP);
        DeepSpeed partitions over every data-parallel rank (its ZeRO group is the whole DP group).
        """
        if self.zero_stage == 0:
            return 1
        n = self.dp_shard * self.cp
        if self.sharding_backend == "deepspeed":
            n *= self.dp_replicate
        return n

    @property
    def expert_fsdp_degree(self) -> int:
        """Expert weights are split over ep first; the remaining sharding ranks shard each expert."""
        return max(1, self.fsdp_degree // self.ep) if self.zero_stage else 1

    def overrides(self) -> Dict[str, Any]:
        """The `train` overrides that select this layout (dotted key -> value)."""
        return {
            "parallel.dp_replicate": self.dp_replicate,
            "parallel.dp_shard": self.dp_shard,
            "parallel.tp": self.tp,
            "parallel.sp": self.sp,
            "parallel.pp": self.pp,
            "parallel.pp_schedule": self.schedule,
            "parallel.pp_virtual_stages": self.vpp,
            "parallel.cp": self.cp,
            "parallel.ep": self.ep,
            "parallel.zero_stage": self.zero_stage,
            "activation_checkpointing.mode": self.ac_mode,
            "trainer.micro_batch_size": self.micro_batch_size,
        }


def layout_from_plan(plan: Any, spec: Any) -> Layout:
    """Flatten a Plan (mesh, batch, backend choices) and its spec into a Layout."""
    p, mesh, batch = spec.parallel, plan.mesh, plan.batch
    backends = plan.backends

    def backend_of(feature: str, default: str = "native") -> str:
        choice = backends.get(feature)
        return choice.backend if choice is not None else default

    return Layout(
        pp=mesh.pp,
        dp_replicate=mesh.dp_replicate,
        dp_shard=mesh.dp_shard,
        cp=mesh.cp,
        tp=mesh.tp,
        ep=mesh.ep,
        sp=bool(p.sp) and mesh.tp > 1,
        vpp=max(1, int(p.pp_virtual_stages)) if mesh.pp > 1 else 1,
        schedule=p.pp_schedule,
        pp_layers=tuple(p.pp_layers),
        micro_batch_size=batch.micro_batch_size,
        microbatches=max(1, batch.grad_accum_steps),
        seq_len=batch.seq_len,
        zero_stage=int(p.zero_stage),
        ac_mode=spec.activation_checkpointing.mode,
        ac_selective=str(spec.activation_checkpointing.selective),
        precision=spec.precision.name,
        reduce_dtype=spec.precision.reduce_dtype,
        fp8_all_gather=bool(spec.precision.fp8.all_gather),
        offload_optimizer=spec.offload.optimizer,
        offload_params=spec.offload.params,
        sharding_backend=backend_of("sharding"),
        offload_backend=backend_of(
            "offload_optimizer" if spec.offload.optimizer != "none" else "offload_params", backend_of("sharding")
        ),
        pp_backend=backend_of("pp"),
        reduce_bucket_size=int(spec.backend.reduce_bucket_size),
        allgather_bucket_size=int(spec.backend.allgather_bucket_size),
        zeropp_quantized_weights=bool(spec.backend.zeropp_quantized_weights),
        zeropp_quantized_gradients=bool(spec.backend.zeropp_quantized_gradients),
        zeropp_hierarchical_partition=int(spec.backend.zeropp_hierarchical_partition),
        gpus_per_node=int(spec.cluster.gpus_per_node),
    )
