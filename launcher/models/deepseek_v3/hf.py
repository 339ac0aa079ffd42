"""DeepSeek-V3 (`model_type: deepseek_v3`) in the Hugging Face format: config.json <-> model.*,
tensor names and shapes. Pure Python.

- MLA: `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` (or `q_proj` when q_lora_rank is
  null), `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj` map to our wq_a, q_norm,
  wq_b (wq), wkv_a, kv_norm, wkv_b, wo in the same layout: transformers' DeepSeek-V3 RoPE is
  interleaved (`rope_interleave: true`, as released), pairs (2i, 2i+1) like ours, so the RoPE
  rows need no permutation (unlike Llama's halves). A config with rope_interleave false is refused.
- MoE blocks: `mlp.gate.weight` (router), `mlp.gate.e_score_correction_bias` (our
  moe.e_score_correction_bias, a buffer), per-expert `mlp.experts.{e}.gate_proj/up_proj/down_proj`
  stacked into [E, ...], `mlp.shared_experts.*` (one SwiGLU of n_shared_experts x
  moe_intermediate_size); the first first_k_dense_replace blocks are dense `mlp.*`.
- Multi-token prediction (launcher/models/mtp.py): num_nextn_predict_layers <-> model.mtp_layers
  (model=hf: the depths whose tensors the folder holds, hf_mtp_layers);
  depth k is `model.layers.{num_hidden_layers + k}`: `enorm`, `hnorm`, `eh_proj`, a full decoder
  block under the usual names, `shared_head.norm` (our mtp.{k}.enorm, hnorm, eh_proj, block.*,
  head_norm), and `embed_tokens` / `shared_head.head`, copies of the main model's embedding and
  output head (read from the main names, written under both). Depths the folder has beyond
  model.mtp_layers are skipped on load (one log line).
- q_lora_rank null <-> model.q_lora_rank 0; YaRN rope scaling <-> model.rope_scaling type yarn.
"""

from __future__ import annotations

from typing import Any, Dict, List

from launcher.models.hf_common import TensorMap, common_unsupported, hf_rope_entries
from launcher.models.llama.hf import decoder_fields, decoder_tensor_maps, dense_ffn_maps, stacked_expert_maps
from launcher.models.shape import block_is_moe, mla_qk_head_dim, mtp_layers_of

_EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def hf_model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a DeepSeek-V3 config.json describes: Llama's decoder keys, then MLA's and
    the router's."""
    n_experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 0)
    fields = decoder_fields(hf, "deepseek_v3")
    fields.update({
        "head_dim": 0,  # MLA's head sizes are its own keys (transformers' head_dim is the RoPE part)
        "n_experts": n_experts,
        "top_k": int(hf.get("num_experts_per_tok") or 0) if n_experts else 0,
        "n_shared_experts": int(hf.get("n_shared_experts") or 0) if n_experts else 0,
        "moe_ffn_dim": int(hf.get("moe_intermediate_size") or 0) if n_experts else 0,
        "n_dense_layers": int(hf.get("first_k_dense_replace") or 0) if n_experts else 0,
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "moe_layer_step": int(hf.get("moe_layer_freq") or 1),
        "max_seq_len": int(hf.get("max_position_embeddings", 4096)),
        "q_lora_rank": int(hf.get("q_lora_rank") or 0),
        "kv_lora_rank": int(hf["kv_lora_rank"]),
        "qk_nope_head_dim": int(hf["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(hf["qk_rope_head_dim"]),
        "v_head_dim": int(hf["v_head_dim"]),
        "score_func": "sigmoid",
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_group": int(hf.get("n_group") or 1),
        "topk_group": int(hf.get("topk_group") or 1),
    })
    return fields


def hf_mtp_layers(hf: Dict[str, Any], tensor_names) -> int:
    """The multi-token-prediction depths a folder holds: num_nextn_predict_layers, counting only
    the depths whose eh_proj is among `tensor_names` (transformers' save_pretrained keeps the key, 1
    by default, but builds and writes no MTP layer)."""
    declared, n = int(hf.get("num_nextn_predict_layers") or 0), int(hf["num_hidden_layers"])
    names = set(tensor_names)
    depths = 0
    while depths < declared and f"model.layers.{n + depths}.eh_proj.weight" in names:
        depths += 1
    return depths


def unsupported_features(hf: Dict[str, Any]) -> List[str]:
    """What in this DeepSeek-V3 config.json our model cannot reproduce (empty: supported)."""
    out = common_unsupported(hf, rope_types=("default", "yarn"))
    if hf.get("rope_interleave", True) is False:
        out.append("rope_interleave=false (ours rotates interleaved pairs, as DeepSeek-V3 is released)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        out.append(f"scoring_func={hf.get('scoring_func')!r} (DeepSeek-V3's router is sigmoid)")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        out.append(f"topk_method={hf.get('topk_method')!r} (ours is DeepSeek-V3's noaux_tc)")
    if int(hf.get("moe_layer_freq") or 1) != 1:
        out.append(f"moe_layer_freq={hf.get('moe_layer_freq')} (transformers builds every block from "
                   f"first_k_dense_replace on as MoE)")
    n_experts = int(hf.get("n_routed_experts") or 0)
    if n_experts and int(hf.get("n_group") or 1) > 1 and n_experts // int(hf["n_group"]) < 2:
        out.append(f"n_group={hf['n_group']} leaves fewer than 2 experts per group")
    return out


def hf_config_for(model, dtype: str) -> Dict[str, Any]:
    """config.json (DeepseekV3ForCausalLM) for a deepseek_v3 ModelConfig."""
    moe = model.n_experts > 0
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": model.dim,
        "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        **hf_rope_entries(model),
        "rope_interleave": True,
        "tie_word_embeddings": bool(model.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
        "q_lora_rank": int(model.q_lora_rank) or None,
        "kv_lora_rank": model.kv_lora_rank,
        "qk_nope_head_dim": model.qk_nope_head_dim,
        "qk_rope_head_dim": model.qk_rope_head_dim,
        "v_head_dim": model.v_head_dim,
        "head_dim": model.qk_rope_head_dim,
        "n_routed_experts": model.n_experts if moe else 0,
        "num_experts_per_tok": model.top_k if moe else None,
        "n_shared_experts": model.n_shared_experts if moe else 0,
        "moe_intermediate_size": (model.moe_ffn_dim or model.ffn_dim) if moe else 0,
        "first_k_dense_replace": model.n_dense_layers if moe else model.n_layers,
        "norm_topk_prob": bool(model.norm_topk_prob),
        "routed_scaling_factor": model.routed_scaling_factor,
        "n_group": model.n_group,
        "topk_group": model.topk_group,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": mtp_layers_of(model),
        "output_router_logits": False,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def mla_maps(model, p: str, h: str) -> List[TensorMap]:
    """The MLA sub-layer of block prefix `p` (ours) / `h` (HF)."""
    a, sa = p + "attention.", h + "self_attn."
    heads, qk = model.n_heads, mla_qk_head_dim(model)
    rank, kv_rank, rope = int(model.q_lora_rank), int(model.kv_lora_rank), int(model.qk_rope_head_dim)
    out = [TensorMap(p + "attention_norm.weight", (h + "input_layernorm.weight",), (model.dim,))]
    if rank > 0:
        out += [TensorMap(a + "wq_a.weight", (sa + "q_a_proj.weight",), (rank, model.dim)),
                TensorMap(a + "q_norm.weight", (sa + "q_a_layernorm.weight",), (rank,)),
                TensorMap(a + "wq_b.weight", (sa + "q_b_proj.weight",), (heads * qk, rank))]
    else:
        out.append(TensorMap(a + "wq.weight", (sa + "q_proj.weight",), (heads * qk, model.dim)))
    out += [TensorMap(a + "wkv_a.weight", (sa + "kv_a_proj_with_mqa.weight",), (kv_rank + rope, model.dim)),
            TensorMap(a + "kv_norm.weight", (sa + "kv_a_layernorm.weight",), (kv_rank,)),
            TensorMap(a + "wkv_b.weight", (sa + "kv_b_proj.weight",),
                      (heads * (int(model.qk_nope_head_dim) + int(model.v_head_dim)), kv_rank)),
            TensorMap(a + "wo.weight", (sa + "o_proj.weight",), (model.dim, heads * int(model.v_head_dim)))]
    return out


def deepseek_moe_maps(model, p: str, h: str) -> List[TensorMap]:
    mlp = h + "mlp."
    out = stacked_expert_maps(model, p, mlp + "gate.weight", lambda e, w: f"{mlp}experts.{e}.{_EXPERT_NAMES[w]}.weight")
    # transformers keeps the router and its bias in float32 (_keep_in_fp32_modules_strict): so does a
    # bf16 export (a bf16 bias could not hold bias_update_speed's small steps).
    out[0] = TensorMap(out[0].ours, out[0].hf_names, out[0].shape, keep_fp32=True)
    out.insert(1, TensorMap(p + "moe.e_score_correction_bias", (mlp + "gate.e_score_correction_bias",), (model.n_experts,),
                            keep_fp32=True))
    if model.n_shared_experts > 0:
        f = (model.moe_ffn_dim or model.ffn_dim) * model.n_shared_experts
        s = mlp + "shared_experts."
        out += [TensorMap(p + "moe.shared_experts.w1.weight", (s + "gate_proj.weight",), (f, model.dim)),
                TensorMap(p + "moe.shared_experts.w2.weight", (s + "down_proj.weight",), (model.dim, f)),
                TensorMap(p + "moe.shared_experts.w3.weight", (s + "up_proj.weight",), (f, model.dim))]
    return out


def mtp_maps(model, k: int) -> List[TensorMap]:
    """Multi-token-prediction depth k's own tensors (ours mtp.{k}., HF model.layers.{n_layers + k}.)."""
    i = int(model.n_layers) + k
    p, h = f"mtp.{k}.", f"model.layers.{i}."
    b = p + "block."
    dim = model.dim
    out = [TensorMap(p + "enorm.weight", (h + "enorm.weight",), (dim,)),
           TensorMap(p + "hnorm.weight", (h + "hnorm.weight",), (dim,)),
           TensorMap(p + "eh_proj.weight", (h + "eh_proj.weight",), (dim, 2 * dim))]
    out += mla_maps(model, b, h)
    out.append(TensorMap(b + "ffn_norm.weight", (h + "post_attention_layernorm.weight",), (dim,)))
    out += deepseek_moe_maps(model, b, h) if block_is_moe(model, i) else dense_ffn_maps(model, b, h)
    out.append(TensorMap(p + "head_norm.weight", (h + "shared_head.norm.weight",), (dim,)))
    return out


def _with_mtp_copies(m: TensorMap, names: List[str]) -> TensorMap:
    return TensorMap(m.ours, (*m.hf_names, *names), m.shape, kind="copies") if names else m


def tensor_maps(model) -> List[TensorMap]:
    """Every parameter (and the correction-bias buffers) of a deepseek_v3 ModelConfig with its HF
    source, in HF file order: Llama's decoder layout with MLA and DeepSeek's MoE blocks, then the
    multi-token-prediction depths (before the final norm and head); the embedding and the head are
    also written as each depth's embed_tokens and shared_head.head."""
    out = decoder_tensor_maps(model, deepseek_moe_maps, mla_maps)
    depths = mtp_layers_of(model)
    if not depths:
        return out
    layers = [f"model.layers.{int(model.n_layers) + k}." for k in range(depths)]
    embed_copies = [h + "embed_tokens.weight" for h in layers]
    head_copies = [h + "shared_head.head.weight" for h in layers]
    if model.tie_embeddings:  # no lm_head: the embedding is the head too
        embed_copies += head_copies
    out[0] = _with_mtp_copies(out[0], embed_copies)
    if not model.tie_embeddings:
        out[-1] = _with_mtp_copies(out[-1], head_copies)
    at = next(i for i, m in enumerate(out) if m.ours == "norm.weight")
    return out[:at] + [m for k in range(depths) for m in mtp_maps(model, k)] + out[at:]
