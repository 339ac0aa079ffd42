"""Communication volume, pipeline bubble, step time, tokens/s and MFU. Pure Python.

Assumptions (printed by `action=plan`, documented in docs/planner.md):
- Collectives are rings: all-reduce moves 2(N-1)/N x bytes per rank, reduce-scatter and
  all-gather (N-1)/N x bytes, all-to-all (N-1)/N x bytes sent; point-to-point sends its bytes.
- A group runs on NVLink when all its ranks sit in one node (ranks are ordered pp,
  dp_replicate, dp_shard, cp, tp with tp innermost), otherwise on the per-GPU network link;
  a collective reaches `comm_efficiency` of the link's one-direction bandwidth.
- Compute runs at `achievable_fraction` of the dense peak (FP8 peak x FP8_GEMM_EFFICIENCY for
  the block matmuls under precision=fp8; attention and the output layer stay BF16; TF32 peak under
  precision=fp32), plus the memory-bound work of launcher/plan/estimate/elementwise.py (norms, RoPE,
  SwiGLU, residual adds, the loss, float8 casts) at HBM bandwidth, and, on a rank without FSDP2,
  autocast's weight casts (weight_cast_s); the optimizer step adds gradient clipping (grad_clip_s).
  `achievable_fraction` is then the matmuls' own share of the peak (docs/planner.md, constants).
- Overlap: FSDP/ZeRO all-gathers and reduce-scatters overlap the compute of other units
  (only the part longer than the compute, plus the first gather and last reduce of a
  micro-batch, is exposed); DDP's all-reduce overlaps the last backward; context-parallel
  K/V gathers overlap the attention and the fp32 dK/dV ring overlaps the backward's hops but for
  the last hop of each layer (launcher/plan/estimate/ring.py); TP and EP collectives are exposed (the runtime has
  no TP comm overlap and no async TP; the EP all-to-all's same-node and other-node parts run at once,
  the slower one exposed), and so is DeepSeek-V3's once-per-step router-bias all-reduce;
  pipeline sends are exposed during warm-up and cool-down only; an idle pipeline slot lasts a
  micro-batch with the collectives exposed inside its layers (TP, CP, EP).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher.plan.estimate.cp_allgather import gathered_bytes_per_token, is_allgather, repeated_up_projection_flops
from launcher.plan.estimate.elementwise import HBM_EFFICIENCY, elementwise_s
from launcher.plan.estimate.flops import attention_flops_per_token, peak_tflops
from launcher.plan.layout import Layout
from launcher.plan.estimate.memory import autocast_cast_elements, routed_load_factor
from launcher.plan.estimate.muon import MUON_ELEMENTWISE_BYTES, stage_muon_work
from launcher.plan.estimate.params import ModelShape, StageParams, attention_width, stage_params
from launcher.plan.estimate.ring import hop_time_factor, kv_bytes_per_token, ring_bookkeeping_s

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

# Host-side AdamW throughput per GPU process when the optimizer is offloaded (parameters/s);
# DeepSpeedCPUAdam reaches a few 1e9 params/s on a full multi-core host shared by 8 GPUs.
HOST_ADAM_PARAMS_PER_S = 5e8


# ----------------------------------------------------------------------------- collectives


def ring_factor(collective: str, n: int) -> float:
    """Bytes each rank sends per byte of the (full) buffer, for a ring over n ranks."""
    if n <= 1:
        return 0.0
    if collective == "all_reduce":
        return 2.0 * (n - 1) / n
    if collective in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    if collective == "p2p":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def group_span(lay: Layout, dims: Tuple[str, ...]) -> int:
    """How many consecutive global ranks one group along `dims` (adjacent mesh dims) spans."""
    # The group's ranks are strided by the product of the dims inside it, so it spans from
    # its outermost dim down to tp.
    outer = min(MESH_ORDER.index(d) for d in dims)
    span = 1
    for d in MESH_ORDER[outer:]:
        span *= getattr(lay.mesh, d)
    return span


def placement(lay: Layout, dims: Tuple[str, ...], span: int = 0) -> str:
    """'intra' when a group along `dims` (or of an explicit rank span) fits in one node, else 'inter'."""
    return "intra" if (span or group_span(lay, dims)) <= lay.gpus_per_node else "inter"


def link_bandwidth(hw: Any, where: str) -> float:
    """Bytes/s a collective reaches on the link (one direction, per GPU)."""
    gbps = hw.nvlink_gbps if where == "intra" else hw.network_gbps
    return gbps * 1e9 * hw.comm_efficiency


@dataclass
class Collective:
    name: str  # what it is for, e.g. "fsdp all-gather (params, fwd)"
    collective: str  # all_reduce | reduce_scatter | all_gather | all_to_all | p2p
    group: str  # mesh dims, e.g. "dp_shard*cp"
    group_size: int
    where: str  # intra | inter
    bytes_per_step: float  # sent by one rank per optimizer step
    time_s: float  # at link bandwidth, not counting overlap
    exposed_s: float = 0.0  # what it adds to the step after overlap

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _coll(name, kind, dims, size, lay, hw, buffer_bytes, count, span=0) -> Collective:
    where = placement(lay, dims, span)
    nbytes = ring_factor(kind, size) * buffer_bytes * count
    return Collective(name, kind, "*".join(dims), size, where, nbytes, nbytes / link_bandwidth(hw, where))


# ----------------------------------------------------------------------------- compute


@lru_cache(maxsize=65536)
def stage_matmul_params(shape: ModelShape, st: StageParams) -> Tuple[float, float]:
    """(block matmul params per token, output-layer params) one token touches on a rank."""
    block = 0.0
    for i in st.layers:
        if shape.is_moe_layer(i):
            block += shape.attention + shape.router + (shape.top_k + shape.n_shared_experts) * shape.expert
        else:
            block += shape.attention + shape.dense_ffn
    head = shape.vocab_size * shape.dim if st.has_output else 0.0
    return block, head


def stage_routed_params(shape: ModelShape, st: StageParams) -> float:
    """Routed-expert matmul params per token on a rank (top_k experts per MoE block): the part of
    stage_matmul_params's block that follows the routing."""
    return float(st.n_moe_layers * shape.top_k * shape.expert)


def stage_moe_whole_params(shape: ModelShape, st: StageParams) -> float:
    """Matmul params per token of the MoE blocks' router and shared experts on a rank: with the
    routed experts, what tensor parallelism leaves whole (launcher/parallel/tp.py: every TP rank
    runs the MoE on the full sequence, all-gathered under SP)."""
    return float(st.n_moe_layers * (shape.router + shape.n_shared_experts * shape.expert))


# Small matrix multiplications reach less of the peak: a heuristic knee (rows, columns) below
# which efficiency halves. Splitting a micro-batch's tokens over cp ranks or the FFN columns
# over tp ranks shrinks the GEMMs, which is why more TP/CP is not free even on NVLink.
TOKEN_KNEE = 512
WIDTH_KNEE = 512


def knee(rows: float, width: float) -> float:
    """The small-GEMM heuristic: rows/(rows + TOKEN_KNEE) x width/(width + WIDTH_KNEE)."""
    return rows / (rows + TOKEN_KNEE) * width / (width + WIDTH_KNEE)


def gemm_efficiency(shape: ModelShape, lay: Layout) -> float:
    """Fraction of `achievable_fraction` this layout's per-GPU matmuls reach (1.0 for large ones):
    every matmul but the routed experts' (those have expert_gemm_efficiency), whose rows are the
    micro-batch's tokens on the rank. Width: a dense model's FFN width over tp (most of its matmul
    FLOPs); an MoE model's remaining matmuls are its attention projections and shared experts,
    scored one by one (moe_block_gemm_knee)."""
    rows = lay.rank_microbatch_tokens
    if shape.n_moe_layers:
        return moe_block_gemm_knee(shape, rows, lay.mesh.tp)
    return knee(rows, shape.ffn_dim / lay.mesh.tp)


@lru_cache(maxsize=4096)
def moe_block_gemm_knee(shape: ModelShape, rows: float, tp: int) -> float:
    """The knee of an MoE block's matmuls other than the routed experts, FLOP-weighted: each
    attention projection (the family's layout; MLA's narrow latent ones score low) and each
    shared-expert matmul with its narrower side as the width (over tp where TP splits it)."""
    mms = [(m.in_features, m.out_features, m.split) for m in shape.attention_layout.linears]
    fe = shape.n_shared_experts * shape.moe_ffn_dim
    if fe:
        mms += [(shape.dim, fe, True), (shape.dim, fe, True), (fe, shape.dim, True)]
    flops = [i * o for i, o, _ in mms]
    scores = [knee(rows, min(i, o) / (tp if split else 1)) for i, o, split in mms]
    return sum(f * k for f, k in zip(flops, scores)) / sum(flops)


def expert_rows(shape: ModelShape, lay: Layout) -> float:
    """Rows one routed expert's GEMM gets per micro-batch on a rank, balanced routing: the rank's
    tokens x top_k copies spread over n_experts, gathered from the ep ranks that route to it."""
    tokens = lay.moe_tokens_per_rank
    return tokens * max(1, shape.top_k) * lay.mesh.ep / max(1, shape.n_experts)


def expert_gemm_efficiency(shape: ModelShape, lay: Layout) -> float:
    """Fraction of `achievable_fraction` the routed experts' grouped GEMMs reach: the same knee per
    expert, with that expert's rows (expert_rows) and its own width (moe_ffn_dim: TP leaves the
    routed experts whole). One grouped GEMM runs every local expert in one kernel, but each
    expert's tile grid is its own rows x width, which is what the knee scores."""
    return knee(expert_rows(shape, lay), shape.moe_ffn_dim)


def recompute_fraction(lay: Layout) -> float:
    """Share of the blocks whose forward is run twice (full recomputation)."""
    if lay.memory.ac_mode == "full":
        return 1.0
    if lay.memory.ac_mode == "selective" and lay.memory.ac_selective.isdigit() and int(lay.memory.ac_selective) > 0:
        return 1.0 / int(lay.memory.ac_selective)
    return 0.0  # op-level selective recomputes elementwise ops only: no matmul FLOPs


def alternate_mm_recompute_params(shape: ModelShape, st: StageParams, lay: Layout) -> float:
    """Matmul params per token whose forward runs again under selective=op_alternate_mm.

    launcher/parallel/ac.py recomputes every second mm of a block, in the order they run (the
    family's attention matmuls, then w1, w3, w2): wk, wo and w3 of the Llama block (dense blocks
    only: the validator refuses the policy for MoE models)."""
    if lay.memory.ac_mode != "selective" or lay.memory.ac_selective != "op_alternate_mm":
        return 0.0
    mms = shape.attention_layout.linears + shape.ffn_linears
    return st.n_layers * sum(m.in_features * m.out_features for m in mms[1::2])


def elementwise_recompute_fraction(lay: Layout) -> float:
    """Share of the blocks whose elementwise ops run twice: full AC, and op-level selective AC
    (launcher/parallel/ac.py saves matmul, attention and collective outputs and recomputes the rest)."""
    if lay.memory.ac_mode == "selective" and not lay.memory.ac_selective.isdigit():
        return 1.0
    return recompute_fraction(lay)


# FP8 GEMMs reach a smaller share of their (2x) tensor-core peak than BF16 GEMMs do of theirs:
# the FP8 rate meets the power and clock limit sooner, and the per-tensor scaling adds epilogue
# work. 0.84 is what torchtitan's published 8B pair (compile vs compile + float8, Table 1) implies
# once the casts (launcher/plan/estimate/elementwise.py) are costed; docs/planner.md.
FP8_GEMM_EFFICIENCY = 0.84


def matmul_peak(hw: Any, precision: str) -> float:
    """Dense tensor-core FLOP/s of the block matmuls for a precision: fp32 runs on TF32 tensor cores."""
    if precision == "fp8":
        return hw.fp8_tflops * 1e12 * FP8_GEMM_EFFICIENCY
    if precision == "fp32":
        return hw.tf32_tflops * 1e12
    return hw.bf16_tflops * 1e12


def microbatch_compute_s(shape: ModelShape, st: StageParams, lay: Layout, hw: Any) -> float:
    """Forward + backward of one micro-batch on one GPU of a pipeline rank."""
    tokens = lay.microbatch_tokens
    block, head = stage_matmul_params(shape, st)
    routed, whole = stage_routed_params(shape, st), stage_moe_whole_params(shape, st)
    rf = recompute_fraction(lay)
    # Recomputing a forward costs a third of forward+backward.
    block_flops = (6.0 * (block - routed - whole) * (1 + rf / 3)
                   + 2.0 * alternate_mm_recompute_params(shape, st, lay)) * tokens
    whole_flops = 6.0 * whole * (1 + rf / 3) * tokens
    # The busiest expert-parallel rank computes plan.moe_imbalance times the mean routed rows.
    routed_flops = 6.0 * routed * routed_load_factor(lay) * (1 + rf / 3) * tokens
    head_flops = 6.0 * head * tokens
    split = lay.mesh.tp * lay.mesh.cp  # each GPU of the TP x CP group computes its share
    eff = hw.achievable_fraction * gemm_efficiency(shape, lay)
    # Attention and the output layer stay in bf16 under fp8 (precision.fp8.exclude); fp32 runs use TF32.
    other_peak = matmul_peak(hw, "fp32" if lay.numerics.precision == "fp32" else "bf16") * eff
    block_peak = matmul_peak(hw, lay.numerics.precision) * eff
    # Routed experts under precision=fp8 (torchao's rowwise fp8 grouped GEMM, launcher/parallel/fp8.py)
    # at the bf16 rate: measured no faster than the bf16 grouped GEMM at Mixtral's shapes on an H100
    # (bench/gpu_moe.py, docs/benchmarks.md: 0.95x at 8,192 tokens, 1.10x at 32,768).
    expert_peak = (matmul_peak(hw, "bf16" if lay.numerics.precision == "fp8" else lay.numerics.precision)
                   * hw.achievable_fraction * expert_gemm_efficiency(shape, lay))
    # The MoE (router, shared and routed experts) runs on the rank's MoE tokens: split by cp, and by tp
    # when the experts are folded over TP (replicated, every TP rank runs the whole MoE).
    moe_s = (whole_flops / block_peak + (routed_flops / expert_peak if routed else 0.0)) / lay.moe_token_split
    matmul_s = ((block_flops / block_peak + head_flops / other_peak) / split + moe_s
                + attention_s(shape, st, lay, hw))
    memory_bound_s = elementwise_s(shape, lay, hw, st.n_layers, elementwise_recompute_fraction(lay),
                                   st.has_output, tokens / lay.mesh.cp)
    ring_s = 0.0 if is_allgather(lay) else ring_bookkeeping_s(shape, lay, hw, st.n_layers, rf, tokens / lay.mesh.cp)
    # All-gather CP under MLA: every rank up-projects the whole sequence's latent (cp_allgather.py).
    up_s = repeated_up_projection_flops(shape, lay, st.n_layers, rf) / block_peak
    return (matmul_s + memory_bound_s + ring_s + up_s + document_mask_s(st, lay, hw)
            + weight_cast_s(shape, st, lay, hw))


# Bytes per weight element of the casts an autocast step makes (weight_cast_s): forward, read the
# fp32 weight and write its bf16 copy; backward, read the bf16 weight gradient and write it in fp32.
CAST_FORWARD_BYTES = 4 + 2
CAST_BACKWARD_BYTES = 2 + 4
# torchao's Float8Linear (dynamic tensorwise scaling) reads its fp32 weight twice (amax, then the
# cast) and writes the fp8 weight and its transposed copy for the input-gradient GEMM.
FP8_CAST_FORWARD_BYTES = 4 + 4 + 1 + 1


def weight_cast_s(shape: ModelShape, st: StageParams, lay: Layout, hw: Any) -> float:
    """Memory-bound seconds per micro-batch of casting the matmul weights, on a rank whose native
    engine computes under autocast (no FSDP2: one sharding rank, launcher/engines/native.py
    _autocast). Autocast casts every fp32 matmul weight to bf16 in each forward (its cache lasts one
    forward) and the cast's backward writes the fp32 weight gradient: a pass over every weight each
    way. Under fp8 the converted Linears cast their fp32 weights to fp8 themselves
    (FP8_CAST_FORWARD_BYTES) and autocast casts only the output layer. The weights are the memory
    model's autocast copies (memory.autocast_cast_elements). FSDP2 gathers its units already in
    the compute dtype, so its cast is of the 1/N shard: not costed.

    Measured (bench/results/2026-11-23-h100/profile_8b_4layers_launcher_bf16_compile.txt, a 4-layer
    Llama-3-8B on one H100, 1.40 B matmul weights): aten::copy_ 8.4 ms per step, where these 12 B
    per weight (16.8 GB) take 6.3 ms at HBM_EFFICIENCY."""
    if lay.owners.sharding_backend != "native" or lay.fsdp_wraps or lay.numerics.precision not in ("bf16", "fp8"):
        return 0.0
    cast = autocast_cast_elements(st, shape, lay)
    nbytes = cast * (CAST_FORWARD_BYTES + CAST_BACKWARD_BYTES)
    if lay.numerics.precision == "fp8":
        as_bf16 = replace(lay, numerics=replace(lay.numerics, precision="bf16"))
        converted = autocast_cast_elements(st, shape, as_bf16) - cast
        nbytes += converted * (FP8_CAST_FORWARD_BYTES + CAST_BACKWARD_BYTES)
    return nbytes / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)


def attention_s(shape: ModelShape, st: StageParams, lay: Layout, hw: Any) -> float:
    """Attention-score matmul seconds of one micro-batch on one GPU: the 12 L h s FLOPs (plus a
    recomputed forward) at the bf16 (TF32 under fp32) rate, split over tp x cp; under context
    parallelism the ring's hops run at RING_HOP_EFFICIENCY (launcher/plan/estimate/ring.py)."""
    tokens = lay.microbatch_tokens
    rf = recompute_fraction(lay)
    attn_flops = attention_flops_per_token(st.n_layers, attention_width(shape), lay.batch.seq_len) * (1 + rf / 3) * tokens
    peak = matmul_peak(hw, "fp32" if lay.numerics.precision == "fp32" else "bf16") * hw.achievable_fraction
    hops = 1.0 if is_allgather(lay) else hop_time_factor(lay)  # all-gather: one kernel per layer
    return attn_flops / (peak * gemm_efficiency(shape, lay)) / (lay.mesh.tp * lay.mesh.cp) * hops


def document_mask_s(st: StageParams, lay: Layout, hw: Any) -> float:
    """Memory-bound seconds the document mask adds to one micro-batch of a stage (data.document_masking).

    "sdpa": building the [micro_batch, 1, s, s] mask (two boolean s x s temporaries and the additive
    mask written), then every layer's attention reading it in forward, backward and any recompute.
    "flex": nothing added: FlexAttention skips the blocks that cross documents, so the plain causal
    attention FLOPs (attention_flops_per_token, which counts the whole s x s) are an upper bound;
    its block-mask build is O((s/128)^2). Its FLOP saving (it depends on the document lengths) is
    not modelled."""
    if lay.document_mask != "sdpa":
        return 0.0
    # All-gather CP: each rank's queries (1/cp of them) over the whole sequence's keys.
    mask = lay.microbatch_tokens * lay.batch.seq_len / lay.mesh.cp
    built = mask * (2 + lay.act_bytes)
    reads = mask * lay.act_bytes * st.n_layers * (2 + recompute_fraction(lay))
    return (built + reads) / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)


def bubble_slots(lay: Layout) -> float:
    """Idle micro-batch slots of the pipeline per step (bubble = slots / m).

    GPipe and 1F1B: p-1; interleaved 1F1B with v chunks: (p-1)/v; the zero-bubble schedules
    fill about two thirds of it by deferring weight gradients (ZB-H1; zbv: V-shape, 2 chunks).
    """
    p, v = lay.mesh.pp, lay.vpp
    if p <= 1:
        return 0.0
    if lay.schedule in ("gpipe", "1f1b"):
        return float(p - 1)
    if lay.schedule == "interleaved_1f1b":
        return (p - 1) / v
    return (p - 1) / (3.0 * v)  # zero_bubble, zbv


def bubble_fraction(lay: Layout) -> float:
    return bubble_slots(lay) / max(1, lay.pp_microbatches)


# ----------------------------------------------------------------------------- communication


def estimate_comm(shape: ModelShape, lay: Layout, hw: Any, st: StageParams) -> List[Collective]:
    """Per-step communication of one GPU on pipeline rank `st` (the busiest one)."""
    out: List[Collective] = []
    m, a = lay.batch.microbatches, lay.act_bytes
    tokens = lay.rank_microbatch_tokens
    shared = st.shared / lay.mesh.tp
    routed = st.routed / lay.mesh.ep  # TP leaves the routed experts whole (folded or replicated)
    wb = 4.0 if lay.numerics.precision == "fp32" else (1.0 if lay.numerics.precision == "fp8" and lay.numerics.fp8_all_gather else 2.0)
    rb = 4.0 if (lay.numerics.reduce_dtype == "fp32" or lay.numerics.precision == "fp32") else 2.0
    ds = lay.owners.sharding_backend == "deepspeed"
    if ds:
        # DeepSpeed gathers its bf16/fp32 working parameters; gradients travel in
        # communication_data_type, which launcher/engines/deepspeed_config.py takes from reduce_dtype.
        wb = 4.0 if lay.numerics.precision == "fp32" else 2.0
    shard_dims: Tuple[str, ...] = ("dp_replicate", "dp_shard", "cp") if ds else ("dp_shard", "cp")
    n_shard = lay.fsdp_degree
    # Expert parameters shard over the ranks left after ep (innermost part of dp_shard*cp, *tp when
    # folded: the TP ranks then hold replicas of an expert shard that saw different tokens).
    families = [("", shared, n_shard, shard_dims)]
    if routed:
        families.append((" experts", routed, lay.expert_fsdp_degree,
                         shard_dims + (("tp",) if lay.experts_folded else ())))
    z = lay.memory.zero_stage
    dp_all = lay.mesh.dp * lay.mesh.cp
    for tag, psize, n, fam_dims in families:
        if z == 0 or n == 1:
            # Folded experts replicated over TP ranks that computed other tokens: summed over them too.
            over_tp = lay.mesh.tp // lay.mesh.ep if tag and lay.experts_folded and lay.mesh.tp > lay.mesh.ep else 1
            if dp_all * over_tp > 1:
                dims = ("dp_replicate", "dp_shard", "cp") + (("tp",) if over_tp > 1 else ())
                out.append(_coll(f"grad all-reduce{tag}", "all_reduce", dims, dp_all * over_tp, lay, hw, psize * rb, 1))
            continue
        # How often the sharded states are gathered/reduced per step. FSDP2 under torch's pipeline
        # schedules, or with accumulate_unsharded, skips the reduce and the reshard on all but the
        # last backward: once per step.
        if ds:
            per_mb = m if z >= 2 else 1
        else:
            per_mb = 1 if lay.fsdp_holds_unsharded else m
        ag_w = 0.5 if (ds and lay.deepspeed.zeropp_quantized_weights) else 1.0
        rs_w = 0.25 if (ds and lay.deepspeed.zeropp_quantized_gradients) else 1.0
        if z == 3 and not lay.fsdp_holds_unsharded:
            out.append(_coll(f"param all-gather fwd{tag}", "all_gather", fam_dims, n, lay, hw, psize * wb * ag_w, per_mb))
            # hpZ gathers the backward copy from its secondary partition inside the node.
            hpz = ds and lay.deepspeed.zeropp_hierarchical_partition > 1
            out.append(_coll(f"param all-gather bwd{tag}", "all_gather", fam_dims, n, lay, hw, psize * wb * ag_w, per_mb,
                             span=lay.gpus_per_node if hpz else 0))
        else:
            # ZeRO-1/2: parameters are gathered once (DeepSpeed: after the step) or per micro-batch (FSDP2).
            out.append(_coll(f"param all-gather{tag}", "all_gather", fam_dims, n, lay, hw, psize * wb, 1 if ds else per_mb))
        out.append(_coll(f"grad reduce-scatter{tag}", "reduce_scatter", fam_dims, n, lay, hw, psize * rb * rs_w, per_mb))
        if not ds and lay.mesh.dp_replicate > 1:
            out.append(_coll(f"HSDP grad all-reduce{tag}", "all_reduce", ("dp_replicate",), lay.mesh.dp_replicate,
                             lay, hw, psize / n * rb, per_mb))
    n_layers = st.n_layers
    rf = recompute_fraction(lay)
    if lay.mesh.tp > 1:
        x = tokens * shape.dim * a
        # 2 collectives per block forward (attention, FFN) and 2 backward; recompute repeats the forward ones.
        # A folded MoE (launcher/models/llama/tp.py folded_moe_plan) has none of its own under SP (it
        # takes and returns the rank's slice) and, without SP, one all-gather of its output forward
        # and one of its input's gradient backward (+ the recomputed forward's).
        folded_moe = st.n_moe_layers if lay.experts_folded else 0
        count = (n_layers - folded_moe) * m * (4 + 2 * rf) + folded_moe * m * (2 + rf)
        if lay.sp:
            out.append(_coll("TP all-gather (SP)", "all_gather", ("tp",), lay.mesh.tp, lay, hw, x, count))
            out.append(_coll("TP reduce-scatter (SP)", "reduce_scatter", ("tp",), lay.mesh.tp, lay, hw, x, count))
        else:
            out.append(_coll("TP all-reduce", "all_reduce", ("tp",), lay.mesh.tp, lay, hw, x, count))
            if folded_moe:
                out.append(_coll("TP all-gather (folded MoE)", "all_gather", ("tp",), lay.mesh.tp, lay, hw, x,
                                 folded_moe * m * (2 + rf)))
    if is_allgather(lay):
        # All-gather CP (cp_allgather.py): the whole sequence's K/V (MLA: latent + RoPE key) gathered
        # per layer in forward and again when recomputed; their gradients reduce-scattered in backward.
        kv = lay.microbatch_tokens * gathered_bytes_per_token(shape, lay)
        out.append(_coll("CP K/V all-gather", "all_gather", ("cp",), lay.mesh.cp, lay, hw, kv, n_layers * m * (1 + rf)))
        out.append(_coll("CP dK/dV reduce-scatter", "reduce_scatter", ("cp",), lay.mesh.cp, lay, hw, kv, n_layers * m))
    elif lay.mesh.cp > 1:
        # Ring attention (launcher/plan/estimate/ring.py): K/V, repeated to every query head, all-gathered in
        # forward, again when recomputed, and in backward; the fp32 dK/dV cross cp links per backward.
        kv = lay.microbatch_tokens * kv_bytes_per_token(shape, lay)
        out.append(_coll("CP K/V ring", "all_gather", ("cp",), lay.mesh.cp, lay, hw, kv, n_layers * m * (2 + rf)))
        dkv = kv / lay.mesh.cp * 4.0 / a
        out.append(_coll("CP dK/dV ring", "p2p", ("cp",), lay.mesh.cp, lay, hw, dkv, n_layers * m * lay.mesh.cp))
    n_moe = st.n_moe_layers
    if lay.mesh.ep > 1 and n_moe:
        # One dim-wide row per routed copy (launcher/parallel/ep.py: top_k copies per token, however
        # many land on one rank or node), the busiest rank's share; dispatch + combine, forward,
        # backward and any recomputed forward. Each part runs on its own link (EP_PARTS).
        # A rank dispatches the tokens it routes: its 1/tp slice with folded experts (replicated, every
        # TP rank dispatches the full sequence).
        x = lay.moe_tokens_per_rank * shape.top_k * shape.dim * a * routed_load_factor(lay)
        count = n_moe * m * (4 + 2 * rf)
        group = "dp_shard*cp*tp" if lay.experts_folded else "dp_shard*cp"
        for (name, where), share in zip(EP_PARTS, ep_peer_shares(lay)):
            if share > 0:
                nbytes = x * share * count
                out.append(Collective(name, "all_to_all", group, lay.mesh.ep, where, nbytes,
                                      nbytes / link_bandwidth(hw, where)))
    if lay.mesh.pp > 1:
        x = tokens * shape.dim * a / (lay.mesh.tp if lay.sp else 1)
        out.append(_coll("PP send/recv", "p2p", ("pp",), lay.mesh.pp, lay, hw, x, 2 * m * lay.vpp))
    if shape.correction_bias and lay.mesh.world_size > 1:
        # Aux-loss-free balancing (launcher/models/moe.py update_correction_bias): once per step, the
        # [n_layers, n_experts] fp32 expert loads summed over every rank, then a sign/add per bias.
        out.append(_coll("router bias all-reduce", "all_reduce", ("pp", "dp_replicate", "dp_shard", "cp"),
                         lay.mesh.world_size, lay, hw, correction_bias_bytes(shape), 1))
    return out


# The EP all-to-all's two parts: rows for peers in the same node travel over NVLink, rows for other
# nodes over the network, both at once (NCCL posts every peer's send together), so the slower part
# sets the time (_apply_overlap).
EP_PARTS = (("EP all-to-all, same-node peers", "intra"), ("EP all-to-all, other nodes", "inter"))


def ep_peer_shares(lay: Layout) -> Tuple[float, float]:
    """(share of a rank's EP all-to-all rows bound for peers in its own node, share bound for other
    nodes), balanced routing: the experts are spread evenly over the ep ranks, so each peer gets
    1/ep of the rows and the rank keeps its own 1/ep. The ep ranks are the innermost ep of
    dp_shard*cp, strided by tp: a node holds gpus_per_node / tp of them; folded over TP, the
    innermost ep of dp_shard*cp*tp, consecutive ranks: a node holds gpus_per_node of them.

    DeepSeek-V3's group-limited routing (model.n_group / topk_group, launcher/models/moe.py) bounds
    the nodes one token reaches, but not these shares: the runtime sends one row per routed expert,
    and under balanced routing a copy lands on the rank's own node with probability
    (ep ranks per node) / ep either way. Dispatchers that send one row per destination node
    (DeepEP, Megatron's HybridEP) are what the bound helps; the runtime has none (docs/planner.md)."""
    ep = lay.mesh.ep
    if ep <= 1:
        return 0.0, 0.0
    per_node = max(1, min(ep, lay.gpus_per_node // (1 if lay.experts_folded else lay.mesh.tp)))
    return (per_node - 1) / ep, (ep - per_node) / ep


def correction_bias_bytes(shape: ModelShape) -> float:
    """Bytes of the expert loads DeepSeek-V3's bias update reduces once per step (0 without the bias)."""
    return 4.0 * shape.n_layers * shape.n_experts if shape.correction_bias else 0.0


# ----------------------------------------------------------------------------- step time


def estimate_time(shape: ModelShape, lay: Layout, hw: Any, model_flops_per_token: float,
                  tokens_per_step: int, ranks: Optional[Sequence[int]] = None) -> Dict[str, Any]:
    """Step time, throughput and MFU; also returns the comm list of the slowest pipeline rank.

    `ranks` limits the pipeline ranks considered (the search passes the two ends).
    """
    stages = stage_params(shape, lay.mesh.pp, lay.vpp, lay.schedule, lay.pp_layers)
    if ranks is not None:
        stages = [stages[r] for r in sorted(set(ranks))]
    t_mb = [microbatch_compute_s(shape, st, lay, hw) for st in stages]
    slowest_i = max(range(len(stages)), key=lambda i: t_mb[i])
    st = stages[slowest_i]
    slowest = st.rank
    m = lay.batch.microbatches
    slots = bubble_slots(lay)
    compute_s = t_mb[slowest_i] * m
    comm = estimate_comm(shape, lay, hw, st)
    _apply_overlap(comm, lay, compute_s, st, attention_s(shape, st, lay, hw) * m)
    # An idle slot of the pipeline lasts one micro-batch of a stage as it runs: its compute and the
    # collectives it waits for inside its layers (TP, CP, EP), exposed on its critical path.
    in_microbatch = sum(c.exposed_s for c in comm if c.name.startswith(IN_MICROBATCH_COMM)) / m
    bubble_s = (t_mb[slowest_i] + in_microbatch) * slots
    optimizer_s = optimizer_step_s(st, lay, hw)
    exposed = sum(c.exposed_s for c in comm)
    step_s = compute_s + bubble_s + exposed + optimizer_s
    world = lay.mesh.world_size
    tokens_per_s_per_gpu = tokens_per_step / step_s / world
    flops_per_s_per_gpu = tokens_per_s_per_gpu * model_flops_per_token
    peak = peak_tflops(hw, lay.numerics.precision) * 1e12
    return {
        "step_s": step_s,
        "compute_s": compute_s,
        "bubble_s": bubble_s,
        "exposed_comm_s": exposed,
        "optimizer_s": optimizer_s,
        "muon": muon_step_s(st, lay, hw),
        "microbatch_s": t_mb[slowest_i],
        "slowest_stage": slowest,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_s,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "model_tflops_per_s_per_gpu": flops_per_s_per_gpu / 1e12,
        "mfu": flops_per_s_per_gpu / peak,
        "mfu_vs_bf16_peak": flops_per_s_per_gpu / (hw.bf16_tflops * 1e12),
        "peak_tflops": peak / 1e12,
        "comm": comm,
    }


# Collectives inside a micro-batch's layers (the compute stream waits for them): a pipeline's idle
# slots last as long as they do. FSDP's gathers and reductions, the optimizer's and the pipeline's
# own sends are per step or between micro-batches.
IN_MICROBATCH_COMM = ("TP", "CP", "EP")


def _apply_overlap(comm: List[Collective], lay: Layout, compute_s: float, st: StageParams,
                   attn_s: float = 0.0) -> None:
    """Set each collective's exposed time per the overlap assumptions in the module docstring;
    `attn_s`: the step's attention seconds on this rank, which the CP ring hides behind."""
    units = max(1, st.n_layers + (1 if st.has_embedding or st.has_output else 0))
    fsdp = [c for c in comm if "param all-gather" in c.name or "grad reduce-scatter" in c.name or "HSDP" in c.name]
    fsdp_s = sum(c.time_s for c in fsdp)
    if fsdp:
        # The first all-gather and last reduce-scatter of each micro-batch cannot hide behind compute.
        tail = fsdp_s * 2.0 / units
        hidden_budget = compute_s
        excess = max(0.0, fsdp_s - hidden_budget)
        for c in fsdp:
            c.exposed_s = (excess + tail) * (c.time_s / fsdp_s) if fsdp_s else 0.0
    for c in comm:
        if c.name.startswith("grad all-reduce"):
            # DDP buckets overlap the last micro-batch's backward (2/3 of its compute).
            c.exposed_s = max(0.0, c.time_s - compute_s / max(1, lay.batch.microbatches) * 2 / 3) + c.time_s / units
        elif c.name.startswith(("TP", "router bias")):
            c.exposed_s = c.time_s
        elif c.name.startswith(("CP K/V all-gather", "CP dK/dV reduce-scatter")):
            c.exposed_s = c.time_s  # on the compute stream, between the projections and the attention
        elif c.name.startswith("CP K/V"):
            # The gather runs behind the hops' attention kernels; what exceeds them is exposed.
            c.exposed_s = max(0.0, c.time_s - attn_s)
        elif c.name.startswith("CP dK/dV"):
            # Each hop's dK/dV travels during the next hop's kernels; the layer's last one after all
            # of them (a rank waits for it before the layer's backward ends): 1/cp of them exposed.
            c.exposed_s = c.time_s / lay.mesh.cp + max(0.0, c.time_s * (lay.mesh.cp - 1) / lay.mesh.cp - attn_s / 2)
        elif c.name.startswith("PP"):
            per_send = c.time_s / max(1, 2 * lay.batch.microbatches * lay.vpp)
            c.exposed_s = 2 * (lay.mesh.pp - 1) * per_send
    # The EP all-to-all is exposed (the runtime dispatches on the compute stream and waits); its
    # same-node and other-node parts run at once, so only the slower one adds to the step.
    ep = [c for c in comm if c.name.startswith("EP")]
    if ep:
        slowest = max(ep, key=lambda c: c.time_s)
        for c in ep:
            c.exposed_s = c.time_s if c is slowest else 0.0


def optimizer_step_s(st: StageParams, lay: Layout, hw: Any) -> float:
    """The optimizer's update (`optimizer_update_s`) plus gradient clipping on the GPU (none when
    the optimizer is offloaded: the host path prices it all)."""
    if lay.memory.offload_optimizer != "none" or lay.memory.offload_params != "none":
        return optimizer_update_s(st, lay, hw)
    return optimizer_update_s(st, lay, hw) + grad_clip_s(_local_params(st, lay), hw)


def _local_params(st: StageParams, lay: Layout) -> float:
    """Parameters of this rank's shard (after TP, EP and ZeRO's division)."""
    shared = st.shared / lay.mesh.tp
    routed = st.routed / lay.mesh.ep  # TP leaves the routed experts whole
    n = lay.fsdp_degree if lay.memory.zero_stage >= 1 else 1
    return shared / n + routed / (lay.expert_fsdp_degree if lay.memory.zero_stage >= 1 else 1)


def optimizer_update_s(st: StageParams, lay: Layout, hw: Any) -> float:
    """AdamW over the local shard: memory-bound on the GPU, or on the host when offloaded; with
    Muon (optim=muon or a Muon group), its parameters' elementwise step instead, plus Newton-Schulz
    and its gathers (`muon_step_s`). bench/muon.py compares this with optimizer.step()."""
    local = _local_params(st, lay)
    if lay.memory.offload_optimizer != "none" or lay.memory.offload_params != "none":
        pcie = hw.pcie_gbps * 1e9
        return local / HOST_ADAM_PARAMS_PER_S + local * (4 + 2) / pcie  # grads down, params up
    muon = muon_step_s(st, lay, hw)
    adamw = max(0.0, local - (muon["elements"] if muon else 0.0))
    # Read p, g, m, v (16 B) and write p, m, v (12 B) in fp32.
    return adamw * 28.0 / (hw.hbm_gbps * 1e9 * 0.7) + (muon["total_s"] if muon else 0.0)


def muon_step_s(st: StageParams, lay: Layout, hw: Any) -> Optional[Dict[str, Any]]:
    """Muon's part of one optimizer step on the busiest rank of pipeline rank `st` (None without
    Muon): its elementwise step (MUON_ELEMENTWISE_BYTES per local element at HBM bandwidth), the
    Newton-Schulz iterations of the matrices it owns (bf16 at the matmul peak x
    achievable_fraction x the small-GEMM knee of each shape) and the gathers of each matrix's shards
    to its owner and the scatters back (at the owner group's link bandwidth; the engine overlaps
    one bucket's exchange with the next one's Newton-Schulz, which the plan leaves out, an upper
    bound). The owners are the engine's (estimate/muon.py)."""
    work = stage_muon_work(st, lay)
    if work is None:
        return None
    elementwise_s = work.elements * MUON_ELEMENTWISE_BYTES / (hw.hbm_gbps * 1e9 * 0.7)
    peak = matmul_peak(hw, "bf16") * hw.achievable_fraction
    ns_s = sum(flops / (peak * knee(min(r, c), max(r, c))) for r, c, flops in work.ns_by_shape)
    comm_s = 0.0
    for kind, _, nbytes in work.traffic:
        dims = MUON_GATHER_DIMS[kind] + (("tp",) if kind == "experts" and lay.experts_folded else ())
        comm_s += nbytes / link_bandwidth(hw, placement(lay, dims))
    return {"elements": work.elements, "elementwise_s": elementwise_s, "ns_s": ns_s, "gather_scatter_s": comm_s,
            "total_s": elementwise_s + ns_s + comm_s, "ns_tflops": work.ns_flops / 1e12,
            "ns_imbalance": work.imbalance, "matrices": work.matrices,
            "gather_scatter_bytes": sum(b for _, _, b in work.traffic)}


# The mesh dimensions whose ranks share one Muon matrix's shards, per kind (estimate/muon.py
# MUON_KINDS): FSDP2's (dp_shard x cp) and TP's for a TP-split matrix, FSDP2's alone otherwise.
MUON_GATHER_DIMS = {"split": ("dp_shard", "cp", "tp"), "whole": ("dp_shard", "cp"), "experts": ("dp_shard", "cp")}


# Gradient clipping (launcher/engines/optim.py clip_grad_norm) per fp32 gradient element: the norm
# reads it (4 B), the scaling by min(1, max_norm / norm) reads and writes it (8 B). The scaling runs
# on the device whenever trainer.grad_clip > 0 (the default, 1.0, which the plan assumes), without a
# host check, so it is a full pass even when nothing is clipped.
GRAD_CLIP_BYTES = 4 + 8


def grad_clip_s(local_params: float, hw: Any) -> float:
    """Memory-bound seconds of clipping `local_params` gradients on the GPU. Measured (the profile
    of weight_cast_s, 1.92 B gradients on one H100): vector_norm 2.7 ms and _foreach_mul_ 5.7 ms
    per step, 12 B per gradient at 2.7-2.9 TB/s."""
    return local_params * GRAD_CLIP_BYTES / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)
