"""Qwen3 (`model_type: qwen3`) and Qwen3-MoE (`qwen3_moe`) in the Hugging Face format.

Pure Python. Llama's names plus `self_attn.q_norm` / `self_attn.k_norm` (one [head_dim] weight
each, permuted like one head's rows: RoPE pairs channels differently in HF and here, and the norm
comes before RoPE); MoE blocks as `mlp.gate` and per-expert `mlp.experts.{e}.gate_proj/up_proj/
down_proj` (transformers fuses them in memory, its files keep them per expert).

transformers' Qwen3MoeConfig defaults norm_topk_prob to false; the released checkpoints say true.
A config.json without the key reads as transformers reads it (false).
"""

from __future__ import annotations

from typing import Any, Dict, List

from launcher.models.hf_common import TensorMap, common_unsupported
from launcher.models.llama.hf import decoder_config, decoder_fields, decoder_tensor_maps, stacked_expert_maps

_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a Qwen3 or Qwen3-MoE config.json describes."""
    fields = decoder_fields(hf, "qwen3")
    fields["qk_norm"] = True
    # Released config.json files say num_experts; transformers 5 writes num_local_experts.
    n_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if hf.get("model_type") == "qwen3_moe" and n_experts > 0:
        fields.update(
            n_experts=n_experts, top_k=int(hf["num_experts_per_tok"]),
            moe_ffn_dim=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layer_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=sorted(int(i) for i in (hf.get("mlp_only_layers") or [])))
    return fields


def unsupported_features(hf: Dict[str, Any]) -> List[str]:
    """What in this Qwen3 config.json our model cannot reproduce (empty: supported)."""
    out = common_unsupported(hf)
    if hf.get("use_sliding_window"):
        out.append(f"use_sliding_window=true (sliding_window={hf.get('sliding_window')}; ours is full causal "
                   f"attention)")
    if hf.get("model_type") == "qwen3_moe" and int(hf.get("shared_expert_intermediate_size") or 0) > 0:
        out.append("shared_expert_intermediate_size > 0 (Qwen3-MoE has no shared expert; that is Qwen2-MoE)")
    return out


def hf_config_for(model, dtype: str) -> Dict[str, Any]:
    """config.json for a qwen3-family ModelConfig (Qwen3ForCausalLM or Qwen3MoeForCausalLM)."""
    moe = model.n_experts > 0
    out: Dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        **decoder_config(model, dtype),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": model.n_layers,
    }
    if moe:
        out.update({"num_experts": model.n_experts, "num_experts_per_tok": model.top_k,
                    "moe_intermediate_size": model.moe_ffn_dim or model.ffn_dim,
                    "norm_topk_prob": bool(model.norm_topk_prob),
                    "decoder_sparse_step": int(model.moe_layer_step),
                    "mlp_only_layers": sorted(int(i) for i in model.mlp_only_layers),
                    "router_aux_loss_coef": model.aux_loss_coef, "output_router_logits": False})
    return out


def qwen3_moe_maps(model, p: str, h: str) -> List[TensorMap]:
    mlp = h + "mlp."
    return stacked_expert_maps(model, p, mlp + "gate.weight",
                               lambda e, w: f"{mlp}experts.{e}.{_EXPERT_NAMES[w]}.weight")


def tensor_maps(model) -> List[TensorMap]:
    """Every parameter of a qwen3-family ModelConfig with its HF source."""
    return decoder_tensor_maps(model, qwen3_moe_maps)
