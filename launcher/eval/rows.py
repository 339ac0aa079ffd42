"""Summed log-likelihoods of token rows on the live model, through the engine's forward-only path.

Each row is one scored sequence (a context and its continuation, or one rolling window): its
inputs are the tokens but the last, and only the continuation's labels are counted. Rows are
padded to trainer.seq_len (the shape every layout was built for; padding sits after the scored
tokens, so causal attention never sees it) and numbered as "sources": the engine's `eval_stats`
then returns each row's summed token loss, all-reduced over the data-parallel group, on every
rank, and how many of its scored tokens were the argmax of their logits (lm-eval's is_greedy:
all of them; taken across the vocabulary shards under TP's loss parallelism,
launcher/engines/greedy.py). So every layout the engines serve (FSDP2/HSDP, TP+SP with loss parallelism, PP, EP, CP,
DeepSpeed) scores rows with no evaluation code of its own.

Every rank passes the same row list; data-parallel rank r takes the r-th slice of each call, and
every rank makes the same number of calls with the same shapes (short slices are filled with
rows that count no token), so the collectives of FSDP, TP and PP line up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from launcher.data.batch import Microbatch
from launcher.engines.base import IGNORE_INDEX


@dataclass(frozen=True)
class RowShape:
    """How rows go through the engine: the training shapes of this layout."""

    seq_len: int  # row length (trainer.seq_len)
    micro_batch_size: int  # rows per micro-batch (trainer.micro_batch_size)
    microbatches: int  # micro-batches per call on each data-parallel rank
    dp_rank: int
    dp_size: int

    @property
    def rows_per_rank(self) -> int:
        return self.micro_batch_size * self.microbatches

    @property
    def rows_per_call(self) -> int:
        return self.rows_per_rank * self.dp_size


def row_tensors(tokens: Sequence[int], n_scored: int, seq_len: int, pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one row: tokens[:-1] as inputs, tokens[1:] as labels with only the
    last `n_scored` counted; both padded to seq_len. `tokens` holds at most seq_len + 1 ids."""
    if len(tokens) > seq_len + 1 or n_scored < 1 or n_scored > len(tokens) - 1:
        raise ValueError(f"a row of {len(tokens)} tokens scoring {n_scored} does not fit seq_len={seq_len}")
    inputs = torch.full((seq_len,), pad_id, dtype=torch.int64)
    labels = torch.full((seq_len,), IGNORE_INDEX, dtype=torch.int64)
    n = len(tokens) - 1
    inputs[:n] = torch.tensor(tokens[:-1], dtype=torch.int64)
    labels[n - n_scored:n] = torch.tensor(tokens[-n_scored:], dtype=torch.int64)
    return inputs, labels


class RowScorer:
    """Summed log-probabilities of rows, and whether each row's scored tokens are the greedy ones,
    on the engine's live model (collective: every rank calls `score` with the same rows)."""

    def __init__(self, engine, shape: RowShape, pad_id: int):
        self.engine = engine
        self.shape = shape
        self.pad_id = pad_id

    def score(self, rows: Sequence[Tuple[Sequence[int], int]], greedy: bool = True) -> List[Tuple[float, bool]]:
        """For each (tokens, n_scored): (the sum of log p(token | the tokens before it) over the
        last n_scored tokens, whether each of them is its position's argmax: lm-eval's
        (loglikelihood, is_greedy)). Same list on every rank. greedy=False skips the argmax
        (rolling log-likelihoods need none): is_greedy is then False."""
        out: List[Tuple[float, bool]] = []
        per_call = self.shape.rows_per_call
        for start in range(0, len(rows), per_call):
            out.extend(self._call(rows[start:start + per_call], greedy))
        return out

    def _call(self, rows: Sequence[Tuple[Sequence[int], int]], greedy: bool) -> List[Tuple[float, bool]]:
        s = self.shape
        first = s.dp_rank * s.rows_per_rank
        inputs, labels, sources = [], [], []
        for i in range(first, first + s.rows_per_rank):
            if i < len(rows):
                x, y = row_tensors(rows[i][0], rows[i][1], s.seq_len, self.pad_id)
            else:  # filler: the same shapes, no counted token
                x = torch.full((s.seq_len,), self.pad_id, dtype=torch.int64)
                y = torch.full((s.seq_len,), IGNORE_INDEX, dtype=torch.int64)
            inputs.append(x)
            labels.append(y)
            sources.append(i)
        mbs = []
        b = s.micro_batch_size
        for j in range(0, s.rows_per_rank, b):
            mbs.append(Microbatch(torch.stack(inputs[j:j + b]), torch.stack(labels[j:j + b]),
                                  sources=torch.tensor(sources[j:j + b], dtype=torch.int64)))
        stats = self.engine.eval_stats(mbs, n_sources=s.rows_per_call, greedy=greedy)
        # mean token loss x counted tokens = the row's summed loss = -(its log-likelihood); greedy
        # when every counted token was the argmax (exact integer counts in fp64)
        return [(-stats.source_loss[i] * stats.source_tokens[i],
                 greedy and stats.source_greedy[i] == stats.source_tokens[i]) for i in range(len(rows))]
