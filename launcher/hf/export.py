"""Consolidate a sharded model (any layout) into one fp32 file, streamed tensor by tensor.

Global rank 0 writes the file while the tensors are gathered one at a time
(launcher/hf/tensor_stream.py), so no rank holds more than one full tensor: host memory
per rank is bounded by the largest tensor, not the model. The formats are the usual single
files: ``fp32`` is what torch.save(state_dict) writes, ``safetensors`` what
safetensors.torch.save_file writes (both load with their usual loaders).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from launcher.hf.tensor_stream import SafetensorsStreamWriter, Shape, TensorGather, TorchSaveStreamWriter

FORMATS = ("fp32", "safetensors")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"export format {fmt!r} is not one of fp32|safetensors")


def _writer(path: Path, fmt: str, names: List[str], shapes: Dict[str, Shape]):
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "fp32":
        return TorchSaveStreamWriter(path, names, shapes)
    return SafetensorsStreamWriter(path, names, shapes, torch.float32)


@torch.no_grad()
def export_state(parts: Sequence[nn.Module], world, path: Path, fmt: str) -> None:
    """Write the model's full fp32 state dict (names as get_model_state_dict gives them) to `path`
    on global rank 0, one tensor at a time. Collective over all ranks (`world`: the mesh, or None
    for one process)."""
    _check_format(fmt)
    gather = TensorGather(world)
    local = {}
    for part in parts:
        local.update(get_model_state_dict(part))  # references to this rank's shards, no copies
    # Every stage's names and full shapes, so every rank knows the file's layout and the order of
    # the collectives; a name held by two stages (tied embeddings) is taken from the first.
    stages = gather.stage_lists([(n, tuple(t.shape)) for n, t in local.items()])
    order: List[Tuple[str, Shape, int]] = []
    seen = set()
    for stage, entries in enumerate(stages):
        for name, shape in entries:
            if name not in seen:
                seen.add(name)
                order.append((name, tuple(shape), stage))
    writer = None
    if gather.rank == 0:
        writer = _writer(Path(path), fmt, [n for n, _, _ in order], {n: s for n, s, _ in order})
    for name, shape, owner in order:
        full = gather.full(local.get(name) if owner == gather.pp_rank else None, shape, owner)
        if writer is not None:
            writer.write(name, full)
        del full
    if writer is not None:
        writer.close()


def write_state_dict(sd: Dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """Write a full state dict held in memory (fp32; written tensor by tensor, no second copy)
    as fmt "fp32" (torch.save's file) or "safetensors"."""
    write_streamed(path, fmt, {k: tuple(v.shape) for k, v in sd.items()}, sd.__getitem__, writes=True)


def write_streamed(path: Path, fmt: str, shapes: Dict[str, Shape],
                   fetch: Callable[[str], Optional[torch.Tensor]], writes: bool) -> None:
    """Write the tensors `shapes` names (in that order), each as `fetch(name)` returns it, so only
    one full tensor is held at a time. `fetch` may be a collective: every rank calls it for every
    name in the same order; only the rank with ``writes`` (the others' fetch may return None)
    opens and writes the file."""
    _check_format(fmt)
    writer = _writer(Path(path), fmt, list(shapes), shapes) if writes else None
    for name in shapes:
        full = fetch(name)
        if writer is not None:
            writer.write(name, full.detach().to("cpu", torch.float32))
        del full
    if writer is not None:
        writer.close()
