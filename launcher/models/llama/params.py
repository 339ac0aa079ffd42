"""Parameter counts of the Llama-style decoder (llama, mixtral, qwen3), per component.

Pure Python (no torch); launcher/plan/params.py turns them into the planner's ModelShape. Per
block: two RMSNorm weights; attention wq/wo (dim x n_heads*head_dim) and wk/wv
(dim x n_kv_heads*head_dim), no biases, plus two [head_dim] norms with qk_norm; a SwiGLU FFN of
three matrices; MoE blocks replace the FFN with a router (dim x n_experts), routed and shared
SwiGLU experts of width moe_ffn_dim.
"""

from __future__ import annotations

from typing import Any, Dict

from launcher.models.shape import head_dim_of


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


def component_counts(model: Any) -> Dict[str, int]:
    """Elements of each component (see launcher/plan/params.py ModelShape for the keys)."""
    dim, n_heads, n_kv = int(model.dim), int(model.n_heads), int(model.n_kv_heads)
    hd = head_dim_of(model)
    qk_norm = 2 * hd if getattr(model, "qk_norm", False) else 0
    return {
        "attention": 2 * dim * n_heads * hd + 2 * dim * n_kv * hd + qk_norm,
        **decoder_counts(model),
        # Attention matmul widths per token (FLOPs, activations): q and k heads x head size for
        # the scores, v heads x head size for the weighted sum.
        "qk_width": n_heads * hd,
        "v_width": n_heads * hd,
        "largest_attention_tensor": dim * n_heads * hd,
    }
