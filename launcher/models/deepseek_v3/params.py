"""Parameter counts of the DeepSeek-V3 decoder, per component (pure Python, no torch).

Per block: two RMSNorm weights; MLA attention: wq_a (dim x q_lora_rank) + its norm + wq_b
(q_lora_rank x n_heads*(qk_nope + qk_rope)), or wq (dim x n_heads*(qk_nope + qk_rope)) when
q_lora_rank is 0; wkv_a (dim x (kv_lora_rank + qk_rope)) + its norm; wkv_b (kv_lora_rank x
n_heads*(qk_nope + v_head)); wo (n_heads*v_head x dim). MoE blocks: router (dim x n_experts; the
e_score_correction_bias buffer is state, not a parameter), routed and shared SwiGLU experts of
width moe_ffn_dim. The attention widths: q.k over n_heads x (qk_nope + qk_rope) channels, the
weighted sum over n_heads x v_head (training materialises per-head keys and values; the
latent-cache trick is an inference one).

`attention_layout` gives these weights as the planner's formulas read them (matmul shapes, norms,
head sizes; launcher/models/shape.py AttentionLayout); the counts below are its sums.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

# ffn_linears: the dense blocks' SwiGLU is the shared decoder's (part of a family's params contract).
from launcher.models.llama.params import decoder_counts, ffn_linears  # noqa: F401
from launcher.models.shape import AttentionLayout, InnerNorm, Linear, mla_qk_head_dim

# Every MoE block's router holds e_score_correction_bias (launcher/models/deepseek_v3/model.py): the
# planner costs its elementwise work and its once-per-step update.
ROUTER_CORRECTION_BIAS = True


def attention_layout(model: Any) -> AttentionLayout:
    """MLA (launcher/models/deepseek_v3/model.py MLAttention): the down-projections wq_a and wkv_a
    and their latent norms are replicated under TP (launcher/models/deepseek_v3/tp.py), the
    up-projections column-wise, wo row-wise; v is a view of wkv_b's output; q and k are assembled
    from their no-RoPE part and the RoPE part (one shared RoPE key)."""
    dim, heads = int(model.dim), int(model.n_heads)
    qk, v = mla_qk_head_dim(model), int(model.v_head_dim)
    q_rank, kv_rank, rope = int(model.q_lora_rank), int(model.kv_lora_rank), int(model.qk_rope_head_dim)
    linears: Tuple[Linear, ...]
    norms: Tuple[InnerNorm, ...] = ()
    if q_rank > 0:
        linears = (Linear("wq_a", dim, q_rank, split=False), Linear("wq_b", q_rank, heads * qk))
        norms = (InnerNorm("q_norm", q_rank, q_rank, False, True),)
    else:
        linears = (Linear("wq", dim, heads * qk),)
    linears += (Linear("wkv_a", dim, kv_rank + rope, split=False),
                Linear("wkv_b", kv_rank, heads * (int(model.qk_nope_head_dim) + v)), Linear("wo", heads * v, dim))
    norms += (InnerNorm("kv_norm", kv_rank, kv_rank, False, True),)
    return AttentionLayout(linears=linears, norms=norms, n_heads=heads, n_kv_heads=heads, qk_head_dim=qk,
                           v_head_dim=v, rope_dim=rope, rope_k_heads=1, v_source="wkv_b", assembled_qk=True)


def block_description(model: Any) -> str:
    """What the planner's activation formulas model, for the plan's assumptions line."""
    q = f"q_lora {int(model.q_lora_rank)}, " if int(model.q_lora_rank) else ""
    mla = (f"MLA {int(model.n_heads)} heads, {q}kv_lora {int(model.kv_lora_rank)}, "
           f"qk {int(model.qk_nope_head_dim)}+{int(model.qk_rope_head_dim)}, v {int(model.v_head_dim)}")
    n_experts = int(getattr(model, "n_experts", 0) or 0)
    if not n_experts:
        return f"DeepSeek-V3 block ({mla}, SwiGLU)"
    groups = int(getattr(model, "n_group", 1) or 1)
    limited = f" in {int(model.topk_group)} of {groups} groups" if groups > 1 else ""
    router = "sigmoid router with correction bias" if model.score_func == "sigmoid" else "softmax router"
    shared = int(getattr(model, "n_shared_experts", 0) or 0)
    return (f"DeepSeek-V3 block ({mla}; {router}, top-{int(model.top_k)} of {n_experts} experts{limited}"
            f"{f', {shared} shared' if shared else ''}; first {int(getattr(model, 'n_dense_layers', 0) or 0)} dense)")


def component_counts(model: Any) -> Dict[str, int]:
    """Elements of each component (see launcher/plan/estimate/params.py ModelShape for the keys): MLA's
    attention, the rest as Llama's decoder counts it."""
    return {"attention": attention_layout(model).weights, **decoder_counts(model)}
