"""Buffers that stay float32 under every engine and precision, declared by the model that owns them.

Some buffers lose their meaning in bf16: the RoPE table (angles at long positions) and
DeepSeek-V3's router correction bias, moved by `bias_update_speed` (0.001) per step, a step that
bf16 rounds away once |bias| >= 0.5. A module registers such a buffer with
`register_fp32_buffer`; an engine whose wrapper casts the module (DeepSpeed's bf16/fp16 mode:
older releases call `module.bfloat16()`, and `deepspeed.zero.Init` casts every float tensor a
constructor makes, the bias's zeros included) keeps them with `fp32_buffers_kept`. No engine
names a buffer: the declaration is the model's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch
from torch import nn

# The instance attribute holding the names of a module's own float32 buffers.
_NAMES = "_fp32_buffer_names"


def register_fp32_buffer(module: nn.Module, name: str, tensor: torch.Tensor, persistent: bool = True) -> None:
    """`module.register_buffer(name, tensor as float32, persistent)`, declared to stay float32."""
    module.register_buffer(name, tensor.to(torch.float32), persistent=persistent)
    module.__dict__.setdefault(_NAMES, set()).add(name)


def fp32_buffers(root: nn.Module) -> List[Tuple[nn.Module, str]]:
    """(module, buffer name) of every declared float32 buffer inside `root` (a model, a pipeline stage, a wrapper)."""
    return [(m, n) for m in root.modules() for n in sorted(m.__dict__.get(_NAMES, ())) if m._buffers.get(n) is not None]


@contextlib.contextmanager
def fp32_buffers_kept(root: nn.Module) -> Iterator[None]:
    """Whatever the block does to `root`'s dtypes, its declared float32 buffers leave it float32,
    with the values they had: a cast that replaces a buffer (`module.bfloat16()`) gets the
    original tensor back (on the buffer's new device); one made in place (`buffer.data = ...`)
    leaves only the rounded values, upcast."""
    before = {(id(m), n): m._buffers[n] for m, n in fp32_buffers(root)}
    yield
    for m, n in fp32_buffers(root):
        now = m._buffers[n]
        if now.dtype == torch.float32:
            continue
        kept = before.get((id(m), n))
        source = kept if kept is not None and kept.dtype == torch.float32 else now
        m._buffers[n] = source.to(device=now.device, dtype=torch.float32)
