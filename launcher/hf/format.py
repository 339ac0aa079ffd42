"""The Hugging Face format, mapped once: config.json keys <-> model.* and tensor names <-> ours.

Pure Python (no torch): the launcher checks a `model.init_from` folder before launch, and
`action=plan` stays instant. The tensor transforms themselves (RoPE permutation, expert
stacking) live in launcher/hf/weights.py and follow the `kind` of each entry here.

Each model family maps its own architecture (launcher/models/<family>/hf.py: config.json keys,
tensor names and shapes); this module holds what every family shares and dispatches on
config.json's `model_type` (reading) or model.family (writing):
- the RoPE keys: the base from `rope_parameters.rope_theta` (transformers 5) or `rope_theta`
  (4.x), both written; Llama 3.1-3.3's `rope_type: llama3` (factor, low_freq_factor,
  high_freq_factor, original_max_position_embeddings) maps to model.rope_scaling, read from
  `rope_scaling` (4.x; transformers 5 still gives it precedence) or `rope_parameters` (5) and
  written to both. Other rope types are refused by name unless a family implements them;
- dtypes: loading takes each tensor's dtype from its file; an export writes both `dtype`
  (transformers 5) and `torch_dtype` (4.x);
- the folder checks (files, safetensors headers, shapes). model=hf's filling of model.* is the
  config's (launcher/config/hf_model.py), which reads config.json through this module.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Dict, List, Tuple

from launcher.models.hf_common import TensorMap, rope_scaling_summary  # TensorMap: launcher/hf/weights.py reads it here
from launcher.models.family import DEFAULT_FAMILY, family_for_hf_type, family_of, get_family, hf_model_types
from launcher.models.shape import head_dim_of

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "generation_config.json")

# model.* keys that config.json decides (model=hf takes them from there; otherwise they must match).
SHAPE_KEYS = ("family", "n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "ffn_dim",
              "vocab_size", "tie_embeddings", "rope_theta", "norm_eps", "n_experts", "top_k", "n_shared_experts",
              "moe_ffn_dim", "n_dense_layers", "norm_topk_prob", "moe_layer_step", "mlp_only_layers",
              "rope_scaling", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "score_func", "routed_scaling_factor", "n_group", "topk_group")
# What a family's map leaves out is at ModelConfig's default (the MLA and DeepSeek router keys for
# Llama-like families).
_SHAPE_DEFAULTS = {"q_lora_rank": 0, "kv_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0, "v_head_dim": 0,
                   "score_func": "softmax", "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1}
# Filled by model=hf but not compared: a shorter model.max_seq_len only sizes the RoPE table.
FILL_ONLY_KEYS = ("max_seq_len",)

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "rope_scaling":
        return rope_scaling_summary(a) == rope_scaling_summary(b)
    if key == "family":  # families that share one HF map (llama and mixtral) read each other's folders
        return get_family(str(a or DEFAULT_FAMILY)).hf == get_family(str(b)).hf
    if key == "mlp_only_layers":
        return sorted(a or []) == sorted(b or [])
    return a == b


def _shown(key: str, value: Any) -> str:
    return repr(rope_scaling_summary(value)) if key == "rope_scaling" else repr(value)


def _family_for_config(hf: Dict[str, Any]):
    spec = family_for_hf_type(hf.get("model_type"))
    if spec is None:
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}, which no model family reads "
                         f"(supported: {', '.join(hf_model_types())})")
    return spec


def hf_model_values(hf: Dict[str, Any]) -> Dict[str, Any]:
    """model.* values a config.json describes (its family's map, chosen by `model_type`), as
    plain values: rope_scaling is a dict (launcher/config/hf_model.py types it for ModelConfig)."""
    return {**_SHAPE_DEFAULTS, **_family_for_config(hf).hf_module().hf_model_fields(hf)}


def unsupported_features(hf: Dict[str, Any]) -> List[str]:
    """What in this config.json our models cannot reproduce (empty: supported)."""
    spec = family_for_hf_type(hf.get("model_type"))
    if spec is None:
        return [f"model_type={hf.get('model_type')!r} (supported: {', '.join(hf_model_types())})"]
    return spec.hf_module().unsupported_features(hf)


def hf_config_for(model, dtype: str) -> Dict[str, Any]:
    """config.json (transformers 4.x and 5 both read it) for our `model` (ModelConfig)."""
    return family_of(model).hf_module().hf_config_for(model, dtype)


def tensor_maps(model) -> List[TensorMap]:
    """Every parameter of our model (ModelConfig `model`) with its HF source, in HF file order."""
    return family_of(model).hf_module().tensor_maps(model)


def read_hf_config(folder: str) -> Dict[str, Any]:
    """config.json of a HF model folder (FileNotFoundError / ValueError with the reason)."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from err


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
                f"Fix: use a checkpoint of a supported family ({', '.join(hf_model_types())}) without it." for what in unsupported_features(hf)]
    if problems:
        return problems
    if check_shapes:
        try:
            fields = hf_model_values(hf)
            # Typed by model.rope_scaling's own class, whose defaults fill what config.json leaves
            # out, as loading does (launcher/config/hf_model.py); hf/ imports nothing from config/.
            fields["rope_scaling"] = type(model.rope_scaling)(**fields["rope_scaling"])
        except (KeyError, TypeError, ValueError) as err:
            return [f"{key}={folder}: config.json lacks or garbles {err}. {fix_folder}"]
        # head_dim 0 means dim // n_heads: compare the widths both sides mean.
        ours = {k: head_dim_of(model) if k == "head_dim" else getattr(model, k) for k in SHAPE_KEYS}
        theirs = dict(fields, head_dim=fields["head_dim"] or fields["dim"] // fields["n_heads"])
        diffs = [f"model.{k}={_shown(k, ours[k])} vs {_shown(k, theirs[k])}" for k in SHAPE_KEYS
                 if not _same(k, ours[k], theirs[k])]
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
