"""Deterministic, resumable batches from token shards.

A sample is a window of seq_len + 1 tokens (inputs and labels shifted by one). Windows
never cross a shard boundary. The order is a seeded permutation per epoch, so the sample at
global position g is a pure function of (seed, g): resuming needs only the number of
samples consumed, which the checkpoint stores.

Global batch layout: the G samples of step s are positions [s*G, (s+1)*G); data-parallel
rank r takes the r-th contiguous slice of G/dp and cuts it into micro-batches. Any layout
with the same global batch therefore sees the same samples in the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np
import torch

from launcher.config.schema import DataConfig


def shard_files(path: Path) -> List[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".bin")
        if files:
            return files
    raise FileNotFoundError(
        f"data.path={path}: no token shards found (expected a .bin file or a folder of .bin files of "
        f"raw uint16/uint32 token ids). Fix: check data.path, or use data.source=text for raw text."
    )


class TokenWindows:
    """Fixed-length windows over one or more token arrays (memory-mapped shards)."""

    def __init__(self, shards: Sequence[np.ndarray], seq_len: int):
        self.shards = list(shards)
        self.seq_len = seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.offsets = np.cumsum([0] + counts)
        self.n_windows = int(self.offsets[-1])
        if self.n_windows == 0:
            total = sum(len(s) for s in self.shards)
            raise ValueError(
                f"the data has {total} tokens, too few for one sample of seq_len+1 = {seq_len + 1} tokens. "
                f"Fix: lower trainer.seq_len or add data."
            )

    def window(self, index: int) -> np.ndarray:
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        start = (index - int(self.offsets[shard])) * self.seq_len
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)


@dataclass
class BatchSlice:
    """Which part of the global batch this rank loads."""

    dp_rank: int
    dp_size: int
    micro_batch_size: int
    grad_accum_steps: int


class DeterministicSampler:
    """Maps a global sample position to a window index through per-epoch seeded permutations."""

    def __init__(self, n_windows: int, seed: int):
        self.n_windows = n_windows
        self.seed = seed
        self._epoch = -1
        self._perm = np.arange(0)

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.n_windows)
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(self.n_windows)
            self._epoch = epoch
        return int(self._perm[offset])


class StepBatches:
    """Yields, for a training step, this rank's micro-batches of (inputs, labels)."""

    def __init__(self, windows: TokenWindows, seed: int, global_batch_size: int, part: BatchSlice):
        self.windows = windows
        self.sampler = DeterministicSampler(windows.n_windows, seed)
        self.global_batch_size = global_batch_size
        self.part = part

    def for_step(self, step: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Micro-batches for 1-based `step`: samples consumed before it = (step-1) * global batch."""
        if step < 1:
            raise ValueError(f"training steps are numbered from 1; got step={step}")
        p = self.part
        per_rank = self.global_batch_size // p.dp_size
        first = (step - 1) * self.global_batch_size + p.dp_rank * per_rank
        out = []
        for m in range(p.grad_accum_steps):
            rows = [
                self.windows.window(self.sampler.index(first + m * p.micro_batch_size + i))
                for i in range(p.micro_batch_size)
            ]
            block = torch.from_numpy(np.stack(rows))
            out.append((block[:, :-1].contiguous(), block[:, 1:].contiguous()))
        return out


def load_token_arrays(cfg: DataConfig, cache_dir: Path) -> List[np.ndarray]:
    """The token arrays for data.source (embedded | tokens | text)."""
    if cfg.source == "embedded":
        from launcher.data.embedded import embedded_tokens

        return [embedded_tokens(cfg.embedded_tokens, seed=0)]
    if cfg.source == "tokens":
        return [np.memmap(f, dtype=np.dtype(cfg.dtype), mode="r") for f in shard_files(Path(cfg.path))]
    if cfg.source == "text":
        from launcher.data.text import cached_tokenization

        shard = cached_tokenization(Path(cfg.path), cfg.tokenizer, cfg.dtype, cache_dir)
        return [np.memmap(shard, dtype=np.dtype(cfg.dtype), mode="r")]
    raise ValueError(f"data.source={cfg.source!r} is not one of embedded, tokens, text")


def check_vocab(arrays: Sequence[np.ndarray], vocab_size: int, sample: int = 20_000_000) -> None:
    """Refuse token ids outside the model's vocabulary before they reach an embedding lookup.

    Arrays up to `sample` tokens are checked whole; larger ones through a strided sample plus
    their first and last million tokens (a full pass over terabytes would delay every start).
    """
    for a in arrays:
        if len(a) == 0:
            continue
        if len(a) <= sample:
            top = int(a.max())
        else:
            stride = len(a) // sample + 1
            top = int(max(a[::stride].max(), a[:1_000_000].max(), a[-1_000_000:].max()))
        if top >= vocab_size:
            raise ValueError(
                f"the data contains token id {top} but model.vocab_size={vocab_size}. "
                f"Fix: raise model.vocab_size to at least {top + 1}, or use matching data/tokenizer."
            )
