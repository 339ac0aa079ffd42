"""The Hugging Face format, mapped once: config.json keys <-> model.* and tensor names <-> ours.

Pure Python (no torch): the launcher checks a `model.init_from` folder before launch, and
`action=plan` stays instant. The tensor transforms themselves (RoPE permutation, expert
stacking) live in launcher/hf/weights.py and follow the `kind` of each entry here.

Supported architectures: Llama (dense, GQA, tied or untied embeddings) and Mixtral (every
block a top-k MoE without shared experts). Conventions that differ from ours:
- RoPE: our q/k rows rotate interleaved pairs (2i, 2i+1); HF Llama rotates halves (i, i+d/2).
  Each q/k head therefore needs a row permutation (kind "rope").
- Mixtral experts are stored per expert (`block_sparse_moe.experts.{e}.w1/w2/w3.weight`) even
  where transformers fuses them in memory; ours are stacked [E, ...] (kind "experts").
- A tied model has no `lm_head.weight`. Loading takes each tensor's dtype from its file; an export
  writes both `dtype` (transformers 5) and `torch_dtype` (4.x). RoPE's base is read from
  `rope_parameters.rope_theta` (5) or `rope_theta` (4.x), and both are written.
- RoPE scaling: Llama 3.1-3.3's `rope_type: llama3` (factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings) maps to model.rope_scaling; it is read from `rope_scaling`
  (4.x; transformers 5 still gives it precedence) or `rope_parameters` (5), and written to both.
  Other rope types (linear, dynamic, yarn, longrope) are refused by name.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")

# model.* keys that config.json decides (model=hf takes them from there; otherwise they must match).
SHAPE_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "tie_embeddings",
              "rope_theta", "norm_eps", "n_experts", "top_k", "n_shared_experts", "moe_ffn_dim",
              "n_dense_layers", "rope_scaling")
# The RoPE scaling types our model implements (HF rope_type -> model.rope_scaling.type) and their fields.
ROPE_TYPES = {"default": "none", "llama3": "llama3"}
LLAMA3_ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Filled by model=hf but not compared: a shorter model.max_seq_len only sizes the RoPE table.
FILL_ONLY_KEYS = ("max_seq_len",)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class TensorMap:
    """One of our parameters and the on-disk HF tensor(s) it comes from.

    kind: "plain" (same layout), "rope" (q/k: per-head row permutation, `heads` heads),
    "experts" (ours [E, a, b] stacks hf_names[e], each [a, b])."""

    ours: str
    hf_names: Tuple[str, ...]
    shape: Tuple[int, ...]  # our shape
    kind: str = "plain"
    heads: int = 0


def _rope_theta(hf: Dict[str, Any]) -> Optional[float]:
    params = hf.get("rope_parameters") or {}
    value = params.get("rope_theta", (hf.get("rope_scaling") or {}).get("rope_theta", hf.get("rope_theta")))
    return None if value is None else float(value)


def _rope_params(hf: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """(HF rope_type, its parameters): `rope_scaling` (4.x) first, as transformers 5 reads it, then
    `rope_parameters` (5). 4.x configs may say `type` instead of `rope_type`."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        return repr(params), {}
    return str(params.get("rope_type") or params.get("type") or "default"), params


def hf_rope_scaling(hf: Dict[str, Any]):
    """model.rope_scaling (a RopeScalingConfig) of a config.json. An unsupported rope type is kept
    by name (validation and unsupported_features refuse it; the model never runs it silently as
    plain RoPE); fields it lacks keep the schema defaults (unsupported_features names them)."""
    from launcher.config.schema import RopeScalingConfig

    rope_type, params = _rope_params(hf)
    if rope_type == "default":
        return RopeScalingConfig()
    d = RopeScalingConfig()
    return RopeScalingConfig(
        type=ROPE_TYPES.get(rope_type, rope_type), factor=float(params.get("factor", d.factor)),
        low_freq_factor=float(params.get("low_freq_factor", d.low_freq_factor)),
        high_freq_factor=float(params.get("high_freq_factor", d.high_freq_factor)),
        # transformers' own fallback when a llama3 config omits it
        original_max_position_embeddings=int(params.get("original_max_position_embeddings")
                                             or hf.get("max_position_embeddings") or d.original_max_position_embeddings))


def rope_scaling_summary(scaling) -> Dict[str, Any]:
    """model.rope_scaling (dataclass, DictConfig or dict) as a plain dict of what the model uses:
    {"type": "none"} or the llama3 fields. Equal summaries compute equal RoPE tables."""
    def get(key):
        return scaling[key] if isinstance(scaling, dict) else getattr(scaling, key)

    kind = str(get("type")) if scaling is not None else "none"
    if kind == "none":
        return {"type": "none"}
    return {"type": kind, "factor": float(get("factor")), "low_freq_factor": float(get("low_freq_factor")),
            "high_freq_factor": float(get("high_freq_factor")),
            "original_max_position_embeddings": int(get("original_max_position_embeddings"))}


def _same(key: str, a: Any, b: Any) -> bool:
    return rope_scaling_summary(a) == rope_scaling_summary(b) if key == "rope_scaling" else a == b


def _shown(key: str, value: Any) -> str:
    return repr(rope_scaling_summary(value)) if key == "rope_scaling" else repr(value)


def hf_model_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a config.json describes (Llama or Mixtral)."""
    moe = hf.get("model_type") == "mixtral"
    heads = int(hf["num_attention_heads"])
    fields = {
        "n_layers": int(hf["num_hidden_layers"]),
        "dim": int(hf["hidden_size"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "ffn_dim": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_theta": _rope_theta(hf) or 10000.0,
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "n_experts": int(hf["num_local_experts"]) if moe else 0,
        "top_k": int(hf["num_experts_per_tok"]) if moe else 0,
        "n_shared_experts": 0,
        "moe_ffn_dim": int(hf["intermediate_size"]) if moe else 0,
        "n_dense_layers": 0,
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "rope_scaling": hf_rope_scaling(hf),
    }
    return fields


def read_hf_config(folder: str) -> Dict[str, Any]:
    """config.json of a HF model folder (FileNotFoundError / ValueError with the reason)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err


def unsupported_features(hf: Dict[str, Any]) -> List[str]:
    """What in this config.json our model cannot reproduce (empty: supported)."""
    out = []
    model_type = hf.get("model_type")
    if model_type not in ("llama", "mixtral"):
        out.append(f"model_type={model_type!r} (supported: llama, mixtral)")
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act={hf.get('hidden_act')!r} (ours is SwiGLU: silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            out.append(f"{key}=true (our linear layers have no bias)")
    rope_type, params = _rope_params(hf)
    if rope_type not in ROPE_TYPES:
        out.append(f"RoPE scaling rope_type={rope_type!r} (supported: {', '.join(ROPE_TYPES)}; "
                   f"Llama 3.1-3.3's llama3 loads)")
    elif rope_type == "llama3":
        lacking = [k for k in LLAMA3_ROPE_FIELDS[:3] if params.get(k) is None]
        if lacking:
            out.append(f"RoPE scaling rope_type='llama3' without {', '.join(lacking)}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1 and partial != 1.0:
        out.append(f"partial_rotary_factor={partial!r} (ours rotates the whole head)")
    if hf.get("sliding_window"):
        out.append(f"sliding_window={hf['sliding_window']} (ours is full causal attention)")
    try:
        head_dim = hf.get("head_dim")
        if head_dim and int(head_dim) * int(hf["num_attention_heads"]) != int(hf["hidden_size"]):
            out.append(f"head_dim={head_dim} != hidden_size / num_attention_heads")
    except (KeyError, TypeError, ValueError):
        pass
    return out


def hf_config_for(model, dtype: str) -> Dict[str, Any]:
    """config.json (transformers 4.x and 5 both read it) for our `model` (ModelConfig)."""
    moe = model.n_experts > 0
    out: Dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if moe else "LlamaForCausalLM"],
        "model_type": "mixtral" if moe else "llama",
        "hidden_size": model.dim,
        "intermediate_size": (model.moe_ffn_dim or model.ffn_dim) if moe else model.ffn_dim,
        "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads,
        "head_dim": model.dim // model.n_heads,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm_eps,
        "rope_theta": model.rope_theta,
        **_hf_rope_entries(model),
        "tie_word_embeddings": bool(model.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": model.init_std,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    if moe:
        out.update({"num_local_experts": model.n_experts, "num_experts_per_tok": model.top_k,
                    "router_aux_loss_coef": model.aux_loss_coef, "sliding_window": None,
                    "output_router_logits": False})
    return out


def _hf_rope_entries(model) -> Dict[str, Any]:
    """config.json's RoPE keys for our model.rope_scaling: `rope_parameters` (transformers 5) and
    `rope_scaling` (4.x, and 5 gives it precedence; null when plain, so a source folder's value
    carried by the export's config.json cannot survive)."""
    summary = rope_scaling_summary(getattr(model, "rope_scaling", None))
    if summary["type"] == "none":
        return {"rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta}, "rope_scaling": None}
    hf_type = next(k for k, v in ROPE_TYPES.items() if v == summary["type"])
    fields = {k: summary[k] for k in LLAMA3_ROPE_FIELDS}
    return {"rope_parameters": {"rope_type": hf_type, "rope_theta": model.rope_theta, **fields},
            "rope_scaling": {"rope_type": hf_type, **fields}}


def tensor_maps(model) -> List[TensorMap]:
    """Every parameter of our model (ModelConfig `model`) with its HF source, in HF file order
    (embedding, blocks, final norm, head). Tied models have no lm_head entry."""
    hd = model.dim // model.n_heads
    q, kv = model.n_heads * hd, model.n_kv_heads * hd
    out = [TensorMap("tok_embeddings.weight", ("model.embed_tokens.weight",), (model.vocab_size, model.dim))]
    for i in range(model.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        out += [
            TensorMap(p + "attention_norm.weight", (h + "input_layernorm.weight",), (model.dim,)),
            TensorMap(p + "attention.wq.weight", (h + "self_attn.q_proj.weight",), (q, model.dim), "rope",
                      model.n_heads),
            TensorMap(p + "attention.wk.weight", (h + "self_attn.k_proj.weight",), (kv, model.dim), "rope",
                      model.n_kv_heads),
            TensorMap(p + "attention.wv.weight", (h + "self_attn.v_proj.weight",), (kv, model.dim)),
            TensorMap(p + "attention.wo.weight", (h + "self_attn.o_proj.weight",), (model.dim, q)),
            TensorMap(p + "ffn_norm.weight", (h + "post_attention_layernorm.weight",), (model.dim,)),
        ]
        if model.n_experts > 0 and i >= model.n_dense_layers:
            e, f = model.n_experts, model.moe_ffn_dim or model.ffn_dim
            moe = h + "block_sparse_moe."
            out.append(TensorMap(p + "moe.router.weight", (moe + "gate.weight",), (e, model.dim)))
            for w, shape in (("w1", (e, f, model.dim)), ("w2", (e, model.dim, f)), ("w3", (e, f, model.dim))):
                names = tuple(f"{moe}experts.{j}.{w}.weight" for j in range(e))
                out.append(TensorMap(f"{p}moe.experts.{w}", names, shape, "experts"))
        else:
            f = model.ffn_dim
            out += [
                TensorMap(p + "feed_forward.w1.weight", (h + "mlp.gate_proj.weight",), (f, model.dim)),
                TensorMap(p + "feed_forward.w2.weight", (h + "mlp.down_proj.weight",), (model.dim, f)),
                TensorMap(p + "feed_forward.w3.weight", (h + "mlp.up_proj.weight",), (f, model.dim)),
            ]
    out.append(TensorMap("norm.weight", ("model.norm.weight",), (model.dim,)))
    if not model.tie_embeddings:
        out.append(TensorMap("output.weight", ("lm_head.weight",), (model.vocab_size, model.dim)))
    return out


def hf_shapes(m: TensorMap) -> List[Tuple[str, Tuple[int, ...]]]:
    """(HF name, HF shape) of each on-disk tensor behind `m`."""
    if m.kind == "experts":
        return [(n, m.shape[1:]) for n in m.hf_names]
    return [(m.hf_names[0], m.shape)]


# ----------------------------------------------------------------------------- folder checks


def weight_files(folder: str) -> Dict[str, str]:
    """HF tensor name -> file name, from model.safetensors.index.json or a single model.safetensors."""
    root = Path(folder)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError) as err:
            raise ValueError(f"{index} is not a safetensors index ({err})") from err
    if (root / SINGLE_FILE).is_file():
        return {name: SINGLE_FILE for name in safetensors_header(root / SINGLE_FILE)}
    raise FileNotFoundError(f"{root} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def safetensors_header(path: Path) -> Dict[str, Dict[str, Any]]:
    """Tensor entries of a safetensors file's header; ValueError when the file is truncated/corrupt."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError(f"{path} is truncated ({size} bytes: no header)")
        n = struct.unpack("<Q", raw)[0]
        if 8 + n > size:
            raise ValueError(f"{path} is truncated (header of {n} bytes, file of {size})")
        try:
            header = json.loads(fh.read(n))
        except ValueError as err:
            raise ValueError(f"{path} has a corrupt header ({err})") from err
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path} is truncated ({size} bytes, its header needs {8 + n + end})")
    return header


def folder_problems(model, folder: str, check_shapes: bool = True) -> List[str]:
    """Every reason `model.init_from=folder` cannot load into `model` (a ModelConfig): missing
    or unreadable files, unsupported architecture, shape keys that differ, missing tensors.
    Reads config.json and the safetensors headers only (cheap for any model size)."""
    key = "model.init_from"
    fix_folder = "Fix: point model.init_from at a local Hugging Face folder (config.json + *.safetensors)."
    try:
        hf = read_hf_config(folder)
    except (FileNotFoundError, ValueError) as err:
        return [f"{key}={folder}: {err}. {fix_folder}"]
    problems = [f"{key}={folder}: config.json has {what}, which this launcher does not implement. "
                f"Fix: use a Llama or Mixtral checkpoint without it." for what in unsupported_features(hf)]
    if problems:
        return problems
    if check_shapes:
        try:
            fields = hf_model_fields(hf)
        except (KeyError, TypeError, ValueError) as err:
            return [f"{key}={folder}: config.json lacks or garbles {err}. {fix_folder}"]
        diffs = [f"model.{k}={_shown(k, getattr(model, k))} vs {_shown(k, fields[k])}" for k in SHAPE_KEYS
                 if not _same(k, getattr(model, k), fields[k])]
        if diffs:
            return [f"{key}={folder}: config.json disagrees with the model config: {', '.join(diffs)}. "
                    f"Fix: model=hf model.init_from={folder} (takes every shape key from config.json), "
                    f"or set those model.* keys to the config.json values."]
    try:
        files = weight_files(folder)
    except FileNotFoundError as err:
        return [f"{key}={folder}: {err}. {fix_folder}"]
    except ValueError as err:  # a truncated single file or a corrupt index
        return [f"{key}={folder}: {err}. Fix: copy that file again (complete)."]
    headers: Dict[str, Dict[str, Any]] = {}
    for fname in sorted(set(files.values())):
        path = Path(folder) / fname
        if not path.is_file():
            problems.append(f"{key}={folder}: shard {fname} (listed in {INDEX_FILE}) is missing. "
                            f"Fix: copy the complete checkpoint folder.")
            continue
        try:
            headers[fname] = safetensors_header(path)
        except (OSError, ValueError) as err:
            problems.append(f"{key}={folder}: {err}. Fix: copy {fname} again (complete).")
    if problems:
        return problems
    missing, wrong = [], []
    for m in tensor_maps(model):
        for name, shape in hf_shapes(m):
            fname = files.get(name)
            entry = headers.get(fname, {}).get(name) if fname else None
            if entry is None:
                missing.append(name)
            elif tuple(entry["shape"]) != tuple(shape):
                wrong.append(f"{name} {tuple(entry['shape'])} (expected {tuple(shape)})")
    if missing:
        problems.append(f"{key}={folder}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:3])}. "
                        f"Fix: a complete {hf.get('model_type')} checkpoint whose config.json matches its weights.")
    if wrong:
        problems.append(f"{key}={folder}: {len(wrong)} tensor(s) with the wrong shape, e.g. {', '.join(wrong[:3])}. "
                        f"Fix: a checkpoint whose config.json matches its weights.")
    return problems


def fill_from_hf(cfg) -> None:
    """model=hf: fill the model.* shape keys from config.json of model.init_from,
    and data.tokenizer from the folder's tokenizer.json when data=text has none (a DictConfig,
    edited in place before it becomes a JobConfig). Problems raise ConfigError."""
    from omegaconf import OmegaConf, open_dict

    from launcher.config.errors import ConfigError

    model = cfg.get("model")
    if model is None or OmegaConf.is_missing(model, "init_from") or not model.get("init_from"):
        if model is not None and model.get("name") == "hf":
            raise ConfigError(["model=hf takes its shape from a Hugging Face folder but model.init_from is not set. "
                               "Fix: model=hf model.init_from=/path/to/folder (with config.json)."])
        return
    folder = str(model.init_from)
    data = cfg.get("data")
    if data is not None and data.get("source") == "text" and not data.get("tokenizer"):
        tok = Path(folder) / "tokenizer.json"
        if tok.is_file():
            with open_dict(data):
                data.tokenizer = str(tok)
    # model=hf: every shape key from config.json (a yaml ??? cannot override a schema default in
    # OmegaConf's merge, so the name decides); max_seq_len only where left 0 (a user value wins).
    if model.get("name") == "hf":
        missing = list(SHAPE_KEYS) + [k for k in FILL_ONLY_KEYS if not model.get(k)]
    else:
        missing = [k for k in SHAPE_KEYS + FILL_ONLY_KEYS if OmegaConf.is_missing(model, k)]
    if not missing:
        return
    try:
        fields = hf_model_fields(read_hf_config(folder))
    except (FileNotFoundError, ValueError, KeyError) as err:
        raise ConfigError([f"model.init_from={folder}: cannot take model.{', model.'.join(missing)} from it ({err}). "
                           f"Fix: point model.init_from at a local Hugging Face folder with config.json."]) from err
    for k in missing:
        model[k] = fields[k]
