"""Context parallelism: each of ``cp`` ranks holds a slice of every sequence.

Two implementations (``backend.cp_impl``, resolved once into ``Layout.owners.cp_impl``):

- ``allgather`` (every device): each rank keeps the tokens of its head-tail slice
  (``shard_positions``: the sequence is cut into 2*cp chunks and rank r keeps chunks r and
  2cp-1-r, so every rank gets the same share of the causal mask's work) and computes its own
  queries; every attention layer all-gathers the keys and values of all cp ranks in forward and
  reduce-scatters their gradients in backward (``GatherSequence``), then attends with one mask
  built per forward from the queries' and keys' sequence positions (and document ids), so
  document masking and per-document RoPE positions (``data.reset_positions``) just work. GQA
  gathers the kv heads only; MLA gathers its compressed latent and shared RoPE key
  (``use_gathered_kv``). On CPU the mask is SDPA's explicit one; on CUDA a FlexAttention block
  mask (``launcher.models.layers.attention_mask``).
- ``ring`` (CUDA only, causal only): torch's ``context_parallel``; inside it SDPA becomes ring
  attention over the cp mesh, and the sequence buffers (tokens, labels, the RoPE table) are
  sharded with the same head-tail balancer. No CPU kernel has a sharding rule for it
  (``context_parallel_unsupported_reason``), and it takes no document mask.

Parameters are FSDP-sharded over dp_shard*cp, so CP ranks also share the model-state memory.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.experimental import context_parallel

from launcher.models.layers import Attention, KeyIndex

log = logging.getLogger(__name__)


def context_parallel_unsupported_reason(device_type: str, impl: str = "ring") -> Optional[str]:
    """Why context parallelism ``impl`` cannot run on ``device_type`` ("cpu", "cuda"...), or None."""
    if impl == "ring" and device_type == "cpu":
        return (
            "backend.cp_impl=ring needs a GPU: torch's ring attention has no sharding rule for the "
            "CPU attention kernels; set backend.cp_impl=allgather (or auto) on CPU, or run on CUDA devices"
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


class GatherSequence(torch.autograd.Function):
    """All-gather ``x`` [b, s_local, ...] along the sequence (dim 1) over ``group`` in rank order;
    backward reduce-scatters (sums) the gradient, since every rank's attention used every slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        local = x.transpose(0, 1).contiguous()  # the collectives work on dim 0
        out = local.new_empty((local.shape[0] * n,) + tuple(local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        return out.transpose(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        whole = grad.transpose(0, 1).contiguous()
        out = whole.new_empty((whole.shape[0] // n,) + tuple(whole.shape[1:]))
        dist.reduce_scatter_tensor(out, whole, group=ctx.group)
        return out.transpose(0, 1), None


def use_gathered_kv(model: nn.Module, group) -> int:
    """Make every attention layer (any module with a ``kv_gather`` slot: GQA attention gathers
    its kv heads' K and V, MLA its latent and RoPE key) all-gather them over the CP ``group``.
    Returns the number of attention layers switched."""
    n = 0
    for m in model.modules():
        if hasattr(m, "kv_gather"):
            m.kv_gather = lambda x, g=group: GatherSequence.apply(x, g)
            n += 1
    log.info("all-gather context parallelism (cp=%d) on %d attention layers", dist.get_world_size(group), n)
    return n


def key_order(seq_len: int, cp: int) -> List[int]:
    """The sequence positions of the gathered keys, in the order the all-gather returns them
    (rank 0's slice, then rank 1's...)."""
    return [i for r in range(cp) for i in shard_positions(seq_len, cp, r)]


def shard_for_allgather(inputs: torch.Tensor, labels: torch.Tensor, kwargs: Dict[str, torch.Tensor],
                        cp: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, object]]:
    """This rank's slice of one micro-batch: (inputs, labels, model kwargs) with the tokens of
    ``shard_positions``, their RoPE positions (the sequence positions, or the given per-document
    ones), their document ids, and the ``KeyIndex`` the model builds its mask from. Any other
    kwarg is a per-token tensor [b, s, ...] taken on whole rows (multi-token prediction's shifted
    tokens and targets): sliced along the sequence like the tokens."""
    s = inputs.shape[1]
    dev = inputs.device
    mine = torch.tensor(shard_positions(s, cp, rank), dtype=torch.long, device=dev)
    keys = torch.tensor(key_order(s, cp), dtype=torch.long, device=dev)
    out: Dict[str, object] = {}
    positions = kwargs.get("positions")
    out["positions"] = (positions[:, mine] if positions is not None
                        else mine.unsqueeze(0).expand(inputs.shape[0], -1))
    docs = kwargs.get("document_ids")
    if docs is not None:
        out["document_ids"] = docs[:, mine]
    for name, value in kwargs.items():
        if name not in ("positions", "document_ids"):
            out[name] = value[:, mine]
    out["keys"] = KeyIndex(query_index=mine, key_index=keys,
                           key_document_ids=docs[:, keys] if docs is not None else None)
    return inputs[:, mine], labels[:, mine], out
