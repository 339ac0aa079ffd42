"""Config-level validation: every problem at once, one line each, naming keys, numbers and a fix.

`validate(spec)` returns the problems that the config alone shows (choices, positive values,
model shape vs the degrees the user wrote, sequence lengths, offload keys, cluster keys).
Rules that need a derived value (the world size, the inferred dp_shard, gradient
accumulation, the backend per feature) belong to the resolver, launcher/plan/decide/resolve.py,
whose `validate(spec)` runs these rules and its own: that is the full check the CLI uses.
Pure Python so that `action=plan` and `action=search` can call it for thousands of layouts.
"""

from __future__ import annotations

import functools
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from launcher.config.executors import EXECUTOR_NAMES, cluster_key_problems
from launcher.config.errors import ConfigError
from launcher.config.run_identity import run_name_problems
from launcher.config.schema import (ADAMW_IMPLEMENTATIONS, MUON_ADJUST_LR, OPTIMIZER_KINDS, JobConfig, ModelConfig,
                                    RehearseConfig)
from launcher.hf.format import DTYPES as EXPORT_DTYPES, folder_problems
from launcher.models.family import family_problems
from launcher.models.shape import head_dim_of, moe_layer_ids
from launcher.config.writable import folder_problem

# What action=search ranks by (launcher/plan/present/search.py rank_key).
PLAN_OBJECTIVES = ("throughput", "cost", "time")

CHOICES = {
    "action": ("run", "plan", "search", "rehearse", "export", "prepare"),
    "precision.name": ("fp32", "bf16", "fp8"),
    "precision.reduce_dtype": ("fp32", "bf16"),
    "precision.fp8.recipe": ("tensorwise", "rowwise"),
    "parallel.pp_schedule": ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"),
    "offload.optimizer": ("none", "cpu", "nvme"),
    "offload.params": ("none", "cpu", "nvme"),
    "activation_checkpointing.mode": ("none", "selective", "full"),
    "optim.name": ("adamw", "muon"),
    "optim.muon.adjust_lr": MUON_ADJUST_LR,
    "optim.schedule": ("cosine", "linear", "constant"),
    "data.source": ("embedded", "tokens", "text", "indexed"),
    "data.dtype": ("uint16", "uint32"),
    "trainer.device": ("auto", "cpu", "cuda"),
    "logging.wandb.mode": ("auto", "online", "offline", "disabled"),
    "cluster.name": EXECUTOR_NAMES,
    "cluster.rdzv_host_from": ("hostname", "nodeaddr"),
    "backend.default": ("auto", "native", "deepspeed"),
    "checkpoint.export": ("none", "fp32", "safetensors", "hf"),
    "checkpoint.export_dtype": tuple(EXPORT_DTYPES),  # bf16 | fp16 | fp32 | fp8_block
    "plan.format": ("text", "json"),
    "plan.objective": PLAN_OBJECTIVES,
    # Names logging.Logger.setLevel accepts (it is case-sensitive).
    "logging.level": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
}

# Suggested degrees are listed up to this value: no parallel degree is larger, and a search
# proportional to a huge value (model.n_heads=10**12) would hang the validator.
DIVISOR_SEARCH_LIMIT = 4096

# Schedules that run several model chunks per pipeline rank.
MULTI_CHUNK_SCHEDULES = ("interleaved_1f1b", "zero_bubble", "zbv")


def _get(spec: JobConfig, dotted: str):
    obj = spec
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _divisors(n: int) -> List[int]:
    """Divisors of n up to DIVISOR_SEARCH_LIMIT (the ones usable as parallel degrees)."""
    return [d for d in range(1, min(n, DIVISOR_SEARCH_LIMIT) + 1) if n % d == 0]


def _fmt_choices(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return "{" + shown + (", ..." if len(values) > limit else "") + "}"


def _check_choices(spec: JobConfig, problems: List[str]) -> None:
    for key, allowed in CHOICES.items():
        value = _get(spec, key)
        if value not in allowed:
            problems.append(f"{key}={value!r} is not one of {', '.join(allowed)}. Fix: set {key} to one of them.")


ACCUMULATE_UNSHARDED = ("auto", "true", "false")


def accumulate_unsharded_value(value: object) -> str:
    """parallel.accumulate_unsharded normalised: Hydra turns `true` into a bool, OmegaConf's str
    field then holds "True"."""
    return str(value).strip().lower()


def _check_accumulate_unsharded(spec: JobConfig, problems: List[str]) -> None:
    value = spec.parallel.accumulate_unsharded
    if accumulate_unsharded_value(value) not in ACCUMULATE_UNSHARDED:
        problems.append(
            f"parallel.accumulate_unsharded={value!r} is not one of {', '.join(ACCUMULATE_UNSHARDED)}. "
            f"Fix: set parallel.accumulate_unsharded to auto, true or false.")


def _check_positive(spec: JobConfig, problems: List[str]) -> None:
    keys = (
        "model.n_layers", "model.dim", "model.n_heads", "model.n_kv_heads", "model.ffn_dim",
        "model.vocab_size", "model.max_seq_len",
        "trainer.steps", "trainer.global_batch_size", "trainer.micro_batch_size", "trainer.seq_len",
        "trainer.log_every", "cluster.nodes", "cluster.gpus_per_node",
        "parallel.dp_replicate", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.ep",
        "parallel.pp_virtual_stages", "checkpoint.keep",
    )
    for key in keys:
        value = _get(spec, key)
        if value < 1:
            problems.append(f"{key}={value} must be at least 1. Fix: set {key} to a positive integer.")
    if spec.parallel.dp_shard != -1 and spec.parallel.dp_shard < 1:
        problems.append(
            f"parallel.dp_shard={spec.parallel.dp_shard} must be -1 (infer from the world size) or at least 1. Fix: parallel.dp_shard=-1."
        )
    if spec.optim.lr <= 0:
        problems.append(f"optim.lr={spec.optim.lr} must be positive. Fix: e.g. optim.lr=3e-4.")
    if not 0 <= spec.optim.min_lr_ratio <= 1:
        problems.append(f"optim.min_lr_ratio={spec.optim.min_lr_ratio} must be within [0, 1]. Fix: e.g. optim.min_lr_ratio=0.1.")
    if spec.optim.warmup_steps < 0:
        problems.append(f"optim.warmup_steps={spec.optim.warmup_steps} must be >= 0. Fix: optim.warmup_steps=0 for no warm-up.")
    if spec.checkpoint.interval < 0:
        problems.append(f"checkpoint.interval={spec.checkpoint.interval} must be >= 0. Fix: a step count, or 0 to disable periodic saves.")
    if spec.checkpoint.local_dir and spec.checkpoint.local_interval < 1:
        problems.append(f"checkpoint.local_interval={spec.checkpoint.local_interval} must be at least 1 with "
                        f"checkpoint.local_dir set. Fix: a step count such as checkpoint.local_interval=10, or "
                        f"checkpoint.local_dir='' for no node-local tier.")
    if spec.trainer.tokens < 0:
        problems.append(f"trainer.tokens={spec.trainer.tokens} must be >= 0. Fix: a token budget (e.g. trainer.tokens=2e12 "
                        f"as an integer: 2000000000000), or 0 to train trainer.steps steps.")
    price = spec.hardware.usd_per_gpu_hour
    if price is not None and not 0 <= price < math.inf:  # nan and inf too: the budget multiplies by it
        problems.append(f"hardware.usd_per_gpu_hour={price} must be >= 0 and finite. Fix: your price of one GPU-hour, e.g. "
                        f"hardware.usd_per_gpu_hour=2.5, or null for no cost line.")
    if spec.trainer.grad_clip < 0:
        problems.append(f"trainer.grad_clip={spec.trainer.grad_clip} must be >= 0. Fix: e.g. trainer.grad_clip=1.0, or 0 to disable clipping.")


def _check_model_vs_parallel(spec: JobConfig, problems: List[str]) -> None:
    m, p = spec.model, spec.parallel
    problems.extend(tensor_parallel_problems(m, p.tp))
    if min(m.n_heads, m.n_kv_heads) < 1:
        pass  # reported by _check_positive; the head arithmetic below would divide by zero
    elif m.head_dim < 0:
        problems.append(f"model.head_dim={m.head_dim} must be >= 0. Fix: model.head_dim=0 (dim / n_heads) or the per-head width.")
    elif m.head_dim == 0 and m.dim % m.n_heads:
        problems.append(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}. "
            f"Fix: choose n_heads dividing dim, or set model.head_dim (Qwen3 and Gemma decouple it from dim).")
    elif head_dim_of(m) % 2:
        problems.append(
            f"model head_dim = {head_dim_of(m)} ({'model.head_dim' if m.head_dim else 'dim/n_heads'}) must be even "
            f"for RoPE. Fix: change model.head_dim, or model.dim / model.n_heads.")
    if min(m.n_heads, m.n_kv_heads) >= 1 and m.n_heads % m.n_kv_heads:
        problems.append(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}. "
            f"Fix: n_kv_heads must divide n_heads."
        )
    if p.sp and p.tp == 1:
        problems.append("parallel.sp=true needs parallel.tp > 1 (sequence parallel shards along the TP group). Fix: set parallel.tp or parallel.sp=false.")

    chunks = p.pp * p.pp_virtual_stages
    if p.pp_layers:
        if len(p.pp_layers) != chunks:
            problems.append(
                f"parallel.pp_layers has {len(p.pp_layers)} entries but pp*pp_virtual_stages = {p.pp}*{p.pp_virtual_stages} = {chunks}. "
                f"Fix: give one layer count per stage chunk, or parallel.pp_layers=[] for an even split."
            )
        elif sum(p.pp_layers) != m.n_layers or min(p.pp_layers) < 1:
            problems.append(
                f"parallel.pp_layers={list(p.pp_layers)} sums to {sum(p.pp_layers)} but model.n_layers={m.n_layers} "
                f"(and every stage needs >= 1 layer). Fix: make the counts positive and sum to {m.n_layers}."
            )
    elif chunks > 1 and m.n_layers < chunks:
        problems.append(
            f"parallel: pp*pp_virtual_stages = {chunks} stage chunks but model.n_layers={m.n_layers}. "
            f"Fix: use at most {m.n_layers} chunks (lower parallel.pp or parallel.pp_virtual_stages)."
        )
    problems.extend(tied_pipeline_problems(m, p.pp))
    if p.pp_schedule in ("interleaved_1f1b", "zero_bubble") and p.pp_virtual_stages < 2:
        problems.append(
            f"parallel.pp_schedule={p.pp_schedule} runs several model chunks per rank but parallel.pp_virtual_stages="
            f"{p.pp_virtual_stages}. Fix: set parallel.pp_virtual_stages=2 (or more), or use pp_schedule=1f1b."
        )
    if p.pp_schedule == "zbv" and p.pp_virtual_stages != 2:
        problems.append(f"parallel.pp_schedule=zbv needs exactly 2 virtual stages, got {p.pp_virtual_stages}. Fix: parallel.pp_virtual_stages=2.")
    if p.pp_schedule in ("gpipe", "1f1b") and p.pp_virtual_stages != 1:
        problems.append(
            f"parallel.pp_schedule={p.pp_schedule} runs one chunk per rank but parallel.pp_virtual_stages={p.pp_virtual_stages}. "
            f"Fix: parallel.pp_schedule=interleaved_1f1b, or parallel.pp_virtual_stages=1."
        )
    if p.pp == 1 and p.pp_virtual_stages != 1:
        problems.append(f"parallel.pp_virtual_stages={p.pp_virtual_stages} needs parallel.pp > 1. Fix: set parallel.pp or pp_virtual_stages=1.")
    problems.extend(ring_pipeline_problems(spec.backend.cp_impl, p.cp, p.pp))

    if p.ep > 1:
        if m.n_experts == 0:
            problems.append(f"parallel.ep={p.ep} but model {m.name!r} is dense (n_experts=0). Fix: parallel.ep=1 or an MoE model (e.g. model=debug_moe).")
        elif m.n_experts % p.ep:
            problems.append(
                f"parallel.ep={p.ep}: model.n_experts={m.n_experts} is not divisible by {p.ep}. "
                f"Fix: choose parallel.ep in {_fmt_choices(_divisors(m.n_experts))}."
            )
    if m.n_experts:
        if not 1 <= m.top_k <= m.n_experts:
            problems.append(f"model.top_k={m.top_k} must be within [1, n_experts={m.n_experts}]. Fix: e.g. model.top_k=2.")
        if m.moe_ffn_dim < 1:
            problems.append("model.moe_ffn_dim must be set for an MoE model (n_experts > 0). Fix: model.moe_ffn_dim=<expert hidden size>.")
        if m.moe_layer_step < 1:
            problems.append(f"model.moe_layer_step={m.moe_layer_step} must be at least 1. Fix: model.moe_layer_step=1 (every layer MoE).")
        elif m.n_dense_layers >= m.n_layers or not moe_layer_ids(m):
            problems.append(
                f"model.n_dense_layers={m.n_dense_layers}, moe_layer_step={m.moe_layer_step} and mlp_only_layers="
                f"{list(m.mlp_only_layers)} leave no MoE layer of n_layers={m.n_layers}. "
                f"Fix: lower model.n_dense_layers, or set model.n_experts=0 for a dense model.")
    outside = sorted(i for i in m.mlp_only_layers if not 0 <= i < m.n_layers)
    if outside:
        problems.append(f"model.mlp_only_layers has layer ids {outside} outside 0..{m.n_layers - 1}. Fix: list layer ids of this model.")
    problems.extend(mla_and_routing_problems(m))
    problems.extend(mtp_problems(m, spec.backend))


def _weight_step_ok(step: object) -> bool:
    """Whether `step` is one [from_tokens, weight] pair of finite numbers >= 0."""
    try:
        values = [float(v) for v in step]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        return False
    return len(values) == 2 and all(math.isfinite(v) and v >= 0 for v in values)


def mtp_problems(m: ModelConfig, backend) -> List[str]:
    """Multi-token prediction (model.mtp_layers): DeepSeek-V3's, on the native path (any mesh and
    pipeline schedule; context parallelism's ring is refused by launcher/plan/decide/cp_choice.py)."""
    if m.mtp_layers < 0:
        return [f"model.mtp_layers={m.mtp_layers} must be >= 0 (-1, model=hf's default, takes config.json's "
                f"num_nextn_predict_layers from model.init_from). Fix: model.mtp_layers=0 (none) or 1 (DeepSeek-V3)."]
    problems = []
    for step in m.mtp_loss_weights:
        if not _weight_step_ok(step):
            problems.append(f"model.mtp_loss_weights has the step {step}: each step is [from_tokens, weight], "
                            f"two finite numbers >= 0. Fix: e.g. model.mtp_loss_weights=[[0,0.3],[1e13,0.1]].")
    if not m.mtp_layers:
        return problems
    if m.family != "deepseek_v3":
        problems.append(f"model.mtp_layers={m.mtp_layers} with model.family={m.family}: multi-token prediction is "
                        f"DeepSeek-V3's (its blocks and HF names). Fix: model.mtp_layers=0, or a deepseek_v3 model.")
    if "deepspeed" in (backend.default, backend.sharding):
        problems.append(f"model.mtp_layers={m.mtp_layers} with the DeepSpeed backend: its loss is wired in the native "
                        f"engine only. Fix: backend=native (or auto), or model.mtp_layers=0.")
    return problems


def mla_and_routing_problems(m: ModelConfig) -> List[str]:
    """DeepSeek-V3's keys: MLA sizes (family deepseek_v3 only), router score function, group-limited
    routing and aux-loss-free balancing (sigmoid routers of the deepseek_v3 family)."""
    problems: List[str] = []
    deepseek = m.family == "deepseek_v3"
    mla_keys = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    if deepseek:
        for key in mla_keys[1:]:
            if getattr(m, key) < 1:
                problems.append(f"model.family=deepseek_v3 needs model.{key} >= 1 (multi-head latent attention). "
                                f"Fix: the checkpoint's value, e.g. conf/model/deepseek_v3.yaml's.")
        if m.q_lora_rank < 0:
            problems.append(f"model.q_lora_rank={m.q_lora_rank} must be >= 0. Fix: 0 (no query compression) or the rank.")
        if m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2:
            problems.append(f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE. Fix: an even size, e.g. 64.")
    else:
        set_keys = [k for k in mla_keys if getattr(m, k)]
        if set_keys:
            problems.append(f"model.{set_keys[0]}={getattr(m, set_keys[0])}: multi-head latent attention is the "
                            f"deepseek_v3 family's, not {m.family}'s. Fix: model.family=deepseek_v3, or "
                            f"{', '.join(f'model.{k}=0' for k in set_keys)}.")
    if m.score_func not in ("softmax", "sigmoid"):
        problems.append(f"model.score_func={m.score_func!r} is not one of softmax, sigmoid. Fix: model.score_func=softmax.")
    elif m.n_experts and not deepseek and (m.score_func != "softmax" or m.n_group != 1 or m.topk_group != 1
                                             or m.bias_update_speed or m.routed_scaling_factor != 1.0):
        problems.append(f"model.family={m.family}: sigmoid scores, group-limited routing (n_group, topk_group), "
                        f"routed_scaling_factor and bias_update_speed are the deepseek_v3 family's router. "
                        f"Fix: model.family=deepseek_v3, or leave those keys at their defaults.")
    if m.n_experts:
        if m.n_group < 1 or m.n_experts % m.n_group or not 1 <= m.topk_group <= m.n_group:
            problems.append(f"model.n_group={m.n_group} must divide model.n_experts={m.n_experts} and model.topk_group="
                            f"{m.topk_group} lie in [1, n_group]. Fix: e.g. n_group=8, topk_group=4 (DeepSeek-V3).")
        elif m.n_group > 1 and m.n_experts // m.n_group < 2:
            problems.append(f"model.n_group={m.n_group} leaves {m.n_experts // m.n_group} expert per group (a group is "
                            f"scored by its two best experts). Fix: model.n_group <= {m.n_experts // 2}.")
        elif m.n_group > 1 and m.top_k > m.topk_group * (m.n_experts // m.n_group):
            problems.append(f"model.top_k={m.top_k} exceeds the {m.topk_group * (m.n_experts // m.n_group)} experts of "
                            f"topk_group={m.topk_group} groups. Fix: raise model.topk_group or lower model.top_k.")
    if m.bias_update_speed < 0 or m.aux_loss_alpha < 0:
        problems.append(f"model.bias_update_speed={m.bias_update_speed} and model.aux_loss_alpha={m.aux_loss_alpha} "
                        f"must be >= 0. Fix: e.g. 0.001 and 0.0001 (DeepSeek-V3).")
    if m.bias_update_speed and m.score_func != "sigmoid":
        problems.append(f"model.bias_update_speed={m.bias_update_speed} moves the sigmoid router's correction bias. "
                        f"Fix: model.score_func=sigmoid, or model.bias_update_speed=0.")
    return problems


def _check_batch_and_sequence(spec: JobConfig, problems: List[str]) -> None:
    t, p = spec.trainer, spec.parallel
    if p.tp > 1 and p.sp and t.seq_len % p.tp:
        problems.append(
            f"trainer.seq_len={t.seq_len} is not divisible by parallel.tp={p.tp} (sequence parallel splits the "
            f"sequence over TP ranks). Fix: seq_len a multiple of {p.tp}."
        )
    if p.tp > 1 and spec.model.n_experts and t.seq_len % (p.cp * p.tp) and not (p.sp and t.seq_len % p.tp):
        problems.append(
            f"trainer.seq_len={t.seq_len} is not divisible by parallel.cp*tp = {p.cp * p.tp}: an MoE model under tensor "
            f"parallelism folds its experts, each TP rank routing 1/tp of its context-parallel slice of the sequence "
            f"(docs/parallelism.md, \"Expert folding\"). Fix: seq_len a multiple of {p.cp * p.tp}."
        )
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        problems.append(
            f"trainer.seq_len={t.seq_len} is not divisible by 2*parallel.cp = {2 * p.cp} (load-balanced context "
            f"parallel splits the sequence into 2*cp chunks). Fix: seq_len a multiple of {2 * p.cp}."
        )
    if t.seq_len > spec.model.max_seq_len:
        problems.append(
            f"trainer.seq_len={t.seq_len} exceeds model.max_seq_len={spec.model.max_seq_len}. "
            f"Fix: lower trainer.seq_len or raise model.max_seq_len."
        )


def _check_zero_and_offload(spec: JobConfig, problems: List[str]) -> None:
    p, o = spec.parallel, spec.offload
    if not 0 <= p.zero_stage <= 3:
        problems.append(f"parallel.zero_stage={p.zero_stage} must be 0, 1, 2 or 3. Fix: parallel.zero_stage=3 (shard everything) or 2.")
    if "nvme" in (o.optimizer, o.params) and not o.nvme_path:
        problems.append("offload to nvme needs offload.nvme_path (a local NVMe folder). Fix: set offload.nvme_path=/path/on/nvme.")
    if o.params != "none" and p.zero_stage != 3:
        problems.append(
            f"offload.params={o.params} needs parallel.zero_stage=3 (only sharded parameters can be offloaded); "
            f"got zero_stage={p.zero_stage}. Fix: parallel.zero_stage=3 or offload.params=none."
        )
    if o.optimizer != "none" and p.zero_stage == 0:
        problems.append(
            f"offload.optimizer={o.optimizer} needs parallel.zero_stage >= 1. Fix: parallel.zero_stage=2 (or 3)."
        )


def _check_device(spec: JobConfig, problems: List[str]) -> None:
    t, p = spec.trainer, spec.parallel
    on_cpu = t.device == "cpu"
    if spec.precision.name == "fp8" and not spec.precision.fp8.emulate:
        if on_cpu:
            problems.append(
                "precision=fp8 with trainer.device=cpu: the CPU has no FP8 tensor cores. "
                "Fix: precision.fp8.emulate=true to check numerics (slow), or precision=bf16."
            )
        elif not spec.hardware.fp8_supported:
            problems.append(
                f"precision=fp8 on hardware={spec.hardware.name}, which has no FP8 tensor cores (needs compute "
                f"capability >= 8.9: H100, H200, B200, L40S). Fix: precision=bf16, or precision.fp8.emulate=true."
            )
    if spec.action == "run" and spec.data.source in ("tokens", "text") and not spec.data.path:
        problems.append(f"data.source={spec.data.source} needs data.path. Fix: data.path=/path/to/data.")
    # action=export reads no data.
    if spec.data.source == "embedded" and spec.model.vocab_size < 256 and spec.action != "export":
        problems.append(
            f"data.source=embedded uses byte tokens (256 ids) but model.vocab_size={spec.model.vocab_size}. "
            f"Fix: model.vocab_size >= 256."
        )


def _check_cluster(spec: JobConfig, problems: List[str]) -> None:
    """The chosen executor's own cluster.* rules (launcher/config/executors.py)."""
    problems.extend(cluster_key_problems(spec.cluster, spec.action))


def _check_optimizer_values(spec: JobConfig, problems: List[str]) -> None:
    """AdamW's own range checks, reported before launch instead of inside every rank."""
    o = spec.optim
    for key, value in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not 0 <= value < 1:
            problems.append(f"{key}={value} must be within [0, 1). Fix: e.g. optim.beta1=0.9, optim.beta2=0.95.")
    if not o.eps > 0:
        problems.append(f"optim.eps={o.eps} must be positive. Fix: e.g. optim.eps=1e-8.")
    if o.weight_decay < 0:
        problems.append(f"optim.weight_decay={o.weight_decay} must be >= 0. Fix: e.g. optim.weight_decay=0.1, or 0 for none.")
    if o.implementation not in ADAMW_IMPLEMENTATIONS:
        problems.append(f"optim.implementation={o.implementation!r} is not one of {', '.join(ADAMW_IMPLEMENTATIONS)}. "
                        f"Fix: optim.implementation=auto (fused on CUDA).")
    _check_muon_values(o.muon, problems)
    _check_optim_groups(o.groups, problems)


def _check_muon_values(m, problems: List[str]) -> None:
    """optim.muon.*'s ranges (torch.optim.Muon would raise them inside every rank)."""
    if not m.lr > 0:
        problems.append(f"optim.muon.lr={m.lr} must be positive. Fix: e.g. optim.muon.lr=0.02.")
    if m.weight_decay < 0:
        problems.append(f"optim.muon.weight_decay={m.weight_decay} must be >= 0. Fix: e.g. optim.muon.weight_decay=0.1.")
    if not 0 <= m.momentum < 1:
        problems.append(f"optim.muon.momentum={m.momentum} must be within [0, 1). Fix: e.g. optim.muon.momentum=0.95.")
    if not 1 <= m.ns_steps < 100:
        problems.append(f"optim.muon.ns_steps={m.ns_steps} must be within [1, 100). Fix: e.g. optim.muon.ns_steps=5.")
    if len(m.ns_coefficients) != 3:
        problems.append(f"optim.muon.ns_coefficients={list(m.ns_coefficients)} must be three numbers (a, b, c). "
                        f"Fix: optim.muon.ns_coefficients=[3.4445,-4.775,2.0315].")


def _check_optim_groups(groups, problems: List[str]) -> None:
    """optim.groups entries that are wrong whatever the model is (the model's names are checked
    before launch: launcher/launch/preflight.py)."""
    for i, g in enumerate(groups):
        try:
            re.compile(g.match)
        except re.error as err:
            problems.append(f"optim.groups[{i}].match={g.match!r} is not a regular expression ({err}). "
                            f"Fix: e.g. match: '\\.attention\\.w[qkvo]\\.weight$'.")
        if g.optimizer not in OPTIMIZER_KINDS:
            problems.append(f"optim.groups[{i}].optimizer={g.optimizer!r} is not one of {', '.join(OPTIMIZER_KINDS)}. "
                            f"Fix: optimizer: adamw (or muon for matrices).")
        if g.lr is not None and not g.lr > 0:
            problems.append(f"optim.groups[{i}].lr={g.lr} must be positive. Fix: e.g. lr: 3e-4, or leave it out.")
        if g.weight_decay is not None and g.weight_decay < 0:
            problems.append(f"optim.groups[{i}].weight_decay={g.weight_decay} must be >= 0. Fix: e.g. weight_decay: 0.")


def _check_misc_values(spec: JobConfig, problems: List[str]) -> None:
    """Single values the ranks or the reports would reject late: checkpointing, data size, search."""
    sel = spec.activation_checkpointing.selective
    if sel not in ("op", "op_alternate_mm") and not (sel.isdigit() and int(sel) >= 1):
        problems.append(
            f"activation_checkpointing.selective={sel!r} must be 'op' (save matmul outputs, recompute the rest), "
            f"'op_alternate_mm' (save every second matmul output, as torchtitan) "
            f"or an integer N >= 1 (checkpoint every N-th block). Fix: activation_checkpointing.selective=op."
        )
    elif (sel == "op_alternate_mm" and spec.activation_checkpointing.mode == "selective"
          and spec.model.n_experts > 0):
        # An MoE block runs one mm per expert that received tokens: which outputs alternate depends on
        # the routing, so neither the memory saved nor the planner's estimate would be predictable.
        problems.append(
            f"activation_checkpointing.selective=op_alternate_mm is for dense models; model {spec.model.name!r} "
            f"has n_experts={spec.model.n_experts}. Fix: activation_checkpointing.selective=op."
        )
    need = spec.trainer.seq_len + 1
    if spec.data.source == "embedded" and spec.data.embedded_tokens < need:
        problems.append(
            f"data.embedded_tokens={spec.data.embedded_tokens} is fewer than one training window of "
            f"trainer.seq_len+1 = {need} tokens. Fix: e.g. data.embedded_tokens=2000000."
        )
    if spec.plan.top_k < 1:
        problems.append(f"plan.top_k={spec.plan.top_k} must be at least 1 (layouts to print). Fix: e.g. plan.top_k=10.")
    if spec.logging.wandb.init_timeout_s <= 0:
        problems.append(
            f"logging.wandb.init_timeout_s={spec.logging.wandb.init_timeout_s} must be positive (seconds wandb.init "
            f"may wait before W&B falls back to offline). Fix: e.g. logging.wandb.init_timeout_s=30."
        )
    if spec.cluster.collective_timeout_s <= 0:
        problems.append(
            f"cluster.collective_timeout_s={spec.cluster.collective_timeout_s} must be positive (seconds a "
            f"collective waits for its peers before the job fails). Fix: e.g. cluster.collective_timeout_s=600."
        )
    if not 0 <= spec.plan.search_headroom < 1:
        problems.append(
            f"plan.search_headroom={spec.plan.search_headroom} must be within [0, 1) (a fraction of GPU memory). "
            f"Fix: e.g. plan.search_headroom=0.05."
        )
    if not 1.0 <= spec.plan.moe_imbalance < math.inf:  # nan and inf too: the plan multiplies by it
        problems.append(
            f"plan.moe_imbalance={spec.plan.moe_imbalance} must be at least 1 and finite (the busiest expert-parallel rank's "
            f"routed tokens over the mean; 1 = balanced). Fix: e.g. plan.moe_imbalance=1.0, or a run's "
            f"moe/tokens_per_expert_max_over_mean."
        )
    if spec.action == "search" and spec.plan.objective == "cost" and spec.hardware.usd_per_gpu_hour is None:
        problems.append(
            "plan.objective=cost ranks layouts by USD to the budget, but hardware.usd_per_gpu_hour is not set "
            "(null). Fix: hardware.usd_per_gpu_hour=<price of one GPU-hour>, e.g. hardware.usd_per_gpu_hour=2.5, "
            "or plan.objective=time.")
    bad_nodes = [n for n in spec.plan.search_nodes if int(n) < 1]
    if bad_nodes:
        problems.append(f"plan.search_nodes={list(spec.plan.search_nodes)} holds {bad_nodes}: node counts must be at "
                        f"least 1. Fix: e.g. plan.search_nodes=[1,2,4].")


HARDWARE_POSITIVE = (
    "memory_gb", "bf16_tflops", "fp8_tflops", "hbm_gbps", "nvlink_gbps", "network_gbps", "pcie_gbps",
    "gpus_per_node", "tf32_tflops",
)


def _check_hardware(spec: JobConfig, problems: List[str]) -> None:
    """The planner divides by these: a zero would end in ZeroDivisionError instead of a message."""
    hw = spec.hardware
    for name in HARDWARE_POSITIVE:
        value = getattr(hw, name)
        if not value > 0:
            problems.append(
                f"hardware.{name}={value} must be positive (the planner divides by it). "
                f"Fix: set hardware.{name} to the real figure, or pick a preset (hardware=h100_sxm)."
            )
    for name in ("achievable_fraction", "comm_efficiency"):
        value = getattr(hw, name)
        if not 0 < value <= 1:
            problems.append(f"hardware.{name}={value} must be within (0, 1]. Fix: e.g. hardware.{name}=0.5.")
    if hw.reserved_gb < 0:
        problems.append(f"hardware.reserved_gb={hw.reserved_gb} must be >= 0. Fix: e.g. hardware.reserved_gb=2.")


REHEARSE_DEVICES = ("cpu", "cuda")
REHEARSE_TENSORS = ("fake", "real")


def rehearse_ranks_value(value: object) -> object:
    """rehearse.ranks normalised: "auto", "all", or a list of ints (None when it is neither)."""
    if isinstance(value, str) and value.strip().lower() in ("auto", "all"):
        return value.strip().lower()
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
        return list(value)
    return None


def _check_rehearse(spec: JobConfig, problems: List[str]) -> None:
    r = spec.rehearse
    ranks = rehearse_ranks_value(r.ranks)
    if ranks is None:
        problems.append(
            f"rehearse.ranks={r.ranks!r} must be auto, all or a list of global ranks. "
            f"Fix: rehearse.ranks=auto, or e.g. rehearse.ranks=[0,7].")
    elif isinstance(ranks, list) and min(ranks) < 0:
        problems.append(f"rehearse.ranks={ranks} names a negative rank. Fix: global ranks from 0.")
    if r.workers < 1:
        problems.append(f"rehearse.workers={r.workers} must be at least 1 (rehearsal processes at a time). "
                        f"Fix: e.g. rehearse.workers=2.")
    if r.device not in REHEARSE_DEVICES:
        problems.append(f"rehearse.device={r.device!r} must be one of {', '.join(REHEARSE_DEVICES)}. "
                        f"Fix: rehearse.device=cpu, or rehearse.device=cuda with rehearse.tensors=real.")
    if r.tensors not in REHEARSE_TENSORS:
        problems.append(f"rehearse.tensors={r.tensors!r} must be one of {', '.join(REHEARSE_TENSORS)}. "
                        f"Fix: rehearse.tensors=fake (any size, on the CPU) or rehearse.tensors=real.")
    elif r.device == "cuda" and r.tensors == "fake":
        problems.append("rehearse.device=cuda with rehearse.tensors=fake: fake tensors hold no storage, so the GPU "
                        "would measure nothing. Fix: rehearse.tensors=real (the rank's real step on the local GPU), "
                        "or rehearse.device=cpu.")
    for name in ("warmup_steps", "timed_steps"):
        low = 1 if name == "timed_steps" else 0
        if getattr(r, name) < low:
            problems.append(f"rehearse.{name}={getattr(r, name)} must be at least {low}. Fix: e.g. "
                            f"rehearse.{name}={getattr(RehearseConfig, name)}.")


def _check_run_inputs(spec: JobConfig, problems: List[str]) -> None:
    """action=run: the files the ranks will open exist, and the tokenizer fits the model."""
    if spec.action != "run":
        return
    problems.extend(run_name_problems(spec.run.name))
    d = spec.data
    if d.source in ("tokens", "text") and d.path and not os.path.exists(d.path):
        problems.append(f"data.path={d.path} does not exist. Fix: point data.path at your {d.source} data.")
    if d.source == "text":
        _check_tokenizer(d.tokenizer, spec.model.vocab_size, problems)
    resume = spec.checkpoint.resume
    if resume not in ("auto", "none") and not os.path.isdir(resume):
        problems.append(
            f"checkpoint.resume={resume} is not a folder. Fix: checkpoint.resume=auto (the newest checkpoint in "
            f"the run's checkpoint folder), checkpoint.resume=none, or the path of an existing step_* folder."
        )
    # '' is outputs/runs/<run.name>/checkpoints (or <run dir>/checkpoints with hydra.run.dir given),
    # beside the folders `train` itself creates. Checked from this
    # machine: on a cluster, the path must also be writable on the compute nodes (a shared mount).
    # checkpoint.local_dir is checked from this machine too; on a cluster it is each node's own disk.
    folders = (
        ("checkpoint.dir", spec.checkpoint.dir,
         "a folder you can write on a file system every node mounts, or checkpoint.dir='' for the run's own "
         "folder (outputs/runs/<run.name>/checkpoints)."),
        ("checkpoint.local_dir", spec.checkpoint.local_dir,
         "a folder every node can create and write on its own disk (e.g. /tmp/ckpt or an NVMe mount), "
         "or checkpoint.local_dir='' for no node-local tier."),
    )
    for key, folder, fix in folders:
        problem = folder_problem(key, folder, fix) if spec.checkpoint.enabled else None
        if problem:
            problems.append(problem)


def _check_tokenizer(path: str, vocab_size: int, problems: List[str]) -> None:
    if not path:
        if vocab_size < 256:
            problems.append(
                f"data.source=text without data.tokenizer uses byte tokens (256 ids) but model.vocab_size={vocab_size}. "
                f"Fix: model.vocab_size >= 256, or data.tokenizer=/path/to/tokenizer.json."
            )
        return
    if not os.path.isfile(path):
        problems.append(
            f"data.tokenizer={path} does not exist. Fix: give the path of a local tokenizer.json "
            f"(the launcher never downloads tokenizers), or data.tokenizer='' for byte tokens."
        )
        return
    size, error = tokenizer_vocab_size(path, os.stat(path).st_mtime_ns)
    if error:
        problems.append(f"data.tokenizer={path} could not be read ({error}). Fix: give a Hugging Face tokenizer.json.")
    elif size is not None and size > vocab_size:
        problems.append(
            f"data.tokenizer={path} has {size} token ids but model.vocab_size={vocab_size}. "
            f"Fix: model.vocab_size={size} (or more), or a tokenizer with at most {vocab_size} tokens."
        )


@functools.lru_cache(maxsize=8)
def tokenizer_vocab_size(path: str, mtime_ns: int) -> Tuple[Optional[int], str]:
    """(vocabulary size including added tokens, "") or (None, the error) for a tokenizer.json.

    Uses the `tokenizers` package only (no torch). `mtime_ns` keys the cache.
    """
    try:
        from tokenizers import Tokenizer  # lazy: tokenizers (a Rust extension) only when a tokenizer.json is read

        return Tokenizer.from_file(str(Path(path))).get_vocab_size(with_added_tokens=True), ""
    except Exception as err:  # the library raises bare Exception for a malformed file
        return None, str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _check_observability(spec: JobConfig, problems: List[str]) -> None:
    """Hang watchdog, validation, profiler and straggler settings (launcher/resilience/, launcher/runtime/,
    launcher/observe/)."""
    t = spec.trainer
    if t.hang_timeout_s < 0 and t.hang_timeout_s != -1:
        problems.append(
            f"trainer.hang_timeout_s={t.hang_timeout_s} must be -1 (auto from the plan's step time), 0 (off) or "
            f"a positive number of seconds. Fix: trainer.hang_timeout_s=-1."
        )
    if t.val_every < 0:
        problems.append(f"trainer.val_every={t.val_every} must be >= 0 (0: no validation). Fix: e.g. trainer.val_every=100.")
    if t.val_every > 0 and t.val_steps < 1:
        problems.append(
            f"trainer.val_steps={t.val_steps} must be at least 1 when trainer.val_every={t.val_every}. "
            f"Fix: e.g. trainer.val_steps=4, or trainer.val_every=0.")
    d = spec.data
    if t.val_every > 0 and d.source != "embedded" and not d.val_path and not d.val_mix:
        problems.append(
            f"trainer.val_every={t.val_every} with data.source={d.source} needs held-out data but data.val_path is "
            f"empty. Fix: data.val_path=<{d.source} data not used for training>, or trainer.val_every=0.")
    if t.memory_snapshot_steps < 0:
        problems.append(
            f"trainer.memory_snapshot_steps={t.memory_snapshot_steps} must be >= 0 (0: off). Fix: e.g. trainer.memory_snapshot_steps=3.")
    if t.straggler_factor != 0 and t.straggler_factor <= 1:
        problems.append(
            f"trainer.straggler_factor={t.straggler_factor} must be above 1 (a multiple of the median step time) "
            f"or 0 (off). Fix: e.g. trainer.straggler_factor=1.5.")
    if t.straggler_checks < 1:
        problems.append(f"trainer.straggler_checks={t.straggler_checks} must be at least 1 (log steps in a row over "
                        f"trainer.straggler_factor). Fix: e.g. trainer.straggler_checks=3.")
    if t.straggler_action not in ("auto", "warn", "exclude"):
        problems.append(f"trainer.straggler_action={t.straggler_action!r} must be auto, warn or exclude. "
                        f"Fix: trainer.straggler_action=auto.")
    if str(t.health_check) not in ("auto", "on", "off"):
        problems.append(f"trainer.health_check={t.health_check!r} must be auto (on for multi-node jobs), on or off. "
                        f"Fix: trainer.health_check=auto.")
    if t.max_skipped_steps < 0:
        problems.append(f"trainer.max_skipped_steps={t.max_skipped_steps} must be 0 (never end the run for skipped "
                        f"steps) or more (that many non-finite steps in a row end it). Fix: e.g. trainer.max_skipped_steps=5.")
    if t.spike_zscore < 0:
        problems.append(f"trainer.spike_zscore={t.spike_zscore} must be 0 (off) or a positive number of standard "
                        f"deviations. Fix: e.g. trainer.spike_zscore=6.")
    if t.spike_zscore > 0 and t.spike_window < 2:
        problems.append(f"trainer.spike_window={t.spike_window} must be at least 2 logged losses to measure a spread. "
                        f"Fix: e.g. trainer.spike_window=50.")
    problems.extend(_spike_rewind_problems(spec))
    if t.health_factor <= 1:
        problems.append(f"trainer.health_factor={t.health_factor} must be above 1 (a multiple of the other ranks' "
                        f"median probe time). Fix: e.g. trainer.health_factor=3.")
    pr = spec.profile
    if pr.enabled and (len(pr.steps) != 2 or pr.steps[0] < 1 or pr.steps[1] < pr.steps[0]):
        problems.append(
            f"profile.steps={list(pr.steps)} must be [first, last] with 1 <= first <= last. Fix: e.g. profile.steps=[10,12].")
    # profile.ranks against the world size: launcher.plan.decide.resolve (it owns the world size).
    # data.source=indexed takes PREFIXes too: launcher/data/checks.py checks those paths.
    if spec.action == "run" and d.val_path and d.source != "indexed" and not os.path.exists(d.val_path):
        problems.append(f"data.val_path={d.val_path} does not exist. Fix: point data.val_path at held-out {d.source} data.")


def _spike_rewind_problems(spec: JobConfig) -> List[str]:
    """trainer.on_spike and its budget: a rewind needs spikes detected and checkpoints to go back to."""
    t, problems = spec.trainer, []
    if t.on_spike not in ("log", "rewind"):
        problems.append(f"trainer.on_spike={t.on_spike!r} must be log (health/loss_spike only) or rewind (resume "
                        f"from before the spike and skip its batches). Fix: trainer.on_spike=log.")
        return problems
    if t.spike_skip_batches is not None and t.spike_skip_batches < 0:
        problems.append(f"trainer.spike_skip_batches={t.spike_skip_batches} must be null (the batches from the "
                        f"checkpoint through the spike) or a number of global batches >= 0. Fix: e.g. "
                        f"trainer.spike_skip_batches=200.")
    if t.max_rewinds < 0:
        problems.append(f"trainer.max_rewinds={t.max_rewinds} must be 0 or more. Fix: e.g. trainer.max_rewinds=3.")
    if t.on_spike != "rewind":
        return problems
    if t.spike_zscore <= 0:
        problems.append("trainer.on_spike=rewind needs spikes detected, but trainer.spike_zscore=0 (off). "
                        "Fix: e.g. trainer.spike_zscore=6.")
    if not spec.checkpoint.enabled or spec.checkpoint.interval <= 0:
        problems.append("trainer.on_spike=rewind resumes from a checkpoint from before the spike, but this run saves "
                        "none (checkpoint.enabled=false or checkpoint.interval=0). Fix: e.g. checkpoint.interval=100.")
    return problems


def _check_hf_io(spec: JobConfig, problems: List[str]) -> None:
    """model.init_from (a Hugging Face folder: read before launch, headers only) and action=export."""
    # action=run only: plan/search never read the weights (and search validates many layouts).
    if spec.model.init_from and spec.action == "run":
        problems.extend(folder_problems(spec.model, spec.model.init_from))
    if spec.action == "export":
        if spec.checkpoint.export == "none":
            problems.append("action=export writes checkpoint.export but checkpoint.export=none. "
                            "Fix: checkpoint.export=hf (or fp32 / safetensors).")
        resume = spec.checkpoint.resume
        if resume in ("auto", "none") or not os.path.isdir(resume):
            problems.append(f"action=export reads checkpoint.resume={resume}, which is not a checkpoint folder. "
                            f"Fix: checkpoint.resume=/path/to/run/checkpoints/step_000100.")


def _check_rope_scaling(spec: JobConfig, problems: List[str]) -> None:
    """model.rope_scaling: a type the model implements, with values its formula accepts."""
    r = spec.model.rope_scaling
    if r.type == "none":
        return
    if r.type == "yarn" and spec.model.family == "deepseek_v3":
        if r.factor < 1:
            problems.append(f"model.rope_scaling.factor={r.factor} must be at least 1. Fix: the checkpoint's value, "
                            f"e.g. model.rope_scaling.factor=40 (DeepSeek-V3).")
        if r.original_max_position_embeddings < 1 or not 0 < r.beta_slow < r.beta_fast:
            problems.append(f"model.rope_scaling: yarn needs original_max_position_embeddings >= 1 and 0 < beta_slow < "
                            f"beta_fast (got {r.original_max_position_embeddings}, {r.beta_slow}, {r.beta_fast}). "
                            f"Fix: DeepSeek-V3's 4096, 1, 32.")
        return
    if r.type != "llama3":
        if spec.model.name == "hf" and spec.model.init_from and spec.action == "run":
            return  # taken from config.json: _check_hf_io's folder check names it (one line per problem)
        problems.append(f"model.rope_scaling.type={r.type!r} is not implemented (supported: none, llama3; "
                        f"yarn with model.family=deepseek_v3; linear, dynamic and longrope are not). "
                        f"Fix: model.rope_scaling.type=none, or llama3 for a Llama 3.1-3.3 checkpoint.")
        return
    if r.factor < 1:
        problems.append(f"model.rope_scaling.factor={r.factor} must be at least 1 (it stretches long wavelengths). "
                        f"Fix: the checkpoint's value, e.g. model.rope_scaling.factor=8 (Llama 3.1), 32 (3.2).")
    if not 0 < r.low_freq_factor < r.high_freq_factor:
        problems.append(f"model.rope_scaling.low_freq_factor={r.low_freq_factor} and high_freq_factor="
                        f"{r.high_freq_factor} need 0 < low_freq_factor < high_freq_factor. "
                        f"Fix: the checkpoint's values, e.g. 1 and 4 (Llama 3.1-3.3).")
    if r.original_max_position_embeddings < 1:
        problems.append(f"model.rope_scaling.original_max_position_embeddings={r.original_max_position_embeddings} "
                        f"must be at least 1. Fix: the pre-training context, e.g. 8192 (Llama 3.1-3.3).")


def _check_family(spec: JobConfig, problems: List[str]) -> None:
    problems.extend(family_problems(spec.model))  # the planner's formulas come from the family


def _check_eval(spec: JobConfig, problems: List[str]) -> None:
    """eval.* values (downstream evaluation; its files: launcher/data/eval_inputs.py)."""
    e = spec.eval
    for key in ("every", "limit", "num_fewshot", "batch_tokens"):
        if getattr(e, key) < 0:
            problems.append(f"eval.{key}={getattr(e, key)} must be >= 0. Fix: eval.{key}=0 or a positive value.")
    if e.tasks and e.every == 0:
        problems.append(f"eval.tasks={list(e.tasks)} with eval.every=0: nothing would evaluate them. "
                        f"Fix: eval.every=N (steps), or eval.tasks=[].")
    if e.every > 0 and not e.tasks:
        problems.append(f"eval.every={e.every} without eval.tasks. Fix: eval.tasks=[task,...], or eval.every=0.")
    if e.batch_tokens > 0 and e.batch_tokens < spec.trainer.seq_len:
        problems.append(f"eval.batch_tokens={e.batch_tokens} is less than one row of trainer.seq_len="
                        f"{spec.trainer.seq_len} tokens. Fix: eval.batch_tokens={spec.trainer.seq_len * spec.trainer.micro_batch_size} "
                        f"or more, or 0 for the training step's shape.")
    _check_eval_jobs(spec, problems)


def _check_eval_jobs(spec: JobConfig, problems: List[str]) -> None:
    """eval.on_checkpoint / eval.job / eval.job_every: per-checkpoint evaluation jobs."""
    e = spec.eval
    if e.job_every < 1:
        problems.append(f"eval.job_every={e.job_every} must be >= 1 (every k-th checkpoint). Fix: eval.job_every=1.")
    if e.job and not e.on_checkpoint:
        problems.append("eval.job=true without eval.on_checkpoint tasks: the per-checkpoint jobs would evaluate "
                        "nothing. Fix: eval.on_checkpoint=[task,...], or eval.job=false.")
    if e.on_checkpoint and not e.job:
        problems.append(f"eval.on_checkpoint={list(e.on_checkpoint)} runs as per-checkpoint evaluation jobs, and "
                        f"eval.job=false submits none. Fix: eval.job=true, or eval.on_checkpoint=[].")
    if e.job and e.on_checkpoint and not spec.checkpoint.enabled:
        problems.append("eval.job=true evaluates saved checkpoints, and checkpoint.enabled=false saves none. "
                        "Fix: checkpoint.enabled=true, or eval.job=false.")


BASIC_RULES: Iterable[Callable[[JobConfig, List[str]], None]] = (
    _check_family,
    _check_choices,
    _check_accumulate_unsharded,
    _check_positive,
)

RULES: Iterable[Callable[[JobConfig, List[str]], None]] = (
    _check_model_vs_parallel,
    _check_batch_and_sequence,
    _check_zero_and_offload,
    _check_device,
    _check_cluster,
    _check_optimizer_values,
    _check_misc_values,
    _check_hardware,
    _check_run_inputs,
    _check_observability,
    _check_hf_io,
    _check_rope_scaling,
    _check_rehearse,
    _check_eval,
)


def basic_problems(spec: JobConfig) -> List[str]:
    """Choices and positive values: what the resolver needs before it can derive anything."""
    problems: List[str] = []
    for rule in BASIC_RULES:
        rule(spec, problems)
    return problems


def validate(spec: JobConfig) -> List[str]:
    """Every problem the config alone shows (empty list: none). The full check, with the
    resolver's rules and backend conflicts, is `launcher.plan.decide.resolve.validate`."""
    problems = basic_problems(spec)
    for rule in RULES:
        rule(spec, problems)
    return problems


def stop_lead_warnings(spec: JobConfig, stop_s: float) -> List[str]:
    """Warnings (not errors) when SLURM's time-limit warning comes later than a stop needs.

    `stop_s` is the planner's predicted time to finish a step and save a checkpoint
    (launcher/plan/estimate/checkpoint_time.py). SLURM kills the job at its time limit whatever
    the ranks are doing, so a shorter lead loses the save.
    """
    lead = spec.cluster.signal_seconds
    if spec.cluster.name != "slurm" or lead <= 0 or lead >= stop_s:
        return []
    wanted = int(stop_s * 1.5) + 61  # half as much again, plus a minute
    return [
        f"cluster.signal_seconds={lead} is shorter than the predicted {stop_s:.0f} s to finish a step and "
        f"save a checkpoint (hardware.storage_gbps={spec.hardware.storage_gbps:g} GB/s per node): at the time "
        f"limit SLURM kills the job before the save ends. Fix: cluster.signal_seconds={wanted}, or set "
        f"hardware.storage_gbps to your storage's measured write bandwidth."
    ]


def rope_scaling_warnings(spec: JobConfig) -> List[str]:
    """A warning (not an error) when a from-scratch run scales RoPE within the context it was meant
    to extend: `rope_scaling` belongs to a checkpoint trained with it (a folder whose config.json has
    it); pretraining at or below `original_max_position_embeddings` wants plain RoPE, as DeepSeek-V3
    and Llama 3 were pretrained, and scaling there changes the frequencies (and YaRN's softmax scale)."""
    r = spec.model.rope_scaling
    if r.type == "none" or spec.model.init_from or spec.trainer.seq_len > r.original_max_position_embeddings:
        return []
    return [f"model.rope_scaling.type={r.type} on a from-scratch run (no model.init_from) at trainer.seq_len="
            f"{spec.trainer.seq_len}, within its original_max_position_embeddings="
            f"{r.original_max_position_embeddings}: the model pretrains with scaled RoPE frequencies its "
            f"authors used only to extend a trained model's context. Fix: model.rope_scaling.type=none for "
            f"pretraining, or model.init_from=<folder of a model trained with this scaling>."]


def check(spec: JobConfig) -> None:
    """Raise ConfigError with every config-level problem, if any."""
    problems = validate(spec)
    if problems:
        raise ConfigError(problems)


# --------------------------------------------------------------------------- rules shared with
# the search (launcher/plan/present/search.py) and the parallel modules: written once, here.


def tensor_parallel_problems(m: ModelConfig, tp: int) -> List[str]:
    """Why the model cannot be split over `tp` tensor-parallel ranks (empty: it can).

    The one TP divisibility rule: the validator, the search and launcher/parallel/tp.py use it.
    """
    if tp <= 1:
        return []
    problems: List[str] = []
    if m.n_heads % tp:
        problems.append(
            f"parallel.tp={tp}: model.n_heads={m.n_heads} is not divisible by {tp}. "
            f"Fix: choose parallel.tp in {_fmt_choices(_divisors(m.n_heads))}."
        )
    if m.n_kv_heads % tp:
        problems.append(
            f"parallel.tp={tp}: model.n_kv_heads={m.n_kv_heads} is not divisible by {tp} "
            f"(grouped-query attention shards whole KV heads). "
            f"Fix: choose parallel.tp in {_fmt_choices(_divisors(m.n_kv_heads))}."
        )
    if m.vocab_size % tp:
        problems.append(
            f"parallel.tp={tp}: model.vocab_size={m.vocab_size} is not divisible by {tp} (the output layer "
            f"and loss are sharded over the vocabulary). Fix: pad model.vocab_size to "
            f"{-(-m.vocab_size // tp) * tp}, or choose another parallel.tp."
        )
    if m.tie_embeddings:
        problems.append(
            f"model.tie_embeddings=true with parallel.tp={tp}: the tied table cannot be both row-sharded "
            f"(embedding) and column-sharded (output). Fix: model.tie_embeddings=false or parallel.tp=1."
        )
    ffn_dims = [("model.ffn_dim", m.ffn_dim)]
    if m.n_experts:
        ffn_dims.append(("model.moe_ffn_dim", m.moe_ffn_dim))
    for key, value in ffn_dims:
        if value % tp:
            problems.append(
                f"parallel.tp={tp}: {key}={value} is not divisible by {tp}. "
                f"Fix: choose parallel.tp in {_fmt_choices(_divisors(value))}."
            )
    return problems


def tied_pipeline_problems(m: ModelConfig, pp: int) -> List[str]:
    """Tied embeddings cannot be pipelined: embedding and output live on different stages."""
    if pp > 1 and m.tie_embeddings:
        return [
            "model.tie_embeddings=true with parallel.pp > 1: the embedding and the output layer live on different "
            "pipeline stages. Fix: parallel.pp=1 or model.tie_embeddings=false."
        ]
    return []


def ring_pipeline_problems(cp_impl: str, cp: int, pp: int) -> List[str]:
    """Ring attention is not run under pipelining here: the engine cuts each stage's sequence slices
    for the all-gather implementation only (backend.cp_impl=auto takes it under PP). The planner
    still estimates such a layout (torchtitan's published 405B rows ran ring CP with PP)."""
    if cp_impl == "ring" and cp > 1 and pp > 1:
        return [f"backend.cp_impl=ring with parallel.cp={cp} and parallel.pp={pp}: the pipeline schedule passes each "
                f"stage the rank's sequence slices, which only the all-gather implementation cuts. "
                f"Fix: backend.cp_impl=allgather or backend.cp_impl=auto, or parallel.pp=1."]
    return []
