"""Shape rules every family's model and formulas share, in one place (pure Python, no torch).

The model builders, the parameter formulas of launcher/models/<family>/params.py and the planner
all read a model config through these functions, so a rule (which blocks are MoE, how big a head
is) cannot drift between what is built and what is planned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, FrozenSet, Tuple


@dataclass(frozen=True)
class Linear:
    """One matmul of a block: `in_features` -> `out_features` per token. `split`: tensor parallelism
    divides it (column- or row-wise); False: every TP rank holds it whole (MLA's down-projections)."""

    name: str
    in_features: int
    out_features: int
    split: bool = True


@dataclass(frozen=True)
class InnerNorm:
    """An RMSNorm inside attention (fp32, like the block norms): `width` elements per token it
    normalises, `weight` elements of its weight; `split` by TP with the heads or not; `feeds_linear`:
    its output is a matmul's input (saved for backward), else RoPE's (which saves nothing)."""

    name: str
    width: int
    weight: int
    split: bool
    feeds_linear: bool


@dataclass(frozen=True)
class AttentionLayout:
    """The attention of one block as the planner's formulas read it (launcher/plan/): its matmuls in
    the order they run, its inner norms, and the sizes of the scores and the weighted sum.

    q.k runs over n_heads x qk_head_dim per token, the weighted sum over n_heads x v_head_dim; keys
    and values have n_kv_heads heads; RoPE rotates rope_dim channels of every query head and of
    rope_k_heads key heads (1 under MLA: the shared RoPE key); `v_source`: the matmul whose output
    SDPA's v is a view of (so backward keeps that whole output); `assembled_qk`: q and k are
    concatenated from a no-RoPE and a RoPE part (MLA), one more copy of each."""

    linears: Tuple[Linear, ...]
    norms: Tuple[InnerNorm, ...]
    n_heads: int
    n_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    rope_dim: int
    rope_k_heads: int
    v_source: str
    assembled_qk: bool = False

    def linear(self, name: str) -> Linear:
        return next(m for m in self.linears if m.name == name)

    @property
    def weights(self) -> int:
        """Parameters of the attention: matmul weights and norm weights."""
        return sum(m.in_features * m.out_features for m in self.linears) + sum(n.weight for n in self.norms)


def head_dim_of(model: Any) -> int:
    """Size of one attention head: model.head_dim, or dim // n_heads where it is 0 (Llama)."""
    explicit = int(getattr(model, "head_dim", 0) or 0)
    return explicit or int(model.dim) // int(model.n_heads)


def is_mla(model: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3): model.kv_lora_rank > 0."""
    return int(getattr(model, "kv_lora_rank", 0) or 0) > 0


def rope_dim_of(model: Any) -> int:
    """Channels RoPE rotates per head: the head size, or under MLA qk_rope_head_dim (the decoupled
    RoPE part of each query head and the shared RoPE key)."""
    return int(model.qk_rope_head_dim) if is_mla(model) else head_dim_of(model)


def mla_qk_head_dim(model: Any) -> int:
    """Size of one MLA query/key head: qk_nope_head_dim + qk_rope_head_dim."""
    return int(model.qk_nope_head_dim) + int(model.qk_rope_head_dim)


def moe_layer_ids(model: Any) -> FrozenSet[int]:
    """Indices of the blocks whose feed-forward is a mixture of experts (empty for a dense model).

    Block i is MoE when n_experts > 0, i >= n_dense_layers (DeepSeek's first_k_dense_replace),
    i is not in mlp_only_layers and (i + 1) % moe_layer_step == 0 (Qwen3-MoE's decoder_sparse_step)."""
    return frozenset(i for i in range(int(model.n_layers)) if block_is_moe(model, i))


def block_is_moe(model: Any, index: int) -> bool:
    """Whether block `index` is MoE by moe_layer_ids' rule; also asked for the multi-token-prediction
    blocks, which HF numbers after the main ones (DeepSeek-V3's layer 61 is MoE)."""
    if int(getattr(model, "n_experts", 0) or 0) <= 0:
        return False
    first = int(getattr(model, "n_dense_layers", 0) or 0)
    step = max(1, int(getattr(model, "moe_layer_step", 1) or 1))
    dense = {int(i) for i in (getattr(model, "mlp_only_layers", None) or ())}
    return index >= first and index not in dense and (index + 1) % step == 0


def mtp_layers_of(model: Any) -> int:
    """The model's multi-token-prediction depths (model.mtp_layers; 0 when absent)."""
    return int(getattr(model, "mtp_layers", 0) or 0)


def mtp_loss_weight(model: Any, tokens_seen: float) -> float:
    """lambda of the multi-token-prediction loss after `tokens_seen` training tokens: the weight of
    the last [from_tokens, weight] step of model.mtp_loss_weights with from_tokens <= tokens_seen
    (0 before the first step)."""
    weight = 0.0
    for start, value in sorted((float(a), float(b)) for a, b in (getattr(model, "mtp_loss_weights", None) or ())):
        if start <= tokens_seen:
            weight = value
    return weight
