"""Layout-independent weight initialisation.

Choice: every parameter's FULL value is generated on the training device from its own
generator, seeded by (seed, crc32 of the parameter's canonical name), then this rank copies
the part it holds. So the initial model is bit-identical whatever the layout (FSDP, TP, PP,
EP shards, 1 or N ranks) on a given device type (CPU and CUDA generators draw different
numbers). Generating on the device keeps it fast for big models (every rank draws every
parameter: ~1e11 numbers/s on an H100, hours on a CPU for 405B) at the cost of one full
parameter at a time in device memory (the largest, a 405B model's embedding, is ~8 GiB
in fp32).

Canonical names drop wrapper prefixes added by activation checkpointing, torch.compile and
FSDP1, so a wrapped model initialises exactly like a bare one.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
from torch import nn

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """Parameter name with wrapper components removed ("layers.0._orig_mod.x" -> "layers.0.x")."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def full_init_value(name: str, shape, cfg, seed: int, device: torch.device) -> torch.Tensor:
    """The full initial value of parameter `name` (canonical name): a function of the seed and
    the name only, so every layout and backend starts from identical weights."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if _is_fake(t):
        # The rehearsal (FakeTensorMode): no values to draw. trunc_normal_'s rejection loop
        # reads values (mask.any()), which a fake tensor cannot give; torch's init skips meta
        # tensors the same way. Real tensors never take this branch.
        return t
    if name.endswith("norm.weight"):
        return t.fill_(1.0)
    std = cfg.init_std
    # Output projections of each residual branch are scaled down with depth (GPT-2 style)
    # so the residual stream's variance does not grow with n_layers.
    if name.endswith("wo.weight") or name.endswith("w2.weight") or name.endswith("experts.w2"):
        std = std / math.sqrt(2 * cfg.n_layers)
    if name == "tok_embeddings.weight":
        return t.normal_(0.0, std, generator=gen)
    return nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=gen)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the part of `full` this rank holds into `param` (plain tensor or DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(param, DTensor):
        # Replicate -> any placement is a local slice (no communication), and it knows the
        # uneven and strided (FSDP over TP) shardings.
        mesh = param.device_mesh
        rep = DTensor.from_local(full.to(param.device, param.dtype), mesh,
                                 [Replicate()] * mesh.ndim, run_check=False)
        param.to_local().copy_(rep.redistribute(mesh, param.placements).to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


@torch.no_grad()
def init_model_weights(model: nn.Module, seed: int, buffer_device: Optional[torch.device] = None) -> None:
    """Initialise every parameter of `model` (any layout) and recompute its buffers.

    ``buffer_device``: the training device; values are drawn there (default: each
    parameter's own device)."""
    from launcher.models.layers import model_rope_table

    cfg = model.cfg
    for name, param in model.named_parameters():
        cname = canonical_name(name)
        # The training device, not the parameter's: CPU-offloaded parameters must get the
        # same values as on-device ones.
        device = buffer_device or (param.device if param.device.type != "meta" else torch.device("cpu"))
        _copy_into(param, full_init_value(cname, tuple(param.shape), cfg, seed, device))
    if hasattr(model, "rope"):
        device = buffer_device or model.rope.device
        model.rope = model_rope_table(cfg, device=device)
