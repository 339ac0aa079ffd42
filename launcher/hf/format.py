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
- FP8 block quantization (DeepSeek-V3/V3.1's and Qwen3's `-FP8` releases): config.json's
  `quantization_config` (`quant_method: fp8`, `fmt: e4m3`, `weight_block_size`, optional
  `scale_fmt: ue8m0`) read into a BlockQuant; every other quant_method is refused by name. Each
  quantized weight W (N, K) has `W_scale_inv` (ceil(N/B0), ceil(K/B1)) beside it; the value is
  W[i, j] * W_scale_inv[i // B0, j // B1] (launcher/hf/fp8_blocks.py does the arithmetic);
- the folder checks (files, safetensors headers, shapes). model=hf's filling of model.* is the
  config's (launcher/config/hf_model.py), which reads config.json through this module.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

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
# Filled from config.json where negative (conf/model/hf.yaml: -1), else the config's value wins:
# model.mtp_layers (num_nextn_predict_layers) may build fewer multi-token-prediction depths than the
# folder holds (0: none; the rest are skipped on load); a missing depth's tensors are a folder problem.
FROM_FOLDER_WHEN_NEGATIVE = ("mtp_layers",)

# checkpoint.export_dtype -> the dtype of the exported tensors (config.json's `dtype`). fp8_block:
# bf16, except the block-quantized linears (e4m3 + float32 scales; export_quantized_names).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8_block": "bfloat16"}
FP8_BLOCK = "fp8_block"
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}

# FP8 block quantization, as DeepSeek-V3 released it (and Qwen3's -FP8 releases copy it).
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK_SIZE = (128, 128)  # what an fp8_block export writes
FP8_MAX = 448.0  # largest float8_e4m3fn: a block's amax maps to it
_E4M3_SAFETENSORS = "F8_E4M3"
_SCALE_FMTS = ("", "ue8m0")  # "" (absent): any float scale; ue8m0: powers of two


@dataclass(frozen=True)
class BlockQuant:
    """A folder's (or an export's) FP8 block quantization: `block` rows x columns share one scale;
    scale_fmt "ue8m0" means every scale is a power of two (DeepSeek-V3.1), "" any positive float."""

    block: Tuple[int, int] = FP8_BLOCK_SIZE
    scale_fmt: str = ""

    def config(self) -> Dict[str, Any]:
        """config.json's `quantization_config` for this quantization (DeepSeek-V3's keys)."""
        out: Dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": list(self.block)}
        if self.scale_fmt:
            out["scale_fmt"] = self.scale_fmt
        return out


def scale_name(name: str) -> str:
    """The scale tensor beside quantized weight `name` (`...weight` -> `...weight_scale_inv`)."""
    return name + SCALE_SUFFIX


def block_quant_of(hf: Dict[str, Any]) -> Optional[BlockQuant]:
    """The FP8 block quantization config.json declares (None: not quantized). ValueError naming
    what this launcher cannot dequantize (another quant_method, fmt, block or scale format)."""
    q = hf.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config={q!r} is not a mapping")
    method = str(q.get("quant_method", "")).lower()
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={q.get('quant_method')!r} (only FP8 block "
                         f"quantization, quant_method 'fp8', is dequantized on load)")
    if str(q.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"quantization_config.fmt={q.get('fmt')!r} (only e4m3 FP8 weights are read)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size={block!r} (FP8 block quantization needs "
                         f"[rows, columns], e.g. [128, 128]; per-tensor FP8 is not read)")
    scale_fmt = str(q.get("scale_fmt") or "")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"quantization_config.scale_fmt={scale_fmt!r} (read: absent or 'ue8m0')")
    return BlockQuant((int(block[0]), int(block[1])), scale_fmt)


def quantization_problems(folder: str, hf: Dict[str, Any]) -> List[str]:
    """A model.init_from folder whose quantization_config we cannot dequantize: one problem, with
    the fix (dequantize it with the tool that quantized it)."""
    try:
        block_quant_of(hf)
    except ValueError as err:
        return [f"model.init_from={folder}: config.json has {err}. Fix: dequantize the checkpoint with the tool "
                f"that quantized it (e.g. its library's dequantize/save to bf16) and point model.init_from at "
                f"that folder, or use the unquantized release."]
    return []


def scale_grid(shape: Tuple[int, ...], block: Tuple[int, int]) -> Tuple[int, int]:
    """The scale tensor's shape for a (N, K) weight: ceil(N / B0), ceil(K / B1) (edge blocks partial)."""
    return (-(-shape[0] // block[0]), -(-shape[1] // block[1]))


def default_quantized(m: TensorMap) -> bool:
    """Which of our tensors an fp8_block export quantizes when the source had none quantized
    (a from-scratch model): every 2-D weight of the decoder blocks except the router, DeepSeek-V3's
    release convention (embeddings, norms, lm_head, router and its bias stay unquantized; in a
    multi-token-prediction depth its decoder block, not eh_proj)."""
    in_block = m.ours.startswith("layers.") or (m.ours.startswith("mtp.") and ".block." in m.ours)
    if not in_block or m.ours.endswith("router.weight") or m.keep_fp32:
        return False
    return len(m.shape) == (3 if m.kind == "experts" else 2)


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
    if m.kind == "copies":
        return [(n, m.shape) for n in m.hf_names]
    return [(m.hf_names[0], m.shape)]


def fp8_export_plan(model) -> Tuple[BlockQuant, List[str]]:
    """What an fp8_block export of `model` (a ModelConfig) quantizes, and how: the HF tensors its
    model.init_from folder had quantized, with that folder's block size and scale format; for a
    model without an FP8 source (from scratch, or a bf16 folder) DeepSeek-V3's convention
    (default_quantized) in 128 x 128 blocks. Reads config.json and the safetensors headers only."""
    maps = tensor_maps(model)
    folder = getattr(model, "init_from", "") or ""
    quant, files = None, {}
    if folder and (Path(folder) / CONFIG_FILE).is_file():
        try:
            quant = block_quant_of(read_hf_config(folder))
            files = weight_files(folder) if quant is not None else {}
        except (FileNotFoundError, ValueError):
            quant = None  # the source moved or changed since training: the convention decides
    if quant is not None:
        names = [n for m in maps for n in m.hf_names if scale_name(n) in files]
        if names:
            return quant, names
    return BlockQuant(), [n for m in maps if default_quantized(m) for n in m.hf_names]


# ----------------------------------------------------------------------------- folder checks


def folder_mtp_layers(folder: str) -> int:
    """The multi-token-prediction depths of HF folder `folder` (its family's hf_mtp_layers over
    config.json and the weight files' tensor names; 0 for a family without any)."""
    hf = read_hf_config(folder)
    count = getattr(_family_for_config(hf).hf_module(), "hf_mtp_layers", None)
    return int(count(hf, weight_files(folder))) if count is not None else 0


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
    problems += quantization_problems(folder, hf)
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
    quant = block_quant_of(hf)
    missing, wrong, unscaled = [], [], []

    def entry_of(name: str):
        fname = files.get(name)
        return headers.get(fname, {}).get(name) if fname else None

    for m in tensor_maps(model):
        for name, shape in hf_shapes(m):
            entry = entry_of(name)
            if entry is None:
                missing.append(name)
            elif tuple(entry["shape"]) != tuple(shape):
                wrong.append(f"{name} {tuple(entry['shape'])} (expected {tuple(shape)})")
            elif entry["dtype"] == _E4M3_SAFETENSORS or scale_name(name) in files:
                # An FP8 weight is only meaningful with its block scales (and a block size to apply them).
                scale = entry_of(scale_name(name))
                if quant is None or scale is None or len(shape) != 2:
                    unscaled.append(name)
                elif tuple(scale["shape"]) != scale_grid(tuple(shape), quant.block):
                    wrong.append(f"{scale_name(name)} {tuple(scale['shape'])} (expected "
                                 f"{scale_grid(tuple(shape), quant.block)} for {list(quant.block)} blocks)")
    if missing:
        problems.append(f"{key}={folder}: {len(missing)} tensor(s) missing, e.g. {', '.join(missing[:3])}. "
                        f"Fix: a complete {hf.get('model_type')} checkpoint whose config.json matches its weights.")
    if wrong:
        problems.append(f"{key}={folder}: {len(wrong)} tensor(s) with the wrong shape, e.g. {', '.join(wrong[:3])}. "
                        f"Fix: a checkpoint whose config.json matches its weights.")
    if unscaled:
        problems.append(f"{key}={folder}: {len(unscaled)} FP8 weight(s) without their block scales or a "
                        f"quantization_config with weight_block_size, e.g. {', '.join(unscaled[:3])}. Fix: a complete "
                        f"FP8 release (each quantized WEIGHT with WEIGHT{SCALE_SUFFIX}, config.json's quantization_config).")
    return problems
