"""Layout-independent weight initialisation, each rank drawing only its own shard.

Choice: every parameter is cut into fixed tiles (``tile_shape``: 1024 x 1024 over its last two
dims, one row of each leading dim, a function of the parameter's shape only), and each tile's
values come from its own generator, seeded by (seed, the parameter's canonical name, the tile's
index). A rank draws only the tiles that overlap the shard it holds (its box in the full
parameter, from the DTensor's placements) and copies the overlap in, one tile at a time. So the
initial model is bit-identical whatever the layout (FSDP dim-0/dim-1 shards, TP column/row,
PP stages, EP, 1 or N ranks) on a given device type (CPU and CUDA generators draw different
numbers), while the cost per rank is its shard, rounded out to whole tiles: numbers drawn and
memory (one tile, 4 MiB, at a time), not the full parameter (a 405B model's embedding is ~8 GiB
in fp32). Values are drawn on the training device.

(Until 2026-11 every rank drew each full parameter from one generator per parameter: the values
changed once, with the tiles; runs resumed from a checkpoint are unaffected.)

Canonical names drop wrapper prefixes added by activation checkpointing, torch.compile and
FSDP1, so a wrapped model initialises exactly like a bare one.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from launcher.models.layers import model_rope_table

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name with wrapper components removed ("layers.0._orig_mod.x" -> "layers.0.x"); a
    pipeline's last-stage copy of the embedding (mtp_embeddings) is the embedding's: the same
    initial values, Hugging Face tensor and export."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    if name.startswith("mtp_embeddings."):
        name = "tok_embeddings." + name[len("mtp_embeddings."):]
    return name


# Tile extent of the last two dims (leading dims: one row per tile). Part of the initial values:
# changing it changes every initialised model.
TILE = 1024

Box = List[Tuple[int, int]]


def tile_shape(shape: Sequence[int]) -> Tuple[int, ...]:
    """The tile of a parameter of `shape` (a function of the shape only, never of the layout)."""
    n = len(shape)
    return tuple(1 if d < n - 2 else min(s, TILE) for d, s in enumerate(shape)) if n else ()


def _tile_seed(seed: int, name: str, index: Tuple[int, ...]) -> int:
    key = f"{seed}/{name}/{','.join(map(str, index))}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)


def _std(name: str, cfg) -> float:
    std = cfg.init_std
    # Output projections of each residual branch are scaled down with depth (GPT-2 style)
    # so the residual stream's variance does not grow with n_layers.
    if name.endswith("wo.weight") or name.endswith("w2.weight") or name.endswith("experts.w2"):
        std = std / math.sqrt(2 * cfg.n_layers)
    return std


def _is_fake(t: torch.Tensor) -> bool:
    return is_fake(t)


def _draw_tile(name: str, shape: Tuple[int, ...], index: Tuple[int, ...], cfg, seed: int,
               device: torch.device) -> torch.Tensor:
    """Tile `index` of parameter `name` (clipped to the parameter's edge), from its own generator."""
    tile = tile_shape(shape)
    extent = tuple(min(t, s - i * t) for t, s, i in zip(tile, shape, index))
    gen = torch.Generator(device=device)
    gen.manual_seed(_tile_seed(seed, name, index))
    t = torch.empty(extent, dtype=torch.float32, device=device)
    std = _std(name, cfg)
    if name == "tok_embeddings.weight":
        return t.normal_(0.0, std, generator=gen)
    return nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=gen)


@torch.no_grad()
def init_box(out: torch.Tensor, name: str, shape: Sequence[int], box: Box, cfg, seed: int,
             device: torch.device) -> None:
    """Fill `out` (shaped like `box`) with parameter `name`'s initial values at `box` (per dim:
    (start, stop) in the full parameter of `shape`), drawing only the tiles that overlap it, one
    at a time on `device`."""
    shape = tuple(shape)
    if _is_fake(out):
        # The rehearsal (FakeTensorMode): no values to draw. trunc_normal_'s rejection loop
        # reads values (mask.any()), which a fake tensor cannot give; torch's init skips meta
        # tensors the same way. Real tensors never take this branch.
        return
    if name.endswith("norm.weight"):
        out.fill_(1.0)
        return
    if any(b <= a for a, b in box):
        return
    tile = tile_shape(shape)
    ranges = [range(a // t, (b - 1) // t + 1) for (a, b), t in zip(box, tile)]
    for index in itertools.product(*ranges):
        values = _draw_tile(name, shape, index, cfg, seed, device)
        src, dst = [], []
        for (a, b), t, i, e in zip(box, tile, index, values.shape):
            lo, hi = max(a, i * t), min(b, i * t + e)  # the overlap, in full coordinates
            src.append(slice(lo - i * t, hi - i * t))
            dst.append(slice(lo - a, hi - a))
        out[tuple(dst)].copy_(values[tuple(src)])
        del values


def full_init_value(name: str, shape, cfg, seed: int, device: torch.device) -> torch.Tensor:
    """The full initial value of parameter `name` (canonical name): a function of the seed and
    the name only, so every layout and backend starts from identical weights."""
    t = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    init_box(t, name, shape, [(0, s) for s in shape], cfg, seed, device)
    return t


def local_box(param: torch.Tensor) -> Tuple[torch.Tensor, Box]:
    """(local tensor to fill, its box in global coordinates) for a plain tensor or DTensor."""
    # lazy: torch.distributed.tensor takes ~0.7 s to import; an unsharded model never needs it
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor):
        # lazy: torch.distributed.tensor takes ~0.7 s to import; an unsharded model never needs it
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        local = param.to_local()
        if tuple(local.shape) != tuple(shape):  # padded FSDP storage: fill the unpadded view
            local = local[tuple(slice(0, s) for s in shape)]
        if not offset:  # this rank is outside the tensor's mesh
            return local, [(0, 0)] * len(shape)
        return local, [(o, o + s) for o, s in zip(offset, shape)]
    return param, [(0, s) for s in param.shape]


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int, buffer_device: Optional[torch.device] = None) -> None:
    """Initialise every parameter of `model` (any layout) and recompute its buffers.

    ``buffer_device``: the training device; values are drawn there (default: each
    parameter's own device)."""
    cfg = model.cfg
    for name, param in model.named_parameters():
        cname = canonical_name(name)
        # The training device, not the parameter's: CPU-offloaded parameters must get the
        # same values as on-device ones.
        device = buffer_device or (param.device if param.device.type != "meta" else torch.device("cpu"))
        local, box = local_box(param)
        if local.numel() == 0:
            continue
        if local.device == device and local.dtype == torch.float32:
            init_box(local, cname, tuple(param.shape), box, cfg, seed, device)
        else:  # drawn on the training device in fp32 (as everywhere), then moved / cast
            shard = torch.empty(local.shape, dtype=torch.float32, device=device)
            init_box(shard, cname, tuple(param.shape), box, cfg, seed, device)
            local.copy_(shard)
    if hasattr(model, "rope"):
        device = buffer_device or model.rope.device
        model.rope = model_rope_table(cfg, device=device)
