"""Context parallelism: each of ``cp`` ranks holds a slice of every sequence.

Uses torch's ``context_parallel``: inside it, SDPA becomes ring attention over the cp
mesh, and the sequence buffers (tokens, labels, the RoPE table) are sharded along the
sequence with the head-tail load balancer: the sequence is cut into 2*cp chunks and rank r
keeps chunks r and 2cp-1-r, so every rank gets the same share of the causal mask's work
(``shard_positions`` computes the same assignment, for checks and docs).

It needs a GPU: no CPU attention kernel has a sharding rule for ring attention, so on CPU
the job is refused before launch (``context_parallel_unsupported_reason``). Parameters are
FSDP-sharded over dp_shard*cp, so CP ranks also share the model-state memory.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import List, Optional

import torch
from torch import nn
from torch.distributed.tensor.experimental import context_parallel

from launcher.models.layers import Attention

log = logging.getLogger(__name__)


def context_parallel_unsupported_reason(device_type: str) -> Optional[str]:
    """Why parallel.cp > 1 cannot run on ``device_type`` ("cpu", "cuda"...), or None if it can."""
    if device_type == "cpu":
        return (
            "parallel.cp > 1 (context parallelism) needs a GPU: torch's ring attention has no "
            "sharding rule for the CPU attention kernels; set parallel.cp=1 on CPU (use "
            "parallel.tp with parallel.sp=true to split activations along the sequence), or "
            "run on CUDA devices"
        )
    return None


def check_context_parallel(seq_len: int, cp: int) -> None:
    """The head-tail load balancer needs 2*cp equal chunks of the sequence."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"trainer.seq_len={seq_len} is not divisible by 2*parallel.cp={2 * cp} (context "
            f"parallelism cuts each sequence into 2*cp chunks); use a seq_len multiple of {2 * cp}"
        )


def shard_positions(seq_len: int, cp: int, rank: int) -> List[int]:
    """Sequence positions held by cp rank ``rank`` under head-tail load balancing."""
    check_context_parallel(seq_len, cp)
    k = seq_len // (2 * cp)
    head = list(range(rank * k, (rank + 1) * k))
    tail = list(range((2 * cp - 1 - rank) * k, (2 * cp - rank) * k))
    return head + tail


@contextmanager
def context_parallel_region(model: nn.Module, cp_mesh, inputs: torch.Tensor, labels: torch.Tensor):
    """Shard ``inputs``/``labels`` [b, s] and the model's RoPE table in place for one micro-batch.

    Forward and backward must both run inside. The RoPE table is cut to the sequence length
    first (the load balancer needs every buffer to have the same length) and restored after.
    """
    reason = context_parallel_unsupported_reason(inputs.device.type)
    if reason:
        raise RuntimeError(reason)
    s = inputs.shape[1]
    check_context_parallel(s, cp_mesh.size())
    full_rope = model.rope
    rope = full_rope[:s].clone()
    model.rope = rope
    try:
        with context_parallel(cp_mesh, buffers=[inputs, labels, rope], buffer_seq_dims=[1, 1, 0],
                              no_restore_buffers={inputs, labels}):
            yield
    finally:
        model.rope = full_rope


def use_expanded_kv(model: nn.Module) -> int:
    """Make every attention layer copy K/V per query head (repeat_interleave) instead of SDPA's
    enable_gqa: torch 2.13's context_parallel (ring attention) does not accept enable_gqa.
    Returns the number of attention layers switched."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            m.expand_kv = True
            n += 1
    return n
