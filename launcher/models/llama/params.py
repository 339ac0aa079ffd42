"""Parameter counts of the Llama-style decoder (llama, mixtral, qwen3), per component.

Pure Python (no torch); launcher/plan/estimate/params.py turns them into the planner's ModelShape. Per
block: two RMSNorm weights; attention wq/wo (dim x n_heads*head_dim) and wk/wv
(dim x n_kv_heads*head_dim), no biases, plus two [head_dim] norms with qk_norm; a SwiGLU FFN of
three matrices; MoE blocks replace the FFN with a router (dim x n_experts), routed and shared
SwiGLU experts of width moe_ffn_dim.

`attention_layout` is the block's attention as the planner's FLOPs, activation and elementwise
formulas read it (launcher/models/shape.py AttentionLayout): the parameter count below is its sum.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

from launcher.models.shape import AttentionLayout, InnerNorm, Linear, head_dim_of


def decoder_counts(model: Any) -> Dict[str, int]:
    """The components outside attention, the same for every family with this decoder layout:
    block norms, the SwiGLU FFN, router and experts, embedding, output and final norm."""
    dim = int(model.dim)
    n_experts = int(getattr(model, "n_experts", 0) or 0)
    moe_ffn = (int(getattr(model, "moe_ffn_dim", 0) or 0) or int(model.ffn_dim)) if n_experts else 0
    vocab = int(model.vocab_size)
    return {
        "block_norms": 2 * dim,
        "dense_ffn": 3 * dim * int(model.ffn_dim),
        "router": dim * n_experts,
        "expert": 3 * dim * moe_ffn,
        "embedding": vocab * dim,
        "output": 0 if getattr(model, "tie_embeddings", False) else vocab * dim,
        "final_norm": dim,
    }


def ffn_linears(model: Any) -> Tuple[Linear, ...]:
    """The dense SwiGLU FFN's matmuls in the order they run (launcher/models/layers.py FeedForward)."""
    dim, f = int(model.dim), int(model.ffn_dim)
    return (Linear("w1", dim, f), Linear("w3", dim, f), Linear("w2", f, dim))


def attention_layout(model: Any) -> AttentionLayout:
    """Grouped-query attention (launcher/models/layers.py Attention): wq, wk, wv, wo, and with
    qk_norm (Qwen3) an RMSNorm over every query and key head before RoPE."""
    dim, n_heads, n_kv = int(model.dim), int(model.n_heads), int(model.n_kv_heads)
    hd = head_dim_of(model)
    norms: Tuple[InnerNorm, ...] = ()
    if getattr(model, "qk_norm", False):
        norms = (InnerNorm("q_norm", n_heads * hd, hd, True, False), InnerNorm("k_norm", n_kv * hd, hd, True, False))
    return AttentionLayout(
        linears=(Linear("wq", dim, n_heads * hd), Linear("wk", dim, n_kv * hd), Linear("wv", dim, n_kv * hd),
                 Linear("wo", n_heads * hd, dim)),
        norms=norms, n_heads=n_heads, n_kv_heads=n_kv, qk_head_dim=hd, v_head_dim=hd, rope_dim=hd,
        rope_k_heads=n_kv, v_source="wv")


def block_description(model: Any) -> str:
    """What the planner's activation formulas model, for the plan's assumptions line."""
    family = str(getattr(model, "family", None) or "llama")
    hd = head_dim_of(model)
    heads = f"{int(model.n_heads)}/{int(model.n_kv_heads)} heads x {hd}"
    parts = [f"QK-norm, {heads}" if getattr(model, "qk_norm", False) else f"GQA {heads}", "SwiGLU"]
    if int(getattr(model, "n_experts", 0) or 0):
        shared = int(getattr(model, "n_shared_experts", 0) or 0)
        parts.append(f"softmax router, top-{int(model.top_k)} of {int(model.n_experts)} experts"
                     + (f", {shared} shared" if shared else ""))
    name = {"qwen3": "Qwen3", "mixtral": "Mixtral"}.get(family, "Llama")
    return f"{name} block ({', '.join(parts)})"


def component_counts(model: Any) -> Dict[str, int]:
    """Elements of each component (see launcher/plan/estimate/params.py ModelShape for the keys)."""
    return {"attention": attention_layout(model).weights, **decoder_counts(model)}
