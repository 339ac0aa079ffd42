"""The registered backends (`REGISTRY`), the feature x backend table as users read it
(`FEATURES`: what each backend implements), and the record of one decision (`BackendChoice`).

Pure data, no torch. Under which condition each backend can serve a feature is the support
table (launcher/plan/decide/support.py); the decision is made in launcher/plan/decide/rules.py; the docs and
the `--markdown` generator live in launcher/plan/decide/backends.py.

The one fact that shapes every rule: a single engine owns the model states. Either the
native stack (FSDP2 / DTensor / torch pipelining) wraps the model, or DeepSpeed's engine
does (``deepspeed.initialize``); the two cannot share a parameter. So the model-state
features (sharding, HSDP, offload, ZeRO++, mixed precision, checkpoint format, pipeline)
all ride with one owner, and the DTensor features (TP, CP, EP) and FP8 module swaps exist
only natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

NATIVE = "native"
DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend: its config value, the name users read, and how it hosts features."""

    name: str  # the value of backend=... / backend.<feature>=...
    label: str  # how messages name it
    # True: serving an uncoupled feature (activation checkpointing) needs this backend's engine to
    # own the model states (DeepSpeed's checkpointing runs only inside deepspeed.initialize);
    # False: its implementation runs inside whichever engine owns them (torch checkpointing).
    owns_what_it_serves: bool
    # Non-empty: when this backend runs the pipeline, its pipeline engine recomputes activations
    # through this mechanism of its own, so activation checkpointing must be this backend's too
    # (another backend's checkpointing would be a choice that engine ignores).
    pipeline_recompute: str = ""


# The registered backends, in preference order: with backend=auto the first one that can serve
# every model-state feature owns them ("native where it serves").
REGISTRY: Tuple[BackendEntry, ...] = (
    BackendEntry(NATIVE, "native", owns_what_it_serves=False),
    BackendEntry(DEEPSPEED, "DeepSpeed", owns_what_it_serves=True,
                 pipeline_recompute="activation_checkpoint_interval"),
)
BACKENDS = tuple(b.name for b in REGISTRY)
PREFERENCES = ("auto", *BACKENDS)
# backend.fp8_impl values: the runtime implements torchao only; transformer_engine is refused
# by the resolver with a fix (never shown as a choice the runtime would ignore).
FP8_IMPLS = ("auto", "torchao", "transformer_engine")


@dataclass(frozen=True)
class BackendChoice:
    """The resolver's decision for one feature: who serves it, with what, and why."""

    backend: str  # a name in BACKENDS
    impl: str  # e.g. "FSDP2 fully_shard", "DeepSpeed ZeRO-3"; "off" when the feature is not used
    reason: str


@dataclass(frozen=True)
class Feature:
    """One row of the feature x backend matrix."""

    name: str  # key in Plan.backends
    title: str
    switches: str  # config keys that turn it on
    override: str  # BackendConfig field that forces its backend
    impls: Mapping[str, str]  # registered backend name -> how it implements the feature (absent: it does not)
    notes: str
    coupled: bool = True  # must be served by the model-state owner


FEATURES: Tuple[Feature, ...] = (
    Feature(
        "sharding", "Data-parallel sharding (ZeRO 0-3)", "parallel.zero_stage", "sharding",
        {NATIVE: "stage 2: FSDP2 `fully_shard(reshard_after_forward=False)`; stage 3: FSDP2 `fully_shard` "
                 "(reshard after forward)",
         DEEPSPEED: "`zero_optimization.stage` 0-3 in `deepspeed.initialize`"},
        "ZeRO-1 (optimizer states only) exists only in DeepSpeed; ZeRO-0 (plain data parallel) runs on "
        "DeepSpeed because the native path implements FSDP2 only (parallel.zero_stage=2 is the closest native "
        "choice); with a single data-parallel rank every stage is served natively",
    ),
    Feature(
        "hsdp", "HSDP / hierarchical partitioning", "parallel.dp_replicate > 1", "sharding",
        {NATIVE: "FSDP2 on a 2-D (dp_replicate, dp_shard) mesh: shard inside a group, replicate across",
         DEEPSPEED: "ZeRO-3 only: ZeRO++ hpZ (`zero_hpz_partition_size` = dp_shard), a secondary parameter "
                    "partition inside each group; optimizer states stay sharded over all dp ranks"},
        "DeepSpeed ZeRO-1/2 have no replicate groups",
    ),
    Feature(
        "offload_optimizer", "Optimizer-state offload", "offload.optimizer=cpu|nvme", "offload",
        {NATIVE: "cpu only: FSDP2 `CPUOffloadPolicy` - it moves parameters, gradients and optimizer state "
                 "to the CPU together (the optimizer step runs on the CPU); needs zero_stage 2/3",
         DEEPSPEED: "ZeRO-Offload `offload_optimizer` device cpu (stage 1-3) or nvme (ZeRO-Infinity, stage 3)"},
        "NVMe offload exists only in DeepSpeed; optimizer-only offload (params stay on the GPU) "
        "only in DeepSpeed",
    ),
    Feature(
        "offload_params", "Parameter offload", "offload.params=cpu|nvme", "offload",
        {NATIVE: "cpu only: FSDP2 `CPUOffloadPolicy` (parameters, gradients and optimizer state together)",
         DEEPSPEED: "`offload_param` device cpu or nvme, ZeRO-3 only"},
        "NVMe offload exists only in DeepSpeed",
    ),
    Feature(
        "zeropp", "ZeRO++ quantized communication / hpZ",
        "backend.zeropp_quantized_weights, backend.zeropp_quantized_gradients, "
        "backend.zeropp_hierarchical_partition", "sharding",
        {DEEPSPEED: "`zero_quantized_weights` (qwZ), `zero_quantized_gradients` (qgZ), "
                    "`zero_hpz_partition_size` (hpZ); ZeRO-3 only"},
        "DeepSpeed only",
    ),
    Feature(
        "precision", "BF16 mixed precision", "precision.name=bf16|fp32|fp8", "precision",
        {NATIVE: "FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=precision.reduce_dtype)`, "
                 "fp32 master weights",
         DEEPSPEED: "`bf16.enabled` (bf16 params and grads, fp32 master weights in the ZeRO optimizer), "
                    "`communication_data_type` from precision.reduce_dtype"},
        "DeepSpeed bf16 at ZeRO stage 0 drifts (no fp32 master copy); prefer stage >= 1",
    ),
    Feature(
        "fp8", "FP8 training", "precision.name=fp8", "precision",
        {NATIVE: "torchao `convert_to_float8_training` (float8 all-gather with FSDP2); "
                 "`backend.fp8_impl=transformer_engine` is refused (not wired in the runtime)"},
        "refused with DeepSpeed: FP8 is a module swap that this launcher applies only on the "
        "native path",
    ),
    Feature(
        "activation_checkpointing", "Activation checkpointing",
        "activation_checkpointing.mode=selective|full", "activation_checkpointing",
        {NATIVE: "`checkpoint_wrapper` per block (full), op-level selective (save matmuls), or every N-th block",
         DEEPSPEED: "`deepspeed.checkpointing.checkpoint` per block (full or every N-th block) configured by the "
                    "`activation_checkpointing` section; the pipeline engine uses `activation_checkpoint_interval`"},
        "native torch checkpointing may run inside the DeepSpeed engine "
        "(`backend.activation_checkpointing=native`); op-level selective is native only",
        coupled=False,
    ),
    Feature(
        "tp", "Tensor (+ sequence) parallel", "parallel.tp > 1, parallel.sp", "tp",
        {NATIVE: "DTensor `parallelize_module` (Colwise/Rowwise, SequenceParallel, loss parallel)"},
        "the DeepSpeed engine cannot wrap DTensor parameters",
    ),
    Feature(
        "pp", "Pipeline parallel", "parallel.pp > 1", "pp",
        {NATIVE: "`torch.distributed.pipelining` (all schedules in parallel.pp_schedule), composes with FSDP2",
         DEEPSPEED: "`PipelineModule` + `PipelineEngine` (1F1B schedule), ZeRO <= 1 only"},
        "DeepSpeed's pipeline engine refuses ZeRO 2/3, interleaved / zero-bubble schedules and "
        "explicit parallel.pp_layers",
    ),
    Feature(
        "ep", "Expert parallel", "parallel.ep > 1", "ep",
        {NATIVE: "all-to-all token dispatch over the ep ranks of the mesh"},
        "the launcher's MoE layers are native modules; DeepSpeed-MoE layers are not wired",
    ),
    Feature(
        "cp", "Context parallel", "parallel.cp > 1", "cp",
        {NATIVE: "`backend.cp_impl`: allgather (K/V all-gathered per layer, gradients reduce-scattered; every "
                 "device, document masks) or ring (`torch.distributed.tensor.experimental.context_parallel`; "
                 "GPU, causal only)"},
        "DeepSpeed-Ulysses needs its own attention wrapper, not wired here",
    ),
    Feature(
        "checkpoint", "Checkpoint format", "checkpoint.*", "checkpoint",
        {NATIVE: "torch.distributed.checkpoint (DCP), reshardable across world sizes",
         DEEPSPEED: "`engine.save_checkpoint` / `load_checkpoint` (ZeRO partitioned files); "
                    "per-parameter fp32 masters (`safe_get_full_fp32_param`)"},
        "both export a consolidated fp32 / safetensors model",
    ),
)
FEATURE_BY_NAME: Dict[str, Feature] = {f.name: f for f in FEATURES}
