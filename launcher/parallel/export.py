"""Consolidate a sharded model (any layout) into one fp32 state dict and write it."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn


def gather_full_state_dict(parts: List[nn.Module], world) -> Optional[Dict[str, torch.Tensor]]:
    """Full fp32 CPU tensors on global rank 0 (None elsewhere). Collective over all ranks."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    local: Dict[str, torch.Tensor] = {}
    for part in parts:
        for name, t in get_model_state_dict(part).items():
            if isinstance(t, DTensor):
                t = t.full_tensor()  # collective on the tensor's own mesh
            local[name] = t.detach().to("cpu", torch.float32)
    if world is None:
        return local
    # Stages hold disjoint weights: collect one copy per pipeline stage on global rank 0.
    pp = world["pp"]
    coords_zero = all(world[d].get_local_rank() == 0 for d in ("dp_replicate", "dp_shard", "cp", "tp"))
    if not coords_zero:
        return None
    if pp.size() == 1:
        return local if dist.get_rank() == 0 else None
    gathered = [None] * pp.size() if pp.get_local_rank() == 0 else None
    dist.gather_object(local, gathered, dst=pp.mesh.flatten()[0].item(), group=pp.get_group())
    if gathered is None:
        return None
    full: Dict[str, torch.Tensor] = {}
    for d in gathered:
        full.update(d)
    return full


def write_state_dict(sd: Dict[str, torch.Tensor], path: Path, fmt: str) -> None:
    """fmt "fp32": torch.save; "safetensors": safetensors.torch.save_file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "fp32":
        torch.save(sd, path)
    elif fmt == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as e:
            raise RuntimeError(
                "checkpoint.export=safetensors needs the safetensors package: "
                "`pip install safetensors`, or use checkpoint.export=fp32 (torch.save)"
            ) from e
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    else:
        raise ValueError(f"export format {fmt!r} is not one of fp32|safetensors")
