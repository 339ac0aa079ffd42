"""Whether each label is the greedy (argmax) token of its logits: lm-eval's `is_greedy`.

lm-eval's HF backend takes `logits.argmax(-1)` over the whole vocabulary and asks whether every
continuation token equals it; torch's argmax gives the lowest index among equal maxima. Under
loss parallelism the logits are a DTensor sharded over the vocabulary (Shard(-1) on the tensor-
parallel mesh): each rank holds one contiguous slice, so the argmax is reduced across the slices
without gathering them: a MAX all-reduce of each position's largest logit, then a MIN all-reduce of
the global index of the first position that holds it (a rank whose slice does not reach the
maximum offers the vocabulary size), which is torch.argmax's tie rule on the full logits.

Used by the engines' forward-only path (`eval_stats`), never in a training step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from launcher.engines.base import IGNORE_INDEX


def greedy_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[b, s] bool: label == argmax of its position's logits (False where the label is ignored).
    `logits` [b, s, vocab], plain or a DTensor (vocabulary-sharded under loss parallelism:
    collective over its mesh; every rank of it gets the same answer)."""
    greedy = _argmax(logits)
    return (greedy == labels.to(greedy.device)) & (labels.to(greedy.device) != IGNORE_INDEX)


def source_greedy_sums(hits: torch.Tensor, sources: torch.Tensor, n_sources: int) -> torch.Tensor:
    """[n_sources] fp64: per source, its rows' counted tokens that were the greedy token (hits [b, s]
    from greedy_hits, sources [b]); a row is greedy when this equals its counted tokens."""
    out = torch.zeros(n_sources, dtype=torch.float64, device=hits.device)
    return out.index_add_(0, sources.to(hits.device).long(), hits.sum(1).double())


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if not isinstance(logits, DTensor):
        return logits.float().argmax(dim=-1)
    vocab_dim = _vocab_shard_dim(logits)
    if vocab_dim is None:  # replicated (or sharded elsewhere): the full logits are there to read
        return logits.full_tensor().float().argmax(dim=-1)
    mesh = logits.device_mesh
    local = logits.to_local().float()
    vocab = logits.shape[-1]
    size = mesh.size(vocab_dim)
    # torch.chunk's split (DTensor's Shard): ceil(vocab / size) per rank, the last ones shorter or empty
    chunk = -(-vocab // size)
    offset = min(mesh.get_local_rank(vocab_dim) * chunk, vocab)
    group = mesh.get_group(vocab_dim)
    if local.shape[-1] == 0:  # an empty slice (vocab < size): it offers nothing
        best = torch.full(local.shape[:-1], float("-inf"), device=local.device)
        index = torch.full(local.shape[:-1], vocab, dtype=torch.int64, device=local.device)
    else:
        index = local.argmax(dim=-1)
        best = local.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        index = index + offset
    top = best.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    index = torch.where(best == top, index, torch.full_like(index, vocab))
    dist.all_reduce(index, op=dist.ReduceOp.MIN, group=group)
    return index


def _vocab_shard_dim(logits: DTensor):
    """The mesh dimension that shards the last (vocabulary) dimension, or None."""
    if len(logits.placements) != 1:  # loss parallelism shards over the 1-D tensor-parallel mesh only
        return None
    placement = logits.placements[0]
    if isinstance(placement, Shard) and placement.dim in (-1, logits.ndim - 1):
        return 0
    return None
