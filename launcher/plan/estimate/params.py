"""Parameter counts from a model shape, broken down the way the planner needs them.

Pure Python (no torch). The totals agree with `launcher.plan.estimate.flops.param_counts` (the FLOPs
module) and with `sum(p.numel())` of the model that `launcher.models` builds; the tests
check both. The breakdown separates what tensor, pipeline and expert parallelism divide
differently: the embedding table lives on the first pipeline stage, the output layer on the
last; routed experts are spread over the expert-parallel ranks; everything else is per block.

The per-component counts come from the model's family (launcher/models/<family>/params.py:
attention, norms, dense FFN, router, one expert, tables), and so does the attention's layout
(its matmul shapes, inner norms and head sizes: AttentionLayout) that the FLOPs, activation and
elementwise formulas of launcher/plan/ read instead of assuming a Llama block; which blocks are MoE from
launcher/models/shape.py. Every block has attention and two norms, and either a dense FFN or
a router with n_experts routed and n_shared_experts shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, FrozenSet, List, Tuple

from launcher.models.family import family_of
from launcher.models.shape import AttentionLayout, Linear, block_is_moe, moe_layer_ids, mtp_layers_of


@dataclass(frozen=True)
class ModelShape:
    """Per-component parameter counts (elements, not bytes)."""

    n_layers: int
    n_dense_layers: int  # blocks with a dense FFN (all of them in a dense model)
    n_moe_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    moe_ffn_dim: int
    vocab_size: int
    n_experts: int
    top_k: int
    n_shared_experts: int
    tie_embeddings: bool
    capacity_factor: float  # <= 0: dropless
    moe_layers: FrozenSet[int]  # indices of the MoE blocks (launcher/models/shape.py moe_layer_ids)
    # Parameter counts per component.
    attention: int  # wq + wk + wv + wo of one block
    block_norms: int  # the two RMSNorm weights of one block
    dense_ffn: int  # one dense SwiGLU FFN
    router: int  # one MoE router
    expert: int  # one routed (or shared) SwiGLU expert
    embedding: int  # input table
    output: int  # output projection (0 when tied)
    final_norm: int
    # Attention widths per token: q.k scores over qk_width (heads x head size), the weighted sum
    # of v over v_width; and the largest attention weight (elements, before TP). All three read
    # from attention_layout.
    qk_width: int
    v_width: int
    largest_attention_tensor: int
    # The family's block as the formulas read it (launcher/models/<family>/params.py): attention
    # matmuls, inner norms and head sizes; the dense FFN's matmuls in the order they run.
    attention_layout: AttentionLayout
    ffn_linears: Tuple[Linear, ...]
    # The router (MoE blocks): "softmax" or "sigmoid" scores, with DeepSeek-V3's correction bias
    # (aux-loss-free balancing) and group-limited routing over n_group groups.
    score_func: str
    correction_bias: bool
    n_group: int
    # Multi-token prediction (model.mtp_layers, launcher/models/mtp.py): depths, and how many of
    # their blocks are MoE. Each depth holds enorm, hnorm, head_norm, eh_proj (2 dim x dim) and one
    # block; it shares the embedding and the output head. On the last pipeline stage.
    mtp_depths: int = 0
    mtp_moe_depths: int = 0

    @property
    def mtp_total(self) -> int:
        """Parameters of the multi-token-prediction depths (shared tables not counted again)."""
        own = self.mtp_depths * (3 * self.dim + 2 * self.dim * self.dim)
        return (own + (self.mtp_depths - self.mtp_moe_depths) * self.dense_block
                + self.mtp_moe_depths * (self.moe_block_shared + self.moe_block_routed))

    @property
    def mtp_tp_replicated(self) -> int:
        """What TP replicates of the depths (launcher/parallel/tp.py mtp_depth_plan): the three norms
        and eh_proj of each, and their blocks' parts replicated like the main blocks'."""
        moe = self.mtp_moe_depths
        return (self.mtp_depths * (3 * self.dim + 2 * self.dim * self.dim + self.block_norms
                                   + self.attention_tp_replicated)
                + moe * (self.router + self.n_shared_experts * self.expert))

    @property
    def mtp_routed(self) -> int:
        return self.mtp_moe_depths * self.moe_block_routed

    @property
    def mtp_active(self) -> int:
        """mtp_total with top-k routed experts, plus each depth's use of the output head."""
        routed_unused = self.mtp_moe_depths * (self.n_experts - self.top_k) * self.expert
        return self.mtp_total - routed_unused + self.mtp_depths * self.vocab_size * self.dim

    @property
    def attention_tp_replicated(self) -> int:
        """Of `attention`: what tensor parallelism leaves whole on every rank (each family's TP plan):
        the inner norms' weights (Qwen3's per-head QK norms, MLA's latent norms) and the matmuls
        attention_layout marks unsplit (MLA's down-projections wq_a and wkv_a)."""
        lay = self.attention_layout
        return (sum(n.weight for n in lay.norms)
                + sum(m.in_features * m.out_features for m in lay.linears if not m.split))

    @property
    def dense_block(self) -> int:
        return self.attention + self.block_norms + self.dense_ffn

    @property
    def moe_block_shared(self) -> int:
        """Parameters of an MoE block that every expert-parallel rank holds (all but routed experts)."""
        return self.attention + self.block_norms + self.router + self.n_shared_experts * self.expert

    @property
    def moe_block_routed(self) -> int:
        return self.n_experts * self.expert

    @property
    def total(self) -> int:
        return (
            self.n_dense_layers * self.dense_block
            + self.n_moe_layers * (self.moe_block_shared + self.moe_block_routed)
            + self.embedding
            + self.output
            + self.final_norm
            + self.mtp_total
        )

    @property
    def active(self) -> int:
        """Parameters one token touches: top-k routed experts instead of all of them."""
        return (
            self.n_dense_layers * self.dense_block
            + self.n_moe_layers * (self.moe_block_shared + self.top_k * self.expert)
            + self.embedding
            + self.output
            + self.final_norm
            + self.mtp_active
        )

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers


def model_shape(model: Any) -> ModelShape:
    """Build the breakdown from a ModelConfig (or anything with its field names): the counts are
    the model family's (launcher/models/<family>/params.py), the block kinds launcher/models/shape.py's."""
    family = family_of(model).params_module()
    counts = family.component_counts(model)
    attention = family.attention_layout(model)
    layers = int(model.n_layers)
    n_experts = int(getattr(model, "n_experts", 0) or 0)
    moe_ids = moe_layer_ids(model)
    # The builder falls back to ffn_dim when moe_ffn_dim is unset.
    moe_ffn = (int(getattr(model, "moe_ffn_dim", 0) or 0) or int(model.ffn_dim)) if n_experts else 0
    return ModelShape(
        n_layers=layers,
        n_dense_layers=layers - len(moe_ids),
        n_moe_layers=len(moe_ids),
        dim=int(model.dim),
        n_heads=int(model.n_heads),
        n_kv_heads=int(model.n_kv_heads),
        # The query/key head (MLA: nope + rope channels; v heads may be smaller: attention_layout).
        head_dim=attention.qk_head_dim,
        ffn_dim=int(model.ffn_dim),
        moe_ffn_dim=moe_ffn,
        vocab_size=int(model.vocab_size),
        n_experts=n_experts,
        top_k=int(getattr(model, "top_k", 0) or 0) if n_experts else 0,
        n_shared_experts=int(getattr(model, "n_shared_experts", 0) or 0) if n_experts else 0,
        tie_embeddings=bool(getattr(model, "tie_embeddings", False)),
        capacity_factor=float(getattr(model, "capacity_factor", 0.0) or 0.0),
        moe_layers=moe_ids,
        **counts,
        qk_width=attention.n_heads * attention.qk_head_dim,
        v_width=attention.n_heads * attention.v_head_dim,
        largest_attention_tensor=max(m.in_features * m.out_features for m in attention.linears),
        attention_layout=attention,
        ffn_linears=family.ffn_linears(model),
        score_func=str(getattr(model, "score_func", "softmax") or "softmax"),
        correction_bias=bool(n_experts) and bool(getattr(family, "ROUTER_CORRECTION_BIAS", False)),
        n_group=int(getattr(model, "n_group", 1) or 1),
        mtp_depths=mtp_layers_of(model),
        mtp_moe_depths=sum(1 for k in range(mtp_layers_of(model)) if block_is_moe(model, layers + k)),
    )


def attention_width(shape: ModelShape) -> float:
    """h of the attention-FLOPs formula (launcher/plan/estimate/flops.py): the mean of the q.k and v widths."""
    return (shape.qk_width + shape.v_width) / 2


@dataclass(frozen=True)
class StageParams:
    """What one pipeline rank holds (all its model chunks), before TP/EP/ZeRO division."""

    rank: int
    layers: Tuple[int, ...]  # global block indices
    shared: int  # parameters every expert-parallel rank holds (attention, norms, dense FFN, tables...)
    routed: int  # routed-expert parameters of these blocks (divided by ep)
    largest_unit: int  # largest FSDP unit (a block, or the tables) before division, shared + routed
    has_embedding: bool
    has_output: bool

    n_moe_layers: int  # how many of `layers` are MoE blocks
    largest_tensor: int = 0  # elements of the largest parameter tensor (before TP)
    # Of `shared`: what tensor parallelism replicates instead of splitting (RMSNorm weights, the
    # attention's inner norms and unsplit matmuls: ModelShape.attention_tp_replicated; in MoE
    # blocks the router and shared experts, which launcher/parallel/tp.py leaves whole).
    tp_replicated: int = 0

    @property
    def n_layers(self) -> int:
        return len(self.layers)


def chunk_layer_counts(n_layers: int, chunks: int, explicit: Tuple[int, ...] = ()) -> List[int]:
    """Blocks per model chunk: the explicit list, or an even split (earlier chunks take the remainder)."""
    if explicit:
        return list(explicit)
    base, rem = divmod(n_layers, chunks)
    return [base + (1 if i < rem else 0) for i in range(chunks)]


def chunks_of_rank(rank: int, pp: int, vpp: int, schedule: str) -> List[int]:
    """Model chunks a pipeline rank runs: looped (r, r+pp, ...) or V-shaped for zbv (r, 2pp-1-r)."""
    if schedule == "zbv" and vpp == 2:
        return [rank, 2 * pp - 1 - rank]
    return [rank + i * pp for i in range(vpp)]


@lru_cache(maxsize=4096)
def stage_params(shape: ModelShape, pp: int, vpp: int = 1, schedule: str = "1f1b",
                 pp_layers: Tuple[int, ...] = ()) -> Tuple[StageParams, ...]:
    """Parameters per pipeline rank. The first chunk holds the embedding, the last the output layer.

    With tied embeddings and pp > 1 both ends would hold the table; the validator refuses
    that combination, but the count here stays correct (each end holds a copy).
    Cached: the search asks for the same split thousands of times. Returns a tuple.
    """
    chunks = pp * vpp
    counts = chunk_layer_counts(shape.n_layers, chunks, pp_layers)
    starts = [sum(counts[:i]) for i in range(chunks)]
    out: List[StageParams] = []
    for rank in range(pp):
        layers: List[int] = []
        has_emb = has_out = False
        for c in chunks_of_rank(rank, pp, vpp, schedule):
            layers.extend(range(starts[c], starts[c] + counts[c]))
            has_emb |= c == 0
            has_out |= c == chunks - 1
        shared = routed = largest = replicated = 0
        for i in layers:  # per block, because MoE and dense blocks differ
            if shape.is_moe_layer(i):
                s, r = shape.moe_block_shared, shape.moe_block_routed
                replicated += shape.router + shape.n_shared_experts * shape.expert
            else:
                s, r = shape.dense_block, 0
            replicated += shape.block_norms + shape.attention_tp_replicated
            shared += s
            routed += r
            largest = max(largest, s + r)
        if has_emb:
            shared += shape.embedding
            largest = max(largest, shape.embedding)
        if has_out:
            # Tied: the last stage needs the table too (only reachable with pp == 1).
            extra = shape.output if not shape.tie_embeddings else (shape.embedding if not has_emb else 0)
            shared += extra + shape.final_norm
            replicated += shape.final_norm
            largest = max(largest, extra + shape.final_norm)
            # Multi-token prediction lives with the output head (it reuses it), and away from the
            # first stage with its own copy of the embedding (launcher/parallel/pp.py).
            shared += shape.mtp_total - shape.mtp_routed
            routed += shape.mtp_routed
            replicated += shape.mtp_tp_replicated
            if shape.mtp_depths and not has_emb:
                shared += shape.embedding
        n_moe = sum(1 for i in layers if shape.is_moe_layer(i))
        tensors = [shape.largest_attention_tensor] if layers else [0]
        if n_moe < len(layers):
            tensors.append(shape.dim * shape.ffn_dim)
        if n_moe:
            # Routed experts are stored batched: one [n_experts, moe_ffn, dim] tensor per matrix.
            tensors.append(shape.n_experts * shape.moe_ffn_dim * shape.dim)
        if has_emb or has_out:
            tensors.append(shape.vocab_size * shape.dim)
        out.append(StageParams(rank, tuple(layers), shared, routed, largest, has_emb, has_out, n_moe,
                               max(tensors), replicated))
    return tuple(out)
