"""Which sequence positions each context-parallel rank holds: the load balancers.

Under a causal mask a query's work is the number of keys it may see, so cutting a row into cp
contiguous pieces gives the last rank cp times the first's. Both balancers below give every
rank the same number of tokens per row (the all-gather needs equal slices) and the same causal
work:

- head-tail (plain causal attention): the row is cut into 2*cp chunks and rank r keeps chunks r
  and 2cp-1-r, a light and a heavy one.
- per document (document masking): a query sees only the keys of its own document, so the work
  of a packed row is the sum over its documents, and a row-level head-tail split leaves a rank
  that holds the heads of long documents with far less work than one that holds their tails.
  Each document is split head-tail over the cp ranks instead: its position p and its mirror L-1-p
  (work p+1 and L-p: L+1 together, whatever p) form a pair, and each rank takes the same number of
  the document's pairs, from both ends inwards. The fewer than 2*cp tokens in the middle of each
  document that do not divide evenly go, heaviest first, to the rank with the least work among
  those still short of their share of tokens, so the work per rank differs by at most about one
  document's length.

With one document the per-document split is the head-tail split, so plain causal rows use the
same code. The planner charges every cp rank 1/cp of the attention work (it assumes this
balance). torch's ``_PerDocumentHeadTailLoadBalancer`` does the same for documents whose lengths
divide by 2*cp; this one takes any lengths.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily


def check_context_parallel(seq_len: int, cp: int) -> None:
    """The balancers need 2*cp equal chunks of the sequence."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"trainer.seq_len={seq_len} is not divisible by 2*parallel.cp={2 * cp} (context "
            f"parallelism cuts each sequence into 2*cp chunks); use a seq_len multiple of {2 * cp}"
        )


def document_lengths(document_ids: torch.Tensor) -> List[List[int]]:
    """Per row of ``document_ids`` (int [rows, s]), the lengths of its documents in order (a
    document is a run of one id)."""
    ids = document_ids.cpu()
    starts = torch.ones(ids.shape, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    out = []
    for row in starts:
        bounds = torch.nonzero(row).flatten().tolist() + [ids.shape[1]]
        out.append([b - a for a, b in zip(bounds, bounds[1:])])
    return out


def split_documents(lengths: Sequence[int], cp: int) -> torch.Tensor:
    """int64 [cp, seq_len // cp]: the sequence positions (ascending) each of ``cp`` ranks holds of
    one row packed with documents of ``lengths``: the per-document head-tail split (module
    docstring). Vectorised over the tokens; only the middle tokens go through Python."""
    n = torch.tensor(list(lengths), dtype=torch.long)
    seq_len = int(n.sum())
    check_context_parallel(seq_len, cp)
    doc = torch.repeat_interleave(torch.arange(len(n)), n)
    length = n[doc]
    p = torch.arange(seq_len) - (torch.cumsum(n, 0) - n)[doc]  # position in its document
    pairs = length // 2 // cp  # pairs per rank in the token's document
    mirror = torch.minimum(p, length - 1 - p)  # the pair's index, counted from both ends inwards
    core = mirror < cp * pairs
    owner = torch.where(core, mirror // pairs.clamp_min(1), -1)
    # The middle tokens of each document (fewer than 2*cp): every rank already holds as many tokens
    # as every other, so each takes the same number of them (their count divides by cp since
    # seq_len and the pairs' tokens do), heaviest (work p+1) first to the least-loaded rank.
    middle = torch.nonzero(~core).flatten()
    share = middle.numel() // cp
    work, taken = [0] * cp, [0] * cp
    for w, pos in sorted(zip((p[middle] + 1).tolist(), middle.tolist()), reverse=True):
        r = min((r for r in range(cp) if taken[r] < share), key=lambda r: work[r])
        owner[pos] = r
        work[r] += w
        taken[r] += 1
    # Grouped by rank, positions ascending within each (a stable sort keeps them in order).
    return torch.argsort(owner, stable=True).view(cp, seq_len // cp)


def shard_positions(seq_len: int, cp: int, rank: int) -> List[int]:
    """Sequence positions held by cp rank ``rank`` under head-tail load balancing (a row that is
    one document)."""
    return split_documents([seq_len], cp)[rank].tolist()


def rank_positions(seq_len: int, cp: int, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [rows, cp, seq_len // cp]: the sequence positions each cp rank holds, per row. Without
    ``document_ids`` one row, the head-tail split every row shares; with them (int [rows, s]) each
    row's per-document split."""
    # Index arithmetic on the host with data-dependent sizes (repeat_interleave): never under the
    # rehearsal's fake tensors, where those sizes are unknown; the caller moves the result.
    with unset_fake_temporarily():
        if document_ids is None:
            return split_documents([seq_len], cp).unsqueeze(0)
        return torch.stack([split_documents(lengths, cp) for lengths in document_lengths(document_ids)])

