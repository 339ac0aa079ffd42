"""Llama and Mixtral in the Hugging Face format: config.json <-> model.*, tensor names and shapes.

Pure Python (no torch). The shared vocabulary (TensorMap, RoPE config keys) is in
launcher/models/hf_common.py, files and folder checks in launcher/hf/format.py, the transforms
named by each TensorMap's `kind` in launcher/hf/weights.py.

Conventions that differ from ours:
- RoPE: our q/k rows rotate interleaved pairs (2i, 2i+1); HF Llama rotates halves (i, i+d/2).
  Each q/k head therefore needs a row permutation (kind "rope").
- Mixtral experts are stored per expert (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`) even
  where transformers fuses them in memory; ours are stacked [E, ...] (kind "experts").
- A tied model has no `lm_head.weight`.
A llama-family config with experts (our own MoE decoder) is written as Mixtral.

The decoder-wide pieces (`decoder_fields`, `attention_maps`, `decoder_tensor_maps`) are shared
with the families whose blocks are Llama's plus a difference (Qwen3).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from launcher.models.hf_common import TensorMap, common_unsupported, hf_rope_entries, hf_rope_theta, rope_scaling_fields
from launcher.models.shape import head_dim_of, moe_layer_ids


def decoder_fields(hf: Dict[str, Any], family: str) -> Dict[str, Any]:
    """model.* keys every Llama-like config.json gives (attention, dense FFN, tables, RoPE);
    MoE keys at their dense values (the family's own function fills them)."""
    heads = int(hf["num_attention_heads"])
    dim = int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or 0)
    return {
        "family": family,
        "n_layers": int(hf["num_hidden_layers"]),
        "dim": dim,
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        # 0 keeps "dim // n_heads" implicit, as every Llama config of ours says it.
        "head_dim": 0 if head_dim in (0, dim // heads) else head_dim,
        "qk_norm": False,
        "ffn_dim": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": hf_rope_theta(hf) or 10000.0,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "n_experts": 0,
        "top_k": 0,
        "n_shared_experts": 0,
        "moe_ffn_dim": 0,
        "n_dense_layers": 0,
        "norm_topk_prob": True,
        "moe_layer_step": 1,
        "mlp_only_layers": [],
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "rope_scaling": rope_scaling_fields(hf),
    }


def hf_model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a Llama or Mixtral config.json describes."""
    moe = hf.get("model_type") == "mixtral"
    fields = decoder_fields(hf, "mixtral" if moe else "llama")
    if moe:
        fields.update(n_experts=int(hf["num_local_experts"]), top_k=int(hf["num_experts_per_tok"]),
                      moe_ffn_dim=int(hf["intermediate_size"]))
    return fields


def unsupported_features(hf: Dict[str, Any]) -> List[str]:
    """What in this Llama/Mixtral config.json our model cannot reproduce (empty: supported)."""
    out = common_unsupported(hf)
    if hf.get("sliding_window"):
        out.append(f"sliding_window={hf['sliding_window']} (ours is full causal attention)")
    return out


def decoder_config(model, dtype: str) -> Dict[str, Any]:
    """config.json keys every Llama-like decoder writes (architecture keys left to the family)."""
    return {
        "hidden_size": model.dim,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": head_dim_of(model),
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        **hf_rope_entries(model),
        "tie_word_embeddings": bool(model.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def hf_config_for(model, dtype: str) -> Dict[str, Any]:
    """config.json (transformers 4.x and 5 both read it) for a llama/mixtral ModelConfig."""
    moe = model.n_experts > 0
    out: Dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        **decoder_config(model, dtype),
        "mlp_bias": False,
    }
    if moe:
        out.update({"intermediate_size": model.moe_ffn_dim or model.ffn_dim,
                    "num_local_experts": model.n_experts, "num_experts_per_tok": model.top_k,
                    "router_aux_loss_coef": model.aux_loss_coef, "sliding_window": None,
                    "output_router_logits": False})
    return out


def attention_maps(model, p: str, h: str) -> List[TensorMap]:
    """The attention sub-layer of block prefix `p` (ours) / `h` (HF): q/k/v/o, and with qk_norm
    the per-head q/k norms (their weight [head_dim] is permuted like one head's rows)."""
    hd = head_dim_of(model)
    q, kv = model.n_heads * hd, model.n_kv_heads * hd
    out = [
        TensorMap(p + "attention_norm.weight", (h + "input_layernorm.weight",), (model.dim,)),
        TensorMap(p + "attention.wq.weight", (h + "self_attn.q_proj.weight",), (q, model.dim), "rope", model.n_heads),
        TensorMap(p + "attention.wk.weight", (h + "self_attn.k_proj.weight",), (kv, model.dim), "rope",
                  model.n_kv_heads),
        TensorMap(p + "attention.wv.weight", (h + "self_attn.v_proj.weight",), (kv, model.dim)),
        TensorMap(p + "attention.wo.weight", (h + "self_attn.o_proj.weight",), (model.dim, q)),
    ]
    if getattr(model, "qk_norm", False):
        out += [TensorMap(p + "attention.q_norm.weight", (h + "self_attn.q_norm.weight",), (hd,), "rope", 1),
                TensorMap(p + "attention.k_norm.weight", (h + "self_attn.k_norm.weight",), (hd,), "rope", 1)]
    return out


def dense_ffn_maps(model, p: str, h: str) -> List[TensorMap]:
    f = model.ffn_dim
    return [
        TensorMap(p + "feed_forward.w1.weight", (h + "mlp.gate_proj.weight",), (f, model.dim)),
        TensorMap(p + "feed_forward.w2.weight", (h + "mlp.down_proj.weight",), (model.dim, f)),
        TensorMap(p + "feed_forward.w3.weight", (h + "mlp.up_proj.weight",), (f, model.dim)),
    ]


def stacked_expert_maps(model, p: str, router: str, expert: Callable[[int, str], str]) -> List[TensorMap]:
    """Router and routed experts of an MoE block (prefix `p`): the HF router tensor `router` and
    expert e's matrix w1|w2|w3 at expert(e, w), stacked into our [E, ...] weights."""
    e, f = model.n_experts, model.moe_ffn_dim or model.ffn_dim
    out = [TensorMap(p + "moe.router.weight", (router,), (e, model.dim))]
    for w, shape in (("w1", (e, f, model.dim)), ("w2", (e, model.dim, f)), ("w3", (e, f, model.dim))):
        out.append(TensorMap(f"{p}moe.experts.{w}", tuple(expert(j, w) for j in range(e)), shape, "experts"))
    return out


def mixtral_moe_maps(model, p: str, h: str) -> List[TensorMap]:
    moe = h + "block_sparse_moe."
    return stacked_expert_maps(model, p, moe + "gate.weight", lambda e, w: f"{moe}experts.{e}.{w}.weight")


def decoder_tensor_maps(model, moe_maps: Callable[[Any, str, str], List[TensorMap]],
                        attn_maps: Callable[[Any, str, str], List[TensorMap]] = attention_maps) -> List[TensorMap]:
    """Every parameter of a Llama-like decoder with its HF source, in HF file order (embedding,
    blocks, final norm, head); each block's attention sub-layer (its input norm included) named
    by `attn_maps`, MoE blocks by `moe_maps`. Tied models have no lm_head."""
    out = [TensorMap("tok_embeddings.weight", ("model.embed_tokens.weight",), (model.vocab_size, model.dim))]
    moe_ids = moe_layer_ids(model)
    for i in range(model.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out += attn_maps(model, p, h)
        out.append(TensorMap(p + "ffn_norm.weight", (h + "post_attention_layernorm.weight",), (model.dim,)))
        out += moe_maps(model, p, h) if i in moe_ids else dense_ffn_maps(model, p, h)
    out.append(TensorMap("norm.weight", ("model.norm.weight",), (model.dim,)))
    if not model.tie_embeddings:
        out.append(TensorMap("output.weight", ("lm_head.weight",), (model.vocab_size, model.dim)))
    return out


def tensor_maps(model) -> List[TensorMap]:
    """Every parameter of a llama/mixtral ModelConfig with its HF source."""
    return decoder_tensor_maps(model, mixtral_moe_maps)
