"""Per-GPU memory: model states (params, grads, optimizer), activations, working buffers.

Pure Python. Every number is bytes on one GPU of one pipeline rank; `estimate_memory`
returns one entry per pipeline rank and the planner reports the most loaded one.

Model states (Ψ = parameters this rank holds after TP, PP and EP divided the model):
- native FSDP2: the sharded parameters are the fp32 master (4 B), gradients are sharded fp32
  (4 B), AdamW keeps m and v in fp32 (8 B); all three are divided by the shard degree
  (dp_shard * cp; dp_replicate replicates: HSDP). With bf16 mixed precision the unsharded
  bf16 copy of the units being computed is extra working memory: two units at ZeRO-3
  (the current one and the prefetched next), every unit of the stage at ZeRO-1/2
  (`reshard_after_forward=False` keeps them from forward to backward).
- DeepSpeed: bf16 params (2 B) + bf16 grads (2 B) + fp32 master, m, v (12 B) = 16 B/param
  (docs/planner.md); ZeRO-1 divides the 12 B, ZeRO-2 also the grads, ZeRO-3 everything, over all
  data-parallel ranks. At ZeRO-2/3 the gradient partition peaks at 4 B (the fp32 copy the master
  step reads): 18 B/param at ZeRO-3. Its reduce / all-gather buckets are working memory.
- Offload moves the optimizer states (DeepSpeed: with the fp32 grads its CPU Adam reads)
  or, for parameter offload and FSDP2's CPUOffloadPolicy, all model states to the host.

Activations follow Korthikanti et al. 2022 (count every tensor autograd saves for the
backward pass) applied to the block that launcher/models builds for the model's family (its
attention layout: launcher/models/<family>/params.py); see
`layer_activation_bytes` for the list and what TP, SP, CP, recomputation and compile divide.

What exists at the peak follows how torch runs the step: without FSDP2 autocast's bf16 weight
casts (`autocast_cast_elements`), and with one micro-batch no gradient during the loss's
backward and the blocks' gradients born as their activations are freed
(`grads_born_in_backward`); docs/planner.md, "Working memory".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

from launcher.plan.layout import Layout, MemoryPlan
from launcher.plan.estimate.cp_allgather import is_allgather
from launcher.plan.estimate.muon import stage_muon_work
from launcher.plan.estimate.params import ModelShape, StageParams, stage_params

GiB = 1024**3
# PyTorch's caching allocator reserves more than it hands out: blocks are rounded up (to 512 B,
# large ones to 2 MiB segments) and a freed block can only be reused by a request that fits in
# it, so segments split and sit partly idle. Its max reserved exceeds max allocated by a few
# to ~10 % in long runs (torch.cuda.memory_stats: reserved_bytes vs allocated_bytes peaks);
# docs/planner.md, "Held to published measurements".
ALLOCATOR_FRAGMENTATION = 0.05
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


@dataclass
class StageMemory:
    """Bytes on one GPU of one pipeline rank at its peak (in the backward: the loss's or the blocks')."""

    rank: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    other: int = 0  # unsharded working copies, buckets, backward temporaries, CUDA/NCCL reserve
    host: int = 0  # offloaded to CPU RAM / NVMe (not counted against the GPU)
    detail: Dict[str, int] = field(default_factory=dict)
    peak_phase: str = "blocks"  # the backward phase of the peak: "loss" or "blocks" (BackwardPhase)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def as_dict(self) -> Dict[str, int]:
        return {c: int(getattr(self, c)) for c in CATEGORIES} | {"total": int(self.total)}

    def maxima(self) -> Dict[str, int]:
        """`grads` and `activations` at their own maxima over the step, beside what exists at the
        peak (`grads`, `activations`): {grads_held, activations_max}."""
        return own_maxima(self.detail, self.grads, self.activations)


def own_maxima(detail: Dict[str, int], grads: int, activations: int) -> Dict[str, int]:
    """Gradients and activations at their own maxima over the step: the gradients held for the
    optimizer step, and every block's and the head's saved activations (none is freed yet at the
    loss's backward). `grads` / `activations` (at the peak) bound them from below."""
    saved = int(detail.get("activations_layers", 0)) + int(detail.get("activations_head", 0))
    return {"grads_held": max(int(grads), int(detail.get("grads_held", 0))),
            "activations_max": max(int(activations), saved)}


# ----------------------------------------------------------------------------- model states


def state_bytes_per_param(lay: Layout) -> Dict[str, float]:
    """Bytes per parameter kept for the whole step: {params, grads, optimizer}, before sharding."""
    if lay.owners.sharding_backend == "deepspeed":
        if lay.numerics.precision != "fp32":
            if lay.memory.zero_stage == 1 and lay.memory.offload_optimizer == "none":
                # launcher/engines/deepspeed_config.py accumulates gradients in fp32 at ZeRO-1, which makes
                # DeepSpeed use its BF16_Optimizer: an unsharded fp32 gradient buffer (4 B/param)
                # beside the bf16 gradients, i.e. 8 + 12/N bytes per parameter instead of 4 + 12/N.
                return {"params": 2.0, "grads": 6.0, "optimizer": 12.0}
            if lay.memory.zero_stage >= 2 and lay.memory.offload_optimizer == "none":
                # At the optimizer step DeepSpeed copies the bf16 gradient partition into an fp32 one
                # (single_grad_partition, 4 B) for the fp32 master step and then frees the bf16 one:
                # the gradients' peak is 4 B per partitioned parameter. ZeRO-3: 2 + 4 + 12 = 18 B/param,
                # as DeepSpeed's estimate_zero3_model_states_mem_needs counts.
                return {"params": 2.0, "grads": 4.0, "optimizer": 12.0}
            return {"params": 2.0, "grads": 2.0, "optimizer": 12.0}  # bf16 p/g + fp32 master, m, v
        if lay.memory.zero_stage >= 1:
            # ZeRO's optimizer steps a flat fp32 copy of its partition even in fp32 training.
            return {"params": 4.0, "grads": 4.0, "optimizer": 12.0}
    return {"params": 4.0, "grads": 4.0, "optimizer": 8.0}  # fp32 p/g (FSDP2 master), m, v


def _sharded(lay: Layout) -> tuple:
    """Which states ZeRO divides by the shard degree. FSDP2 shards all three at any stage >= 1
    (its stages 1/2 differ from 3 only in resharding after forward)."""
    if lay.owners.sharding_backend == "deepspeed":
        return ((), ("optimizer",), ("grads", "optimizer"), ("params", "grads", "optimizer"))[lay.memory.zero_stage]
    return () if lay.memory.zero_stage == 0 else ("params", "grads", "optimizer")


def _offloaded(lay: Layout) -> tuple:
    """States that live on the host instead of the GPU."""
    if lay.memory.offload_params != "none" or (lay.memory.offload_optimizer != "none" and lay.owners.offload_backend == "native"):
        # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together;
        # DeepSpeed parameter offload is used with optimizer offload in practice.
        return ("params", "grads", "optimizer")
    if lay.memory.offload_optimizer != "none":
        return ("grads", "optimizer")  # ZeRO-Offload: fp32 grads + master + m + v on the host
    return ()


def working_dtype_bytes(lay: Layout) -> float:
    """Bytes per element of the unsharded parameters the forward/backward compute with."""
    if lay.numerics.precision == "fp32":
        return 4.0
    if lay.numerics.precision == "fp8" and lay.numerics.fp8_all_gather and lay.owners.sharding_backend == "native":
        return 1.0
    return 2.0


def model_state_memory(stage: StageParams, lay: Layout, shape: Optional[ModelShape] = None) -> Dict[str, int]:
    """params / grads / optimizer on the GPU, the offloaded bytes, and the working copies."""
    # TP splits the matrices but replicates norms (and, in MoE blocks, router and experts).
    shared = (stage.shared - stage.tp_replicated) / lay.mesh.tp + stage.tp_replicated
    routed = stage.routed / lay.mesh.ep
    per_param = state_bytes_per_param(lay)
    sharded, offloaded = _sharded(lay), _offloaded(lay)
    out: Dict[str, int] = {}
    host = 0.0
    for cat, nbytes in per_param.items():
        if cat in sharded:
            b = nbytes * (shared / lay.fsdp_degree + routed / lay.expert_fsdp_degree)
        else:
            b = nbytes * (shared + routed)
        if cat in offloaded:
            host += b
            b = 0.0
        out[cat] = int(b)
    fsdp_accumulates_shards = (lay.owners.sharding_backend == "native" and lay.memory.zero_stage >= 1
                               and lay.fsdp_degree > 1 and not lay.fsdp_holds_unsharded)
    if lay.batch.microbatches > 1 and out["grads"] and not fsdp_accumulates_shards:
        # Accumulating into existing gradients briefly holds a fresh gradient next to the old
        # one: one tensor (the largest) at a time, as measured with torch's MemTracker.
        # (FSDP2 adds its reduce-scatter output into the shard: counted with its buffers.)
        n = lay.fsdp_degree if "grads" in sharded else 1
        out["grads"] += int(per_param["grads"] * largest_tensor(stage, lay) / n)
    out["host"] = int(host)
    muon = stage_muon_work(stage, lay)
    if muon is not None:
        # Muon keeps one fp32 momentum buffer (4 B) per matrix element instead of AdamW's two
        # moments, for the parameters optim.groups (or optim=muon's defaults) give it.
        out["host" if "optimizer" in offloaded else "optimizer"] -= int(4.0 * muon.elements)
    out.update(working_state_memory(stage, lay, shape))
    return out


def largest_tensor(stage: StageParams, lay: Layout) -> float:
    """Elements of the largest single parameter tensor on this rank (after TP / EP)."""
    return stage.largest_tensor / lay.mesh.tp


def autocast_cast_elements(stage: StageParams, shape: Optional[ModelShape], lay: Layout) -> float:
    """Elements of the weights autocast casts to bf16 on this rank (after TP / EP): every matmul
    weight; not the embedding table (a lookup, unless tied to the output layer) nor the norms
    (they multiply in fp32). Under fp8 torchao's Float8Linear casts its fp32 weight straight to
    float8 and saves the fp32 weight itself, so only the output layer (kept bf16) is cast."""
    if shape is None:
        return 0.0
    local = (stage.shared - stage.tp_replicated) / lay.mesh.tp + stage.routed / lay.mesh.ep
    table = shape.vocab_size * shape.dim / lay.mesh.tp
    if lay.numerics.precision == "fp8":
        return table if stage.has_output else 0.0
    if stage.has_embedding and not (shape.tie_embeddings and stage.has_output):
        local -= table
    return max(local, 0.0)


def working_state_memory(stage: StageParams, lay: Layout, shape: Optional[ModelShape] = None) -> Dict[str, int]:
    """Unsharded parameter / gradient copies and communication buckets alive at the peak."""
    unit = stage.largest_unit / lay.mesh.tp  # experts of a unit are also split by ep, bound from above
    # TP replicates norms and, in MoE blocks, router and experts (no expert-TP): as in
    # model_state_memory, only the rest divides by tp.
    local = (stage.shared - stage.tp_replicated) / lay.mesh.tp + stage.tp_replicated + stage.routed / lay.mesh.ep
    wb = working_dtype_bytes(lay)
    grad_wb = 4.0 if lay.numerics.precision == "fp32" else 2.0
    out: Dict[str, int] = {}
    if lay.fsdp_holds_unsharded:
        # torch's pipeline schedules, and accumulate_unsharded, keep FSDP2 units unsharded, and
        # their gradients unreduced, from the first micro-batch to the last backward of the step.
        out["unsharded_params"] = int(local * wb)
        # FSDP2 keeps the gradients it does not reduce yet in reduce_dtype (FSDPParam.
        # to_accumulated_grad_if_needed upcasts them), so fp32 with reduce_dtype=fp32.
        acc_wb = 4.0 if lay.numerics.reduce_dtype == "fp32" else grad_wb
        out["unsharded_grads"] = int(local * acc_wb)
    elif lay.owners.sharding_backend == "native" and not lay.fsdp_wraps:
        # One sharding rank: no FSDP2, the engine's autocast computes in bf16 (native.py _autocast).
        # Autocast caches the bf16 cast of every weight it multiplies (leaf tensors that need grad)
        # and each matmul saves its cast for backward, so at the loss's backward all of them exist.
        if lay.numerics.precision in ("bf16", "fp8"):
            out["autocast_weight_copies"] = int(autocast_cast_elements(stage, shape, lay) * 2.0)
    elif lay.owners.sharding_backend == "native":
        if lay.memory.zero_stage in (1, 2):
            out["unsharded_params"] = int(local * wb)  # kept from forward to backward
        elif lay.numerics.precision != "fp32" or lay.memory.zero_stage == 3:
            out["unsharded_params"] = int(2 * unit * wb)  # current + prefetched unit
        # The unit being reduced: its unsharded grads, plus an fp32 copy when reducing in fp32.
        extra = 4.0 if (lay.numerics.reduce_dtype == "fp32" and grad_wb != 4.0) else 0.0
        out["unsharded_grads"] = int(unit * (grad_wb + extra)) if lay.memory.zero_stage else 0
    else:
        if lay.memory.zero_stage == 3:
            out["unsharded_params"] = int(2 * unit * wb)
            if lay.deepspeed.zeropp_hierarchical_partition > 1:
                # hpZ keeps a secondary copy of the params sharded within the node.
                out["hpz_secondary"] = int(local * wb / lay.deepspeed.zeropp_hierarchical_partition)
        if lay.memory.zero_stage >= 1:
            # Measured on CPU (bench/memory_accuracy.py): ZeRO-1/2/3 allocate one buffer of the full
            # configured reduce bucket size whatever the model size (ZeRO-2/3 fill it with the
            # contiguous gradients, which torch's MemTracker then counts as gradients).
            out["reduce_buckets"] = int(lay.deepspeed.reduce_bucket_size * grad_wb)
    return out


# ----------------------------------------------------------------------------- activations


def _attention_widths(shape: ModelShape, lay: Layout) -> Dict[str, int]:
    """Per-token widths (elements) of the attention tensors autograd saves, from the family's
    AttentionLayout: q (n_heads x qk head), k and v as SDPA gets them, o (n_heads x v head)."""
    at = shape.attention_layout
    q = at.n_heads * at.qk_head_dim
    k = at.n_kv_heads * at.qk_head_dim
    v = at.linear(at.v_source).out_features  # v is a view of that matmul's output: all of it is kept
    if is_allgather(lay):
        # All-gather CP: the whole sequence's K/V (MLA: also its latent and RoPE key) are saved on
        # every rank, cp times a local token's (launcher/plan/estimate/cp_allgather.py).
        latent = at.linear(at.v_source).in_features + at.rope_dim if at.assembled_qk else 0
        k, v = k * lay.mesh.cp, (v + latent) * lay.mesh.cp
    elif at.n_kv_heads != at.n_heads and lay.mesh.cp > 1:
        # Ring attention (context parallelism) has no enable_gqa: K/V are repeated to every head.
        k, v = q, at.n_heads * at.v_head_dim
    return {"q": q, "k": k, "v": v, "o": at.n_heads * at.v_head_dim}


def _inner_attention_bytes(shape: ModelShape, lay: Layout) -> float:
    """Saved bytes per token of the attention's own norms (Qwen3's QK-norm, MLA's latent norms): the
    fp32 input and output of each, and its output in the activation dtype where a matmul reads it;
    MLA's replicated down-projections and latent norms are whole on every TP rank."""
    a, t = lay.act_bytes, lay.mesh.tp
    total = 0.0
    for n in shape.attention_layout.norms:
        saved = 8.0 * n.width + (a * n.width if n.feeds_linear else 0.0)
        total += saved / t if n.split else saved
    return total


def routed_load_factor(lay: Layout) -> float:
    """The busiest rank's routed expert rows over the balanced mean: plan.moe_imbalance under
    expert parallelism (the rows a rank receives follow the routing); 1 without it (every rank
    computes the top_k copies of its own tokens, however they are routed)."""
    return lay.moe_imbalance if lay.mesh.ep > 1 else 1.0


def layer_activation_bytes(shape: ModelShape, lay: Layout, moe: bool, mode: str) -> float:
    """Bytes autograd saves for one block and one micro-batch on one GPU.

    Saved tensors of a block (per token; a = activation bytes, h = dim, f = ffn), read from the
    family's attention layout (launcher/models/<family>/params.py attention_layout):
      two RMSNorms computed in fp32 save their fp32 input and normalised output: 2 x 8h;
      their outputs are the inputs of the first attention matmuls and of w1/w3: 2 x a*h;
      attention: q (a * n_heads x qk head), k and v as SDPA gets them (a * n_kv_heads x head each:
      SDPA's enable_gqa shares them; all heads under context parallelism, whose ring attention
      needs them repeated; MLA: k assembled per head, v a view of wkv_b's whole output), the SDPA
      output (a * n_heads x v head; flash attention keeps no s x s scores), the contiguous copy fed
      to wo (the same);
      the attention's own norms (Qwen3's QK-norm over q and k, MLA's latent norms with the latent
      inputs of wq_b and wkv_b): fp32 input and output, and the output where a matmul reads it;
      SwiGLU: w1 and w3 outputs, silu output, their product: 4 x a*f;
      MoE: fp32 router logits and probabilities (8 * n_experts), and per routed copy of a token
      (top_k, padded by the capacity factor) the dispatched input, the expert's SwiGLU
      tensors and its fp32 output (weighted by the gate); shared experts like a dense
      SwiGLU of n_shared_experts * moe_ffn_dim.
    TP divides everything between the norms' outputs and the block output (heads, ffn
    columns), except what it replicates (MLA's down-projections and latent norms). Without SP the
    norms run on the full sequence on every TP rank; with SP they are split over TP, but DTensor's
    column-parallel linears save their all-gathered input, so the 2 x a*h linear inputs stay whole.
    CP divides the sequence.

    mode: "none" (keep all), "full" (keep the block input only), "op" (selective: keep the
    outputs of matmuls and attention, recompute norms and elementwise ops), "op_alternate_mm"
    (as "op" but every second matmul output recomputed: MoE blocks are refused by the validator).
    """
    a, h, t = lay.act_bytes, shape.dim, lay.mesh.tp
    tokens = lay.rank_microbatch_tokens
    sp_div = t if lay.sp else 1
    if mode == "full":
        return tokens * a * h / sp_div
    at = shape.attention_layout
    w = _attention_widths(shape, lay)
    if moe:
        cap = shape.capacity_factor if shape.capacity_factor > 0 else 1.0  # padding when dropping
        k, fe = shape.top_k, shape.moe_ffn_dim
        router = 8.0 * shape.n_experts
        # Under EP the expert tensors hold the rows this rank received: plan.moe_imbalance times the
        # mean on the busiest rank; what comes back to a token's own rank (the combine) is its own.
        load = routed_load_factor(lay)
        # Replicated over TP, every TP rank runs the MoE on the full sequence; folded, on its 1/tp
        # (launcher/parallel/tp.py): the per-token bytes below are spread over tp ranks.
        if mode == "op":  # dispatched input + w1/w3 outputs + expert output
            routed = cap * k * ((a * h + 2 * a * fe) * load + a * h)
            shared_e = shape.n_shared_experts * 2 * a * fe
        else:
            # dispatched input, SwiGLU tensors, fp32 expert output kept for the gate weighting
            routed = cap * k * ((a * h + 4 * a * fe) * load + 4 * h)
            shared_e = shape.n_shared_experts * 4 * a * fe
        ffn = (router + routed + shared_e) / (t if lay.experts_folded else 1)
    else:
        ffn = (2 if mode == "op" else 4) * a * shape.ffn_dim / t
    # Matmul outputs before wo (the last attention matmul, whose output is counted with the
    # residual-sized tensors): TP-split ones and replicated ones.
    before_wo = at.linears[:-1]
    # The last matmul's (w2's) output under selective AC: the policy saves it in eager mode, but in a
    # compiled block (trainer.compile, which compiles the checkpoint-wrapped block:
    # launcher/engines/native.py) AOTAutograd's partitioner saves only what the backward reads, and
    # w2's output is read by the residual add alone, whose backward needs no input. Everything else
    # the policy saves is read by the backward and kept. Measured on CPU with the real llama_1b block
    # under bf16 autocast (bench/compiled_block_activations.py, docs/planner.md): per token and block
    # "op" 51,328 B eager, 47,232 compiled, "op_alternate_mm" 29,824 and 25,728 (without the block
    # input): a x h less in both, w2's output, the only tensor missing from the compiled block's
    # saved list. Dense blocks only (MoE blocks are compiled without their experts); under TP the
    # same term is dropped (the collective after w2 is not read by the backward either; not measured).
    last_mm_out = 0.0 if lay.compile and not moe else a * h / sp_div
    if mode == "op_alternate_mm":
        # torchtitan's policy (launcher/parallel/ac.py): every second mm output is recomputed, so of
        # wq, wk, wv, wo, w1, w3, w2 only wq, wv, w1, w2 are kept. wk and w3 go; wo's output goes
        # without TP, while under TP its saved collective output (all-reduce / reduce-scatter) stays.
        # (Counted for a four-matmul attention: the policy is refused for MoE models, MLA's.)
        kept_mm = sum(m.out_features for m in before_wo[::2])
        attn = a * (kept_mm + w["o"]) / t  # q, v, SDPA output
        kept = a * h / sp_div * (2 if t > 1 else 1) + last_mm_out  # block input (+ wo's collective), w2 output
        ffn = a * shape.ffn_dim / t  # w1 output
        gathered = 2 * a * h if lay.sp else 0.0
        return tokens * (attn + kept + ffn + gathered)
    if mode == "op":
        # block input + attention matmul outputs (q, k, v) + SDPA output + wo output + w2 output
        # (norms, silu, mul recomputed)
        split_mm = sum(m.out_features for m in before_wo if m.split)
        attn = a * (split_mm + w["o"]) / t + a * sum(m.out_features for m in before_wo if not m.split)
        kept = a * h / sp_div * 2 + last_mm_out  # block input, wo output, w2 output (residual-stream sized)
        # Under SP the policy (launcher/parallel/ac.py) also saves its collectives' outputs: the two
        # all-gathered norm outputs (full sequence) that feed wq/wk/wv and w1/w3.
        gathered = 2 * a * h if lay.sp else 0.0
        return tokens * (attn + kept + ffn + gathered)
    norms = 16.0 * h / sp_div
    if lay.compile:
        # trainer.compile (launcher/parallel/compile.py): AOTAutograd's partitioner saves what the
        # backward reads and recomputes cheap pointwise ops there. Measured on CPU with the real
        # llama_1b block under bf16 autocast (saved_tensors_hooks; the record is in docs/benchmarks.md): each norm's
        # fp32 normalised output is recomputed from its input and the per-token rsqrt; in a block
        # compiled whole one of the two fp32 norm inputs is too (the residual add of the other and
        # the attention output), and SwiGLU keeps three of its four f-wide tensors (silu's output
        # is recomputed from w1's). MoE blocks compile their norms one by one (each keeps its input).
        norms = (8.0 if moe else 4.0) * h / sp_div
        if not moe:
            ffn = 3 * a * shape.ffn_dim / t
    linear_inputs = 2.0 * a * h
    if lay.compile and lay.numerics.precision == "fp8" and not moe:
        # torchao's Float8Linear re-casts its input in its own backward, so in a compiled block the
        # partitioner recomputes the bf16 inputs that are pointwise functions of saved tensors (both
        # norm outputs, SwiGLU's product) instead of keeping them (measured as above, fp8 emulated).
        linear_inputs = 0.0
        ffn = 2 * a * shape.ffn_dim / t
    attn = a * (w["q"] + w["k"] + w["v"] + w["o"] + w["o"]) / t
    if at.norms:
        attn += _inner_attention_bytes(shape, lay)
    return tokens * (norms + linear_inputs + attn + ffn)


FLEX_BLOCK = 128  # FlexAttention's default block size (torch.nn.attention.flex_attention)


def document_mask_bytes(lay: Layout) -> float:
    """Bytes of one micro-batch's document mask (data.document_masking) on one GPU.

    "sdpa" (CPU): the additive mask [micro_batch, 1, s, s] in the activation dtype, built once per
    forward and shared by every layer (SDPA saves it for backward; its flash kernel keeps no s x s
    scores). "flex" (CUDA): the BlockMask's int32 tables, [micro_batch, 1, s/128] block counts and
    [micro_batch, 1, s/128, s/128] indices, for the partial and full blocks, forward and backward
    (4 of each). Under all-gather context parallelism (which builds the mask with or without
    documents: the resolver sets document_mask) the rank's s/cp queries over the s gathered keys."""
    b, s, cp = lay.batch.micro_batch_size, lay.batch.seq_len, lay.mesh.cp
    if lay.document_mask == "sdpa":
        return float(b * (s / cp) * s * lay.act_bytes)
    if lay.document_mask == "flex":
        nq, n = -(-s // (cp * FLEX_BLOCK)), -(-s // FLEX_BLOCK)
        return float(4 * 4 * b * (nq + nq * n))
    return 0.0


def layer_modes(n_layers: int, lay: Layout) -> List[str]:
    """The recomputation mode of each block of a stage."""
    if lay.memory.ac_mode == "full":
        return ["full"] * n_layers
    if lay.memory.ac_mode == "selective":
        if lay.memory.ac_selective.isdigit() and int(lay.memory.ac_selective) > 0:
            every = int(lay.memory.ac_selective)
            return ["full" if i % every == 0 else "none" for i in range(n_layers)]
        return ["op_alternate_mm" if lay.memory.ac_selective == "op_alternate_mm" else "op"] * n_layers
    return ["none"] * n_layers


def inflight_microbatches(lay: Layout, rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak (all its chunks).

    GPipe runs every forward before any backward: m. 1F1B: rank r holds p - r (at most m).
    Interleaved 1F1B with v chunks: rank r holds p + (p-1-2r)/v when p divides m (rank 0: (1 +
    (p-1)/(p v)) times 1F1B's p, Narayanan et al. 2021), more when it does not (torch's rounds);
    zbv (V-shape, 2 chunks) balances to about p on every rank.
    """
    p, m, v = lay.mesh.pp, lay.batch.microbatches, lay.vpp
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return float(m)
    if lay.schedule == "zbv":
        return float(min(m, p))
    if v > 1:
        # torch's ScheduleInterleaved1F1B (_get_warmup_ops): rank r runs (v-1)k + 2(p-1-r) chunk
        # forwards of warm-up, k = micro-batches per round = m // max(1, m // p) (p when p divides m),
        # then one more forward before its first backward: (v-1)k + 2(p-1-r) + 1 chunks in flight,
        # at most all m*v; in micro-batches of all v chunks, divided by v (p + (p-1-2r)/v for k = p).
        k = m // max(1, m // p)
        return min(m * v, (v - 1) * k + 2 * (p - 1 - rank) + 1) / v
    return float(min(m, p - rank))


@lru_cache(maxsize=65536)
def _layer_kinds(shape: ModelShape, stage: StageParams, ac_mode: str, ac_selective: str) -> Dict[tuple, int]:
    """Blocks of a stage counted per (is MoE, recompute mode): a 126-block stage costs a few formula calls."""
    modes = layer_modes(stage.n_layers, Layout(memory=MemoryPlan(ac_mode=ac_mode, ac_selective=ac_selective)))
    kinds: Dict[tuple, int] = {}
    for mode, idx in zip(modes, stage.layers):
        key = (shape.is_moe_layer(idx), mode)
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


def stage_activation_memory(shape: ModelShape, stage: StageParams, lay: Layout) -> Dict[str, int]:
    """Saved activations of a pipeline rank at its peak, plus the backward working set."""
    kinds = _layer_kinds(shape, stage, lay.memory.ac_mode, lay.memory.ac_selective)
    per_mb = sum(n * layer_activation_bytes(shape, lay, moe, mode) for (moe, mode), n in kinds.items())
    # A block recomputed for its backward saves again what its recomputed ops produce: the block's
    # activations without recomputation, less what the checkpoint already kept (the block input
    # under full AC; the matmul and attention outputs under selective AC, which the recomputed
    # forward reuses instead of producing again). Compiled blocks (trainer.compile) save less in
    # both, which layer_activation_bytes models.
    worst_layer = max((recomputed_block_bytes(shape, lay, moe, mode) for moe, mode in kinds if mode != "none"),
                      default=0.0)
    inflight = inflight_microbatches(lay, stage.rank)
    tokens = lay.rank_microbatch_tokens
    a, t = lay.act_bytes, lay.mesh.tp
    # The document mask is built once per micro-batch and stage and saved by every layer's attention
    # (the same tensor): one per micro-batch in flight.
    out = {"layers": int((per_mb + document_mask_bytes(lay)) * inflight)}
    if stage.has_output:
        # Final norm (fp32) + output-layer input + the saved fp32 log-softmax output, per micro-batch
        # in flight on the last model chunk. Only the last model chunk holds the head: under 1F1B-like schedules (interleaved, zbv
        # included) it runs each micro-batch's backward right after its forward, so one is in flight.
        last_inflight = inflight if lay.schedule == "gpipe" else 1.0
        v = shape.vocab_size
        head = tokens * (8.0 * shape.dim / (t if lay.sp else 1) + a * shape.dim)
        saved_logits = tokens * 4.0 * v / t
        # Multi-token prediction runs with the head (same chunk, same micro-batches in flight).
        head += mtp_activation_bytes(shape, lay)
        out["head"] = int((head + saved_logits) * last_inflight)
        # The loss's backward frees the head's saved tensors of its micro-batch before the blocks'
        # (the MTP depths' too: their loss's gradient enters at the logits, their graph is the newest).
        out["head_freed_before_blocks"] = int(head + saved_logits)
        # Peak of the loss's backward, beside the saved fp32 log-softmax output: the bf16 logits
        # (kept by the engine's `logits` variable), the fp32 gradient of the log-softmax output and
        # the fp32 gradient of its input. Under TP the loss is computed by loss_parallel, whose
        # decomposed log-softmax backward (grad - exp(out) * sum(grad)) holds one more fp32 temporary.
        fp32_bufs = 8.0 + (4.0 if t > 1 else 0.0)
        out["logits_transient"] = int(tokens * ((a if a != 4 else 0.0) + fp32_bufs) * v / t)
    # Backward working set: the gradients live inside one block's backward (about three
    # FFN-wide and two residual-wide tensors); with recomputation the recomputed block's
    # activations exist at the same time.
    width = (shape.moe_ffn_dim * max(1, shape.top_k) if shape.n_moe_layers else shape.ffn_dim) / t
    out["backward_workspace"] = int(tokens * a * (3 * width + 2 * shape.dim))
    # The block being recomputed holds those tensors during its backward; like torch's
    # MemTracker, count them with the backward temporaries ("other").
    out["recomputed_block"] = int(worst_layer)  # 0 without recomputation
    return out


def mtp_activation_bytes(shape: ModelShape, lay: Layout) -> float:
    """Bytes the multi-token-prediction depths (model.mtp_layers, launcher/models/mtp.py) save for
    one micro-batch on the last pipeline chunk; 0 without them.

    Per depth and token: enorm, hnorm and head_norm as the final norm (fp32 input and output, 8h,
    split over TP under SP); the concatenation eh_proj reads (2 x a*h, a per-token map: split over
    TP under SP); one block as layer_activation_bytes keeps it (never checkpointed: activation
    checkpointing wraps the main blocks); the output layer's input (a*h, gathered under SP) and
    the saved fp32 log-softmax of its logits (4v / tp), as the main head's.
    """
    if not shape.mtp_depths:
        return 0.0
    a, h, t = lay.act_bytes, shape.dim, lay.mesh.tp
    sp_div = t if lay.sp else 1
    tokens = lay.rank_microbatch_tokens
    per_depth = tokens * (3 * 8.0 * h / sp_div + 2 * a * h / sp_div + a * h + 4.0 * shape.vocab_size / t)
    moe = shape.mtp_moe_depths
    blocks = (moe * layer_activation_bytes(shape, lay, True, "none")
              + (shape.mtp_depths - moe) * layer_activation_bytes(shape, lay, False, "none"))
    return shape.mtp_depths * per_depth + blocks


def recomputed_block_bytes(shape: ModelShape, lay: Layout, moe: bool, mode: str) -> float:
    """Bytes the recomputation of one checkpointed block adds during its backward.

    The recomputed forward saves what the block saves without checkpointing (mode "none", eager
    or compiled), but the tensors the checkpoint kept (`mode`) are reused, not made again: the
    difference. Measured on CPU (bench/memory_accuracy.py, docs/benchmarks.md 2026-11-27):
    charging the whole block under selective AC over-estimated the step's peak.
    """
    return max(0.0, layer_activation_bytes(shape, lay, moe, "none") - layer_activation_bytes(shape, lay, moe, mode))


# ----------------------------------------------------------------------------- per stage


class BackwardPhase(NamedTuple):
    """What one phase of the backward holds beside the states and working memory (bytes)."""

    name: str  # "loss" or "blocks"
    activations: int
    temporaries: int
    grads: int

    def bytes(self) -> int:
        return self.activations + self.temporaries + self.grads


# The backward temporaries each phase holds (detail keys); the rest of `detail` that is not a
# category's own maximum (grads_held, activations_*) is working memory, fragmentation and reserve.
PHASE_TEMPORARIES = {"loss": ("logits_transient",), "blocks": ("backward_workspace", "recomputed_block")}
NOT_IN_OTHER = ("grads_held", "activations_layers", "activations_head")


def phase_temporaries(acts: Dict[str, int], phase: str) -> int:
    """Bytes of the backward temporaries `phase` holds (PHASE_TEMPORARIES), from
    stage_activation_memory's output or a plan's detail."""
    return sum(int(acts.get(k, 0)) for k in PHASE_TEMPORARIES[phase])


def other_parts(detail: Dict[str, int], peak_phase: str) -> Dict[str, int]:
    """The parts that add up to the plan's `other` (bytes), for the phase of the peak."""
    temporaries = {k for ks in PHASE_TEMPORARIES.values() for k in ks}
    counted = set(PHASE_TEMPORARIES.get(peak_phase, ()))
    return {k: v for k, v in detail.items()
            if k not in NOT_IN_OTHER and (k not in temporaries or k in counted)}


def category_maxima(plan_memory: Dict[str, Any]) -> Dict[str, int]:
    """The plan's categories each at its own maximum over the step, as a memory tracker reports
    them: `grads` and `activations` of a plan are what exists at its peak (the gradients may not
    be born yet, the head's activations freed), their maxima are in `detail`."""
    out = {c: int(plan_memory.get(c, 0)) for c in CATEGORIES}
    own = own_maxima(plan_memory.get("detail", {}), out["grads"], out["activations"])
    out["grads"], out["activations"] = own["grads_held"], own["activations_max"]
    return out


def estimate_memory(shape: ModelShape, lay: Layout, reserved_bytes: int = 0,
                    ranks: Optional[Sequence[int]] = None) -> List[StageMemory]:
    """Memory of the pipeline ranks in `ranks` (default: all), in rank order.

    The search passes (0, pp-1): the first rank holds the embedding and the most in-flight
    micro-batches, the last the output layer and logits; middle ranks are never heavier.
    """
    stages = stage_params(shape, lay.mesh.pp, lay.vpp, lay.schedule, lay.pp_layers)
    if ranks is not None:
        stages = [stages[r] for r in sorted(set(ranks))]
    result: List[StageMemory] = []
    for st in stages:
        states = model_state_memory(st, lay, shape)
        acts = stage_activation_memory(shape, st, lay)
        working = {k: v for k, v in states.items() if k not in ("params", "grads", "optimizer", "host")}
        # Two phases of the backward, the peak is the larger. The loss's backward: every saved
        # activation, the head's included, and the logits' transients. The blocks' backward: the
        # head's tensors of that micro-batch are freed by then; the recomputed block and the
        # gradient workspace live. When the step's gradients are born in the backward
        # (grads_born_in_backward) none exists at the loss's backward, and in the blocks'
        # backward each block's gradients appear as its activations are freed: that phase peaks
        # at its start (every activation, no gradient) or at its end (every gradient), whichever
        # holds more. Else all gradients are there in both.
        grads_full = states["grads"]
        born = grads_born_in_backward(lay)
        all_activations = acts["layers"] + acts.get("head", 0)
        block_activations = all_activations - acts.get("head_freed_before_blocks", 0)
        loss_phase = BackwardPhase(name="loss", activations=all_activations, temporaries=phase_temporaries(acts, "loss"),
                                   grads=0 if born else grads_full)
        block_phase = BackwardPhase(name="blocks", activations=block_activations,
                                    temporaries=phase_temporaries(acts, "blocks"),
                                    grads=0 if born and block_activations >= grads_full else grads_full)
        peak = max(block_phase, loss_phase, key=BackwardPhase.bytes)  # a tie goes to the blocks'
        activations, temporaries, grads = peak.activations, peak.temporaries, peak.grads
        mem = StageMemory(
            rank=st.rank,
            params=states["params"],
            grads=grads,
            optimizer=states["optimizer"],
            activations=activations,
            host=states["host"],
            peak_phase=peak.name,
        )
        allocated = mem.params + mem.grads + mem.optimizer + mem.activations + sum(working.values()) + temporaries
        fragmentation = int(allocated * ALLOCATOR_FRAGMENTATION)
        mem.other = sum(working.values()) + temporaries + fragmentation + reserved_bytes
        mem.detail = {
            **working,
            "grads_held": grads_full,  # after the backward, at the optimizer step
            "activations_layers": acts["layers"],
            "activations_head": acts.get("head", 0),
            "logits_transient": acts.get("logits_transient", 0),
            "backward_workspace": acts["backward_workspace"],
            "recomputed_block": acts["recomputed_block"],
            "allocator_fragmentation": fragmentation,
            "reserved": reserved_bytes,
        }
        result.append(mem)
    return result


def grads_born_in_backward(lay: Layout) -> bool:
    """Whether the step's (sharded) gradients are allocated only in the backward that ends it, so
    none exists when that backward starts. Native engine only (its optimizer step ends with
    zero_grad(set_to_none=True); DeepSpeed keeps its gradient buffers), and either one
    micro-batch per step without a pipeline (a later micro-batch's backward runs beside the
    earlier ones' gradients), or FSDP2 holding the units unsharded across the micro-batches
    (Layout.fsdp_holds_unsharded: pipeline schedules, accumulate_unsharded), which accumulates
    unreduced gradients in its working memory and reduce-scatters them into the sharded ones in
    the last backward, as it frees the unsharded ones."""
    if lay.owners.sharding_backend != "native":
        return False
    return (lay.batch.microbatches == 1 and lay.mesh.pp == 1) or lay.fsdp_holds_unsharded


def most_loaded(stages: List[StageMemory]) -> StageMemory:
    return max(stages, key=lambda s: s.total)
