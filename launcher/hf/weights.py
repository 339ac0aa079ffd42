"""Hugging Face weights in and out of a sharded model (any layout: FSDP2, TP, PP, EP).

- ``load_hf_weights(parts, folder, cfg)``: each rank reads, with safetensors' lazy slicing,
  only the box of each tensor its local shard holds (DTensor local shape + global offset, the
  same boxes torch.distributed.checkpoint reads), transformed to our layout on the fly. Host
  memory per rank is bounded by its shard plus, for q/k, at most one head either side. FP8
  block-quantized weights (config.json's quantization_config) are dequantized box by box on the
  way: the rank reads only the scale blocks that cover its box (launcher/hf/fp8_blocks.py).
- ``load_hf_buffers(parts, folder, cfg)``: only the mapped buffers (DeepSeek-V3's router
  correction bias), for DeepSpeed ZeRO-3, which loads its partitioned parameters itself.
- ``export_hf(parts, world, out_dir, cfg, dtype)``: streams one parameter at a time: the
  stage that owns it gathers the full tensor, global rank 0 writes it straight into its
  safetensors shard (header written first, from the shapes the config determines), so no
  rank ever holds more than one full parameter. dtype fp8_block writes the chosen linears as
  block-quantized e4m3 + float32 `*_scale_inv` (format.fp8_export_plan) and the rest in bf16.

Names, shapes and which transform applies: launcher/hf/format.py (the one mapping).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from launcher.hf.fp8_blocks import dequantize, quantize
from launcher.hf.format import (CONFIG_FILE, DTYPES, FP8_BLOCK, INDEX_FILE, TOKENIZER_FILES,
                                BlockQuant, TensorMap, block_quant_of, fp8_export_plan, hf_config_for,
                                read_hf_config, scale_grid, scale_name, tensor_maps, weight_files)
from launcher.models.family import FAMILY_PACKAGES
from launcher.models.init import canonical_name, local_box
from launcher.hf.tensor_stream import SafetensorsStreamWriter, TensorGather, tensor_nbytes
from launcher.models.layers import model_rope_table

log = logging.getLogger(__name__)

# Shard size of the export (transformers' own default for save_pretrained is 5 GB too).
MAX_SHARD_BYTES = 5 * 1024**3


# ----------------------------------------------------------------------------- layout transforms


def rope_hf_to_ours(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k rows, HF order (per head: the two halves) -> ours (per head: interleaved pairs)."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_ours_to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of rope_hf_to_ours."""
    rows = w.shape[0]
    d = rows // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf_tensors(m: TensorMap, full: torch.Tensor) -> List[Tuple[str, torch.Tensor]]:
    """Our full parameter -> the HF tensors it becomes (one, or one per expert)."""
    if m.kind == "rope":
        return [(m.hf_names[0], rope_ours_to_hf(full, m.heads))]
    if m.kind == "experts":
        return [(name, full[e]) for e, name in enumerate(m.hf_names)]
    if m.kind == "copies":
        return [(name, full) for name in m.hf_names]
    return [(m.hf_names[0], full)]


# ----------------------------------------------------------------------------- loading


class HfReader:
    """Lazy, sliced reads from a HF folder's safetensors files (one open handle per file)."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        try:
            self.files = weight_files(folder)
        except (FileNotFoundError, ValueError) as err:  # changed since the pre-launch check
            raise ValueError(f"model.init_from={folder}: {err}. Fix: copy the checkpoint folder again "
                             f"(complete).") from err
        try:
            self.quant = block_quant_of(read_hf_config(folder))
        except (FileNotFoundError, ValueError) as err:  # checked before launch; changed since
            raise ValueError(f"model.init_from={folder}: {err}. Fix: a folder whose config.json is complete and "
                             f"unquantized or FP8 block-quantized.") from err
        self._handles: Dict[str, object] = {}
        self.elements_read = 0  # what this rank fetched from disk (its shards, q/k rounded to whole heads)

    def _handle(self, name: str):
        fname = self.files.get(name)
        if fname is None:
            raise ValueError(f"{self.folder}: tensor {name} is in no safetensors file. "
                             f"Fix: a complete checkpoint folder.")
        if fname not in self._handles:
            path = self.folder / fname
            try:
                self._handles[fname] = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types for a bad file
                raise ValueError(f"cannot read {path} ({err}). Fix: copy {fname} again (complete).") from err
        return self._handles[fname]

    def read(self, name: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """hf tensor `name`[box] (box: (start, stop) per dim); an FP8 block-quantized weight
        comes back dequantized (float32)."""
        if self.quant is not None and scale_name(name) in self.files:
            return self._read_dequantized(name, box)
        out = self._slice(name, box)
        if out.dtype == torch.float8_e4m3fn:  # never cast FP8 bytes without their scales
            raise ValueError(f"{self.folder}: {name} is float8_e4m3fn but the folder has no {scale_name(name)} "
                             f"or config.json no FP8 quantization_config. Fix: a complete FP8 release.")
        return out

    def _slice(self, name: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        out = self._handle(name).get_slice(name)[tuple(slice(a, b) for a, b in box)]
        self.elements_read += out.numel()
        return out

    def _read_dequantized(self, name: str, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """weight[box] * its block scales, reading only the scale blocks the box touches."""
        (r0, r1), (c0, c1) = box
        b0, b1 = self.quant.block
        if r1 <= r0 or c1 <= c0:
            return torch.empty((max(r1 - r0, 0), max(c1 - c0, 0)))
        weight = self._slice(name, box)
        scales = self._slice(scale_name(name), [(r0 // b0, (r1 - 1) // b0 + 1), (c0 // b1, (c1 - 1) // b1 + 1)])
        return dequantize(weight, scales, (r0 % b0, c0 % b1), (b0, b1))

    def read_ours(self, m: TensorMap, box: Sequence[Tuple[int, int]]) -> torch.Tensor:
        """Our parameter m restricted to `box` (our coordinates), from the HF files."""
        if m.kind == "experts":
            (e0, e1), rest = box[0], box[1:]
            if e1 <= e0:
                return torch.empty((0, *[b - a for a, b in rest]))
            return torch.stack([self.read(m.hf_names[e], rest) for e in range(e0, e1)])
        if m.kind == "rope":
            (r0, r1), rest = box[0], box[1:]
            d = m.shape[0] // m.heads
            if r1 <= r0:
                return torch.empty((0, *[b - a for a, b in rest]))
            h0, h1 = r0 // d, (r1 - 1) // d + 1  # the whole heads the rows touch
            block = self.read(m.hf_names[0], [(h0 * d, h1 * d), *rest])
            return rope_hf_to_ours(block, h1 - h0)[r0 - h0 * d:r1 - h0 * d]
        return self.read(m.hf_names[0], box)


@torch.no_grad()
def load_hf_weights(parts: Sequence[nn.Module], folder: str, model_cfg) -> int:
    """Fill every parameter of this rank's model parts from HF folder `folder` (only the
    slices this rank holds) and rebuild the RoPE buffers. Returns the elements read from disk."""
    maps = {m.ours: m for m in tensor_maps(model_cfg)}
    reader = HfReader(folder)
    _log_unmapped(reader.files, maps.values(), folder)
    for part in parts:
        _load_tensors(reader, _mapped_tensors(part, maps), maps, model_cfg)
        if hasattr(part, "rope"):
            part.rope = model_rope_table(model_cfg, device=part.rope.device)
    return reader.elements_read


@torch.no_grad()
def load_hf_buffers(parts: Sequence[nn.Module], folder: str, model_cfg) -> int:
    """Fill only the buffers of `parts` that the HF maps name (DeepSeek-V3's router correction
    bias), whole, from HF folder `folder`: for an engine that loads the parameters its own way
    (DeepSpeed ZeRO-3 gathers each partitioned parameter; buffers are whole on every rank, so
    each rank reads them). Returns the elements read from disk."""
    maps = {m.ours: m for m in tensor_maps(model_cfg)}
    reader = HfReader(folder)
    for part in parts:
        _load_tensors(reader, mapped_buffers(part, maps), maps, model_cfg)
    return reader.elements_read


def _load_tensors(reader: HfReader, tensors: Sequence[Tuple[str, torch.Tensor]], maps: Dict[str, TensorMap],
                  model_cfg) -> None:
    """Copy into each (name, tensor) the box of its HF counterpart this rank holds."""
    folder = reader.folder
    for name, param in tensors:
        cname = canonical_name(name)
        m = maps.get(cname)
        if m is None:
            raise ValueError(f"parameter {cname} has no Hugging Face counterpart in model.family="
                             f"{model_cfg.family}'s tensor names (model {model_cfg.name}). Fix: model.init_from "
                             f"loads the {', '.join(FAMILY_PACKAGES)} families as their Hugging Face releases "
                             f"shape them: model=hf (every shape key from the folder's config.json), or that "
                             f"family's conf/model/*.yaml without extra shape options.")
        local, box = local_box(param)
        if local.numel() == 0:
            continue
        value = reader.read_ours(m, box)
        if tuple(value.shape) != tuple(local.shape):
            raise ValueError(f"{folder}: {m.hf_names[0]} gives {tuple(value.shape)} for {cname}'s "
                             f"shard {tuple(local.shape)}. Fix: a checkpoint whose config.json matches.")
        local.copy_(value.to(local.device, local.dtype))


def mapped_buffers(part: nn.Module, maps) -> List[Tuple[str, torch.Tensor]]:
    """(name, buffer) of every buffer of `part` that the HF maps (`maps`: our canonical names)
    name: DeepSeek-V3's e_score_correction_bias (state, not a parameter); RoPE tables are not mapped."""
    return [(n, b) for n, b in part.named_buffers() if canonical_name(n) in maps]


def _mapped_tensors(part: nn.Module, maps) -> List[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter of `part` and of its mapped buffers (mapped_buffers)."""
    return list(part.named_parameters()) + mapped_buffers(part, maps)


def _log_unmapped(files: Dict[str, str], maps, folder: str) -> None:
    """One log line for the folder's tensors no parameter reads (e.g. DeepSeek-V3's
    multi-token-prediction block, model.layers.61.*, with model.mtp_layers=0). The block scales of
    the weights we read are read with them, not skipped."""
    known = {n for m in maps for n in m.hf_names}
    known |= {scale_name(n) for n in known}
    extra = sorted(n for n in files if n not in known)
    if extra:
        layers = sorted({".".join(n.split(".")[:3]) for n in extra if n.startswith("model.layers.")})
        log.info("model.init_from=%s: skipping %d tensor(s) our model does not have (%s), e.g. %s", folder,
                 len(extra), "multi-token-prediction " + ", ".join(layers) if layers else "not built", extra[0])


# ----------------------------------------------------------------------------- export


def _shard_plan(entries: List[Tuple[str, Tuple[int, ...], torch.dtype]]) -> List[List[str]]:
    """HF names per output file (in order), at most MAX_SHARD_BYTES each; from the config alone,
    so every rank knows the file names before any tensor is written."""
    files: List[List[str]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        n = tensor_nbytes(shape, dtype)
        if files[-1] and size + n > MAX_SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def _export_entries(maps: List[TensorMap], dtype: torch.dtype, quantized: Dict[str, Tuple[int, int]]):
    """(HF name, shape, dtype) of every tensor an export writes, in file order: keep_fp32 tensors
    in float32, the `quantized` weights in e4m3 followed by their float32 block scales."""
    out = []
    for m in maps:
        shape = tuple(m.shape[1:] if m.kind == "experts" else m.shape)
        for name in m.hf_names:
            if name in quantized:
                out.append((name, shape, torch.float8_e4m3fn))
                out.append((scale_name(name), scale_grid(shape, quantized[name]), torch.float32))
            else:
                out.append((name, shape, torch.float32 if m.keep_fp32 else dtype))
    return out


def _owner_stages(parts: Sequence[nn.Module], world, mapped=frozenset()) -> Dict[str, int]:
    """Our canonical parameter (or `mapped` buffer) name -> the pipeline stage rank (pp local
    rank) that holds it."""
    mine = [canonical_name(n) for part in parts for n, _ in _mapped_tensors(part, mapped)]
    return {n: stage for stage, names in enumerate(TensorGather(world).stage_lists(mine)) for n in names}


@torch.no_grad()
def export_hf(parts: Sequence[nn.Module], world, out_dir: Path, model_cfg, dtype_name: str,
              tokenizer_files: Sequence[Path] = ()) -> None:
    """Write `out_dir` (config.json, model-0000k-of-0000n.safetensors, model.safetensors.index.json,
    tokenizer files) from this rank's parts; collective over all ranks, global rank 0 writes."""
    dtype = getattr(torch, DTYPES[dtype_name])
    maps = tensor_maps(model_cfg)
    quant: Optional[BlockQuant] = None
    quantized: Dict[str, Tuple[int, int]] = {}
    if dtype_name == FP8_BLOCK:
        quant, names = fp8_export_plan(model_cfg)
        quantized = {n: quant.block for n in names}
    mapped = {m.ours for m in maps}
    owners = _owner_stages(parts, world, mapped)
    params = {canonical_name(n): p for part in parts for n, p in _mapped_tensors(part, mapped)}
    gather = TensorGather(world)
    rank = gather.rank
    entries = _export_entries(maps, dtype, quantized)
    plan = _shard_plan(entries)
    n_files = len(plan)
    file_of = {name: k for k, names in enumerate(plan) for name in names}
    shapes = {n: shape for n, shape, _ in entries}
    dtypes = {n: dt for n, _, dt in entries}
    writers: Dict[int, SafetensorsStreamWriter] = {}
    final_dir = Path(out_dir)
    # Written aside and renamed when complete: a crash never leaves a half export named export/hf.
    out_dir = final_dir.with_name(final_dir.name + ".incomplete")
    if rank == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)

    def fname(k: int) -> str:
        return f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"

    for m in maps:
        owner = owners.get(m.ours)
        if owner is None:
            raise RuntimeError(f"no rank holds {m.ours}: the model parts do not cover the model")
        full = gather.full(params[m.ours] if owner == gather.pp_rank else None, tuple(m.shape), owner)
        if rank != 0:
            continue
        for name, t in to_hf_tensors(m, full):
            if name in quantized:
                q, scale = quantize(t, quant.block, power_of_two=quant.scale_fmt == "ue8m0")
                out = [(name, q), (scale_name(name), scale)]
            else:
                out = [(name, t.to(dtypes[name]))]
            for hf_name, value in out:
                k = file_of[hf_name]
                if k not in writers:
                    writers[k] = SafetensorsStreamWriter(out_dir / fname(k), plan[k], shapes, dtype, dtypes)
                writers[k].write(hf_name, value)
                if writers[k].next == len(plan[k]):
                    writers[k].close()
        del full
    if rank == 0:
        index = {"metadata": {"total_size": sum(tensor_nbytes(shapes[n], dtypes[n]) for n in shapes)},
                 "weight_map": {n: fname(file_of[n]) for n in sorted(file_of)}}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (out_dir / CONFIG_FILE).write_text(json.dumps(_export_config(model_cfg, DTYPES[dtype_name], quant), indent=2))
        for f in tokenizer_files:
            shutil.copy2(f, out_dir / Path(f).name)
        if final_dir.exists():
            shutil.rmtree(final_dir)
        os.replace(out_dir, final_dir)
        log.info("exported %d tensors in %d safetensors file(s) (%s%s) to %s", len(file_of), n_files, dtype_name,
                 f": {len(quantized)} weights in {quant.block[0]}x{quant.block[1]} e4m3 blocks" if quant else "",
                 final_dir)
    if dist.is_initialized():
        dist.barrier()


def _export_config(model_cfg, dtype: str, quant: Optional[BlockQuant] = None) -> dict:
    """config.json of the export: ours, on top of model.init_from's (which keeps the keys we do not
    manage, such as bos/eos token ids, for generation); `quantization_config` only when the export
    is block-quantized (an FP8 source's must not describe a bf16 or fp32 export)."""
    base: dict = {}
    src = Path(model_cfg.init_from) / CONFIG_FILE if getattr(model_cfg, "init_from", "") else None
    if src is not None and src.is_file():
        try:
            base = json.loads(src.read_text())
        except ValueError:
            base = {}
    base.pop("quantization_config", None)
    out = {**base, **hf_config_for(model_cfg, dtype)}
    if quant is not None:
        out["quantization_config"] = quant.config()
    return out


def tokenizer_files_for(tokenizer: str, init_from: str) -> List[Path]:
    """The tokenizer files an export carries: those beside the run's tokenizer.json (data.tokenizer),
    else those of the model.init_from folder (the model's own tokenizer); none otherwise."""
    folder = Path(tokenizer).parent if tokenizer else (Path(init_from) if init_from else None)
    if folder is None:
        return []
    out = [folder / n for n in TOKENIZER_FILES if (folder / n).is_file()]
    if tokenizer and Path(tokenizer).is_file() and Path(tokenizer).name != "tokenizer.json":
        out.append(Path(tokenizer))
    return out
