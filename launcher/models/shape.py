"""Shape rules every family's model and formulas share, in one place (pure Python, no torch).

The model builders, the parameter formulas of launcher/models/<family>/params.py and the planner
all read a model config through these functions, so a rule (which blocks are MoE, how big a head
is) cannot drift between what is built and what is planned.
"""

from __future__ import annotations

from typing import Any, FrozenSet


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
    if int(getattr(model, "n_experts", 0) or 0) <= 0:
        return frozenset()
    first = int(getattr(model, "n_dense_layers", 0) or 0)
    step = max(1, int(getattr(model, "moe_layer_step", 1) or 1))
    dense = {int(i) for i in (getattr(model, "mlp_only_layers", None) or ())}
    return frozenset(i for i in range(int(model.n_layers))
                     if i >= first and i not in dense and (i + 1) % step == 0)
