"""The Hugging Face vocabulary every model family's map speaks (pure Python, no torch).

launcher/models/<family>/hf.py maps one architecture (config.json keys, tensor names and shapes)
with these pieces: the TensorMap record (one of our parameters and its on-disk tensors), the
RoPE keys of config.json (read and written in transformers 4.x and 5 spellings) and the checks
every SwiGLU decoder family shares. They sit here, below the families, so the model layer needs
nothing above it; launcher/hf/ (files, folder checks, streaming, export) builds on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

# The RoPE scaling types our model implements (HF rope_type -> model.rope_scaling.type) and their fields.
ROPE_TYPES = {"default": "none", "llama3": "llama3"}
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# YaRN (DeepSeek-V3; the deepseek_v3 family only): model.rope_scaling.type "yarn" and its fields.
YARN_ROPE_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


@dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the on-disk HF tensor(s) it comes from.

    kind: "plain" (same layout), "rope" (q/k: per-head row permutation, `heads` heads),
    "experts" (ours [E, a, b] stacks hf_names[e], each [a, b]), "copies" (read from hf_names[0],
    written under every name: DeepSeek-V3's multi-token-prediction layer holds copies of the
    embedding and the output head).
    keep_fp32: written in float32 whatever the export dtype (transformers'
    _keep_in_fp32_modules_strict: DeepSeek-V3's router weight and correction bias)."""

    ours: str
    hf_names: Tuple[str, ...]
    shape: Tuple[int, ...]  # our shape
    kind: str = "plain"
    heads: int = 0
    keep_fp32: bool = False


def hf_rope_theta(hf: Dict[str, Any]) -> Optional[float]:
    params = hf.get("rope_parameters") or {}
    value = params.get("rope_theta", (hf.get("rope_scaling") or {}).get("rope_theta", hf.get("rope_theta")))
    return None if value is None else float(value)


def hf_rope_params(hf: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """(HF rope_type, its parameters): `rope_scaling` (4.x) first, as transformers 5 reads it, then
    `rope_parameters` (5). 4.x configs may say `type` instead of `rope_type`."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        return repr(params), {}
    return str(params.get("rope_type") or params.get("type") or "default"), params


def rope_scaling_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.rope_scaling's fields (a plain dict; launcher/config/hf_model.py makes the RopeScalingConfig)
    of a config.json. An unsupported rope type is kept by name (validation and
    unsupported_features refuse it; the model never runs it silently as plain RoPE); fields it
    lacks are left out (the schema defaults fill them; unsupported_features names them)."""
    rope_type, params = hf_rope_params(hf)
    if rope_type == "default":
        return {}
    out: Dict[str, Any] = {"type": ROPE_TYPES.get(rope_type, rope_type)}
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if params.get(key) is not None:
            out[key] = float(params[key])
    # transformers' own fallback when a llama3 config omits it
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
    if original:
        out["original_max_position_embeddings"] = int(original)
    if rope_type == "yarn":
        # transformers: beta_fast/beta_slow `or` 32/1, mscale*/truncate as given, a missing factor
        # is max_position_embeddings / original_max_position_embeddings.
        out["beta_fast"] = float(params.get("beta_fast") or 32)
        out["beta_slow"] = float(params.get("beta_slow") or 1)
        out["mscale"] = float(params.get("mscale") or 0)
        out["mscale_all_dim"] = float(params.get("mscale_all_dim") or 0)
        out["truncate"] = bool(params.get("truncate", True))
        if params.get("factor") is None and original and hf.get("max_position_embeddings"):
            out["factor"] = float(hf["max_position_embeddings"]) / float(original)
    return out


def rope_scaling_summary(scaling) -> Dict[str, Any]:
    """model.rope_scaling (dataclass, DictConfig or dict) as a plain dict of what the model uses:
    {"type": "none"} or the llama3 fields. Equal summaries compute equal RoPE tables."""
    def get(key):
        return scaling[key] if isinstance(scaling, dict) else getattr(scaling, key)

    kind = str(get("type")) if scaling is not None else "none"
    if kind == "none":
        return {"type": "none"}
    if kind == "yarn":
        return {"type": kind, "factor": float(get("factor")),
                "original_max_position_embeddings": int(get("original_max_position_embeddings")),
                "beta_fast": float(get("beta_fast")), "beta_slow": float(get("beta_slow")),
                "mscale": float(get("mscale")), "mscale_all_dim": float(get("mscale_all_dim")),
                "truncate": bool(get("truncate"))}
    return {"type": kind, "factor": float(get("factor")), "low_freq_factor": float(get("low_freq_factor")),
            "high_freq_factor": float(get("high_freq_factor")),
            "original_max_position_embeddings": int(get("original_max_position_embeddings"))}


def hf_rope_entries(model) -> Dict[str, Any]:
    """config.json's RoPE keys for our model.rope_scaling: `rope_parameters` (transformers 5) and
    `rope_scaling` (4.x, and 5 gives it precedence; null when plain, so a source folder's value
    carried by the export's config.json cannot survive)."""
    summary = rope_scaling_summary(getattr(model, "rope_scaling", None))
    if summary["type"] == "none":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}, "rope_scaling": None}
    if summary["type"] == "yarn":
        fields = {k: summary[k] for k in YARN_ROPE_FIELDS}
        if not summary["truncate"]:
            fields["truncate"] = False
        return {"rope_parameters": {"rope_type": "yarn", "rope_theta": model.rope_theta, **fields},
                "rope_scaling": {"rope_type": "yarn", **fields}}
    hf_type = next(k for k, v in ROPE_TYPES.items() if v == summary["type"])
    fields = {k: summary[k] for k in LLAMA3_ROPE_FIELDS}
    return {"rope_parameters": {"rope_type": hf_type, "rope_theta": model.rope_theta, **fields},
            "rope_scaling": {"rope_type": hf_type, **fields}}




def common_unsupported(hf: Dict[str, Any], rope_types: Tuple[str, ...] = tuple(ROPE_TYPES)) -> List[str]:
    """The checks every SwiGLU decoder family shares: activation, biases, RoPE type (one of
    `rope_types`) and partial rotation."""
    out = []
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={hf.get('hidden_act')!r} (ours is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            out.append(f"{key}=true (our linear layers have no bias)")
    rope_type, params = hf_rope_params(hf)
    if rope_type not in rope_types:
        out.append(f"RoPE scaling rope_type={rope_type!r} (supported: {', '.join(rope_types)}; "
                   f"Llama 3.1-3.3's llama3 loads)")
    elif rope_type == "llama3":
        lacking = [k for k in LLAMA3_ROPE_FIELDS[:3] if params.get(k) is None]
        if lacking:
            out.append(f"RoPE scaling rope_type='llama3' without {', '.join(lacking)}")
    elif rope_type == "yarn":
        if params.get("attention_factor") is not None:
            out.append(f"RoPE scaling rope_type='yarn' with attention_factor={params['attention_factor']!r} "
                       f"(ours derives it from factor, mscale and mscale_all_dim)")
        if params.get("factor") is None and not hf.get("max_position_embeddings"):
            out.append("RoPE scaling rope_type='yarn' without factor")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1 and partial != 1.0:
        out.append(f"partial_rotary_factor={partial!r} (ours rotates the whole head)")
    return out
