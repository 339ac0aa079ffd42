"""Parameter counts of the DeepSeek-V3 decoder, per component (pure Python, no torch).

Per block: two RMSNorm weights; MLA attention: wq_a (dim x q_lora_rank) + its norm + wq_b
(q_lora_rank x n_heads*(qk_nope + qk_rope)), or wq (dim x n_heads*(qk_nope + qk_rope)) when
q_lora_rank is 0; wkv_a (dim x (kv_lora_rank + qk_rope)) + its norm; wkv_b (kv_lora_rank x
n_heads*(qk_nope + v_head)); wo (n_heads*v_head x dim). MoE blocks: router (dim x n_experts; the
e_score_correction_bias buffer is state, not a parameter), routed and shared SwiGLU experts of
width moe_ffn_dim. The attention widths: q.k over n_heads x (qk_nope + qk_rope) channels, the
weighted sum over n_heads x v_head (training materialises per-head keys and values; the
latent-cache trick is an inference one).
"""

from __future__ import annotations

from typing import Any, Dict

from launcher.models.llama.params import decoder_counts
from launcher.models.shape import mla_qk_head_dim


def mla_counts(model: Any) -> Dict[str, int]:
    """Elements of each MLA weight of one block (our names)."""
    dim, heads = int(model.dim), int(model.n_heads)
    qk, v = mla_qk_head_dim(model), int(model.v_head_dim)
    q_rank, kv_rank, rope = int(model.q_lora_rank), int(model.kv_lora_rank), int(model.qk_rope_head_dim)
    out = {}
    if q_rank > 0:
        out.update(wq_a=dim * q_rank, q_norm=q_rank, wq_b=q_rank * heads * qk)
    else:
        out["wq"] = dim * heads * qk
    out.update(wkv_a=dim * (kv_rank + rope), kv_norm=kv_rank,
               wkv_b=kv_rank * heads * (int(model.qk_nope_head_dim) + v), wo=heads * v * dim)
    return out


def component_counts(model: Any) -> Dict[str, int]:
    """Elements of each component (see launcher/plan/params.py ModelShape for the keys): MLA's
    attention, the rest as Llama's decoder counts it."""
    heads = int(model.n_heads)
    mla = mla_counts(model)
    return {
        "attention": sum(mla.values()),
        **decoder_counts(model),
        "qk_width": heads * mla_qk_head_dim(model),
        "v_width": heads * int(model.v_head_dim),
        "largest_attention_tensor": max(v for k, v in mla.items() if not k.endswith("norm")),
    }
