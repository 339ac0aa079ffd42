"""Context parallelism: each of ``cp`` ranks holds a slice of every sequence.

Two implementations (``backend.cp_impl``, resolved once into ``Layout.owners.cp_impl``):

- ``allgather`` (every device): each rank keeps the tokens of its balanced slice
  (launcher/parallel/cp_balance.py: head-tail for plain causal rows, so every rank gets the same
  share of the causal mask's work; with document ids each document split head-tail over the
  ranks, a different split per row) and computes its own queries; every attention layer all-gathers the keys and values of all cp ranks in forward and
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

Under pipelining (all-gather only) the engine slices the whole step's rows once, before the
schedule, and passes the ``KeyIndex`` in its per-row form (``per_row_keys``): registered as a
pytree node below, its index tensors are split into micro-batches with the rows, like the
tokens and positions (torch's schedule splits every keyword tensor along dim 0). Each stage
then builds its layers' mask from its micro-batch's own index, and the hidden states sent
between stages are the rank's s/cp tokens.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.experimental import context_parallel
from torch.utils._pytree import SUPPORTED_NODES, register_pytree_node

from launcher.models.layers import Attention, KeyIndex
from launcher.parallel.cp_balance import check_context_parallel, rank_positions, shard_positions  # noqa: F401

log = logging.getLogger(__name__)

# A pipeline schedule splits keyword arguments into micro-batches leaf by leaf (torch's pytree):
# as a node, a KeyIndex's tensors are cut with the rows instead of handed whole to every
# micro-batch (see per_row_keys; a 1-D index has no row dimension to cut).
if KeyIndex not in SUPPORTED_NODES:  # once per process
    register_pytree_node(
        KeyIndex,
        lambda k: ([k.query_index, k.key_index, k.key_document_ids], None),
        lambda values, _: KeyIndex(*values),
        serialized_type_name="launcher.models.layers.KeyIndex",
    )


def context_parallel_unsupported_reason(device_type: str, impl: str = "ring") -> Optional[str]:
    """Why context parallelism ``impl`` cannot run on ``device_type`` ("cpu", "cuda"...), or None."""
    if impl == "ring" and device_type == "cpu":
        return (
            "backend.cp_impl=ring needs a GPU: torch's ring attention has no sharding rule for the "
            "CPU attention kernels; set backend.cp_impl=allgather (or auto) on CPU, or run on CUDA devices"
        )
    return None


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
    """The sequence positions of the gathered keys of a plain causal row (head-tail), in the order
    the all-gather returns them (rank 0's slice, then rank 1's...)."""
    return [i for r in range(cp) for i in shard_positions(seq_len, cp, r)]


def shard_for_allgather(inputs: torch.Tensor, labels: torch.Tensor, kwargs: Dict[str, torch.Tensor],
                        cp: int, rank: int, document_ids: Optional[torch.Tensor] = None,
                        ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, object]]:
    """This rank's slice of one micro-batch: (inputs, labels, model kwargs) with the tokens the
    balancer gives it (rank_positions: head-tail, or per document when the micro-batch has
    document ids), their RoPE positions (the sequence positions, or the given per-document ones),
    their document ids, and the ``KeyIndex`` the model builds its mask from. ``document_ids``: the
    micro-batch's ids where they are on the host (the split is computed there; default: those in
    ``kwargs``). Any other kwarg is a per-token tensor [b, s, ...] taken on whole rows (multi-token
    prediction's shifted tokens and targets): sliced along the sequence like the tokens. The loss
    is a sum over tokens, so labels sliced the same way need no reordering; outputs go back to
    sequence order with ``to_sequence_order``."""
    b, s = inputs.shape
    dev = inputs.device
    docs = kwargs.get("document_ids")
    host_docs = document_ids if document_ids is not None else docs
    split = rank_positions(s, cp, host_docs).to(dev)  # [1 or b, cp, s/cp]
    out: Dict[str, object] = {}
    positions = kwargs.get("positions")
    if host_docs is None:  # one split for every row: 1-D indices, one mask for the batch
        mine, keys = split[0, rank], split[0].reshape(-1)
        take = lambda t: t[:, mine]  # noqa: E731
        out["positions"] = mine.unsqueeze(0).expand(b, -1) if positions is None else take(positions)
    else:  # per row
        mine, keys = split[:, rank], split.reshape(b, -1)
        take = lambda t: t.gather(1, mine)  # noqa: E731
        out["positions"] = mine if positions is None else take(positions)
    if docs is not None:
        out["document_ids"] = take(docs)
        key_docs = docs[:, keys] if keys.dim() == 1 else docs.gather(1, keys)
    for name, value in kwargs.items():
        if name not in ("positions", "document_ids"):
            if mine.dim() == 1:
                out[name] = value[:, mine]
            else:  # per row: the row's indices, broadcast over any trailing dimensions
                index = mine.view(mine.shape + (1,) * (value.dim() - 2)).expand(mine.shape + value.shape[2:])
                out[name] = value.gather(1, index)
    out["keys"] = KeyIndex(query_index=mine, key_index=keys,
                           key_document_ids=key_docs if docs is not None else None)
    return take(inputs), take(labels), out


def per_row_keys(keys: KeyIndex, rows: int) -> KeyIndex:
    """``keys`` with one index row per sequence ([rows, s_q] and [rows, s_k]; expanded views where
    one split serves every row): the form a pipeline schedule can cut into micro-batches."""
    def rowed(index: torch.Tensor) -> torch.Tensor:
        return index.unsqueeze(0).expand(rows, -1) if index.dim() == 1 else index
    return KeyIndex(query_index=rowed(keys.query_index), key_index=rowed(keys.key_index),
                    key_document_ids=keys.key_document_ids)


def to_sequence_order(gathered: torch.Tensor, key_index: torch.Tensor) -> torch.Tensor:
    """The inverse of the balancer's permutation: ``gathered`` [b, s, ...] (every rank's outputs
    concatenated in rank order, as the keys arrive) put back in sequence order, where
    ``key_index`` ([s], or [b, s] per row) is the KeyIndex's key_index."""
    out = torch.empty_like(gathered)
    if key_index.dim() == 1:
        out[:, key_index] = gathered
        return out
    index = key_index.view(key_index.shape + (1,) * (gathered.dim() - 2)).expand_as(gathered)
    return out.scatter_(1, index, gathered)
