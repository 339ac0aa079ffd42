"""Deterministic, resumable batches from token shards and indexed datasets, one or several.

A sample is a window of seq_len + 1 tokens (inputs and labels shifted by one). Windows
never cross a shard boundary. A source's k-th draw reads window perm(epoch, k mod n) with
epoch = k // n, where perm is a keyed bijection computed on the fly (launcher/data/sampler.py):
every window once per epoch, nothing stored per window, and the sample is a pure function of
(seed, source, draw). Resuming needs only each source's draw count, which the checkpoint stores.

Global batch layout: the G samples of step s are the draws [s*G, (s+1)*G) of the run; with a
mixture (data.mix) each is assigned to a source on every rank by launcher/data/mixture.py.
Data-parallel rank r takes the r-th contiguous slice of G/dp and cuts it into micro-batches.
Any layout with the same global batch therefore sees the same samples in the same step.

Document structure (indexed datasets): with document ids requested, each row numbers its
documents from 0 (the row's first token, which may continue a document begun in an earlier
window, is document 0); with positions requested, RoPE positions restart at 0 at each document
start and at the row start, as Megatron's reset_position_ids does (a document continued from the
previous window does not keep counting: its beginning is not in the row either).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from launcher.config.schema import DataConfig
from launcher.data.batch import Microbatch
from launcher.data.checks import data_sources, is_mixture
from launcher.data.corpus import corpus_info
from launcher.data.embedded import embedded_tokens
from launcher.data.indexed import IndexedDataset
from launcher.data.mixture import MixtureState
from launcher.data.sampler import WindowPermutation
from launcher.data.text import cached_tokenization
from launcher.data.tokens import shard_files  # noqa: F401  (re-exported: older imports)
from launcher.data.heldout import load_val_token_arrays

OPEN_SHARDS = 64  # indexed shards kept memory-mapped at once per source (a map costs 3 file mappings)


class IndexedShards:
    """The shards of one indexed dataset, opened (memory-mapped) on first use, a bounded number at a time."""

    def __init__(self, prefixes: Sequence[Path], lengths: Sequence[int]):
        self.prefixes = [Path(p) for p in prefixes]
        self.lengths = [int(n) for n in lengths]
        self._open: "OrderedDict[int, object]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.prefixes)

    def dataset(self, i: int):
        with self._lock:
            ds = self._open.get(i)
            if ds is None:
                ds = IndexedDataset(self.prefixes[i])
                if ds.n_tokens != self.lengths[i]:
                    raise ValueError(f"{ds.bin_path}: {ds.n_tokens} tokens now, {self.lengths[i]} when the run "
                                     f"started. Fix: do not rewrite a dataset a run is reading.")
                self._open[i] = ds
                if len(self._open) > OPEN_SHARDS:
                    self._open.popitem(last=False)
            else:
                self._open.move_to_end(i)
            return ds

    def __getitem__(self, i: int):
        return self.dataset(i).tokens

    def document_token_starts(self, i: int, first: int, end: int) -> np.ndarray:
        return self.dataset(i).document_token_starts(first, end)

    def label(self, i: int) -> str:
        return f"{self.prefixes[i]}.bin"


class TokenWindows:
    """Fixed-length windows over token shards: arrays (memory-mapped or in memory) or IndexedShards."""

    def __init__(self, shards: Union[Sequence[np.ndarray], IndexedShards], seq_len: int):
        self.shards = shards
        self.seq_len = seq_len
        lengths = shards.lengths if isinstance(shards, IndexedShards) else [len(s) for s in shards]
        counts = [max(0, (n - 1) // seq_len) for n in lengths]
        self.offsets = np.cumsum([0] + counts)  # per shard, not per window
        self.n_windows = int(self.offsets[-1])
        if self.n_windows == 0:
            raise ValueError(
                f"the data has {sum(lengths)} tokens, too few for one sample of seq_len+1 = {seq_len + 1} tokens. "
                f"Fix: lower trainer.seq_len or add data."
            )

    @property
    def has_documents(self) -> bool:
        return isinstance(self.shards, IndexedShards)

    def locate(self, index: int) -> Tuple[int, int]:
        """(shard, first token) of window `index`."""
        shard = int(np.searchsorted(self.offsets, index, side="right") - 1)
        return shard, (index - int(self.offsets[shard])) * self.seq_len

    def window(self, index: int) -> np.ndarray:
        shard, start = self.locate(index)
        return np.asarray(self.shards[shard][start : start + self.seq_len + 1], dtype=np.int64)

    def label(self, index: int) -> str:
        shard, _ = self.locate(index)
        return self.shards.label(shard) if isinstance(self.shards, IndexedShards) else f"token shard {shard}"

    def document_layout(self, index: int) -> Tuple[np.ndarray, np.ndarray]:
        """(document ids, positions) of the window's seq_len input tokens: documents numbered from 0,
        positions restarting at 0 at each document start and at the row start."""
        seq = self.seq_len
        starts = np.zeros(seq, dtype=bool)
        if self.has_documents:
            shard, first = self.locate(index)
            offsets = self.shards.document_token_starts(shard, first + 1, first + seq) - first
            starts[offsets] = True
        ids = np.cumsum(starts, dtype=np.int32)
        arange = np.arange(seq, dtype=np.int64)
        positions = arange - np.maximum.accumulate(np.where(starts, arange, 0))
        return ids, positions


@dataclass
class BatchSlice:
    """Which part of the global batch this rank loads."""

    dp_rank: int
    dp_size: int
    micro_batch_size: int
    grad_accum_steps: int


@dataclass
class SourceOptions:
    """A source besides its windows: its name (metrics, checkpoint, shuffle key) and weight, and
    whether each batch must be checked against the vocabulary (no manifest vouches for its ids)."""

    name: str = ""
    weight: float = 1.0
    check_vocab: bool = False


HISTORY = 8  # steps whose mixture assignment is kept (the loader runs at most one step ahead)


class StepBatches:
    """Yields, for a training step, this rank's micro-batches (launcher.data.batch.Microbatch)."""

    def __init__(self, windows: Union[TokenWindows, Sequence[TokenWindows]], seed: int, global_batch_size: int,
                 part: BatchSlice, *, options: Optional[Sequence[SourceOptions]] = None, mixture: bool = False,
                 document_ids: bool = False, positions: bool = False, vocab_size: int = 0):
        self.sources = [windows] if isinstance(windows, TokenWindows) else list(windows)
        self.options = list(options) if options else [SourceOptions() for _ in self.sources]
        if len(self.options) != len(self.sources):
            raise ValueError(f"{len(self.sources)} sources but {len(self.options)} source options")
        self.names = [o.name or f"source{i}" for i, o in enumerate(self.options)]
        self.mixture = mixture
        if len(self.sources) > 1 and not mixture:
            raise ValueError("several sources need mixture=True")
        self.seq_len = self.sources[0].seq_len
        self.permutations = [WindowPermutation(w.n_windows, seed, self.names[i] if mixture else "")
                             for i, w in enumerate(self.sources)]
        self.global_batch_size = global_batch_size
        self.part = part
        self.want_document_ids = document_ids
        self.want_positions = positions
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._start = MixtureState.fresh(self.names, [o.weight for o in self.options]) if mixture else None
        self._start_step = 0
        self._state = self._start.copy() if mixture else None
        self._state_step = 0
        self._history: "OrderedDict[int, Tuple[List[int], List[int], List[int]]]" = OrderedDict()
        # Global batches skipped so far (trainer.on_spike=rewind): training step N reads the data
        # of batch N + skipped. Every method below takes training steps.
        self.skipped = 0

    def skip(self, batches: int) -> None:
        """Skip the next `batches` global batches (before the first step after a resume): their
        samples count as consumed, and every later step reads `batches` further on."""
        with self._lock:
            self.skipped += batches
            self._history.clear()

    # ------------------------------------------------------------------ mixture bookkeeping
    def resume(self, step: int, stored: Optional[dict], skipped: int = 0) -> List[str]:
        """Continue after `step` from a checkpoint's data state (trainer.json "data"; `skipped`:
        its "batches_skipped"); returns what differs from the checkpoint (changed weights, new or
        dropped sources) for a warning."""
        self.skipped = skipped
        step += skipped
        if not self.mixture:
            return []
        notes: List[str] = []
        weights = [o.weight for o in self.options]
        if stored and stored.get("mixture"):
            state, notes = MixtureState.resumed(stored["mixture"], self.names, weights)
        else:
            state = MixtureState.fresh(self.names, weights)
            if step:
                notes = ["the checkpoint stores no mixture read positions: every source is read from its start"]
        with self._lock:
            self._start, self._start_step = state, step
            self._state, self._state_step = state.copy(), step
            self._history.clear()
        return notes

    def _assignment(self, step: int) -> Tuple[List[int], List[int], List[int]]:
        """(source, draw) of each sample of `step`'s global batch, and the counts after it."""
        with self._lock:
            got = self._history.get(step)
            if got is not None:
                return got
            if step <= self._start_step:
                raise ValueError(f"step {step} comes before the resume point (step {self._start_step})")
            if step <= self._state_step:  # asked for an earlier step: replay from the start state
                self._state, self._state_step = self._start.copy(), self._start_step
            while self._state_step < step:
                sources, draws = self._state.assign(self.global_batch_size)
                self._state_step += 1
                self._history[self._state_step] = (sources, draws, list(self._state.counts))
                while len(self._history) > HISTORY:
                    self._history.popitem(last=False)
            return self._history[step]

    def checkpoint_state(self, step: int) -> Optional[dict]:
        """What the checkpoint of `step` stores about the data (None without a mixture)."""
        if not self.mixture:
            return None
        step += self.skipped
        if step == self._start_step:
            return {"mixture": self._start.to_dict()}
        _, _, counts = self._assignment(step)
        state = self._start.copy()
        state.counts = list(counts)
        return {"mixture": state.to_dict()}

    def step_metrics(self, step: int) -> Dict[str, float]:
        """data/<name>/tokens: each source's consumed tokens after `step` (the whole run, every rank)."""
        if not self.mixture:
            return {}
        _, _, counts = self._assignment(step + self.skipped)
        return {f"data/{n}/tokens": c * self.seq_len for n, c in zip(self.names, counts)}

    # ------------------------------------------------------------------ batches
    def _rank_draws(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """(source, draw) of each sample this rank loads at `step`."""
        p = self.part
        step += self.skipped
        per_rank = self.global_batch_size // p.dp_size
        first = p.dp_rank * per_rank
        count = p.grad_accum_steps * p.micro_batch_size
        if not self.mixture:
            base = (step - 1) * self.global_batch_size + first
            return np.zeros(count, dtype=np.int64), np.arange(base, base + count, dtype=np.int64)
        sources, draws, _ = self._assignment(step)
        return (np.asarray(sources[first:first + count], dtype=np.int64),
                np.asarray(draws[first:first + count], dtype=np.int64))

    def _window_indices(self, sources: np.ndarray, draws: np.ndarray) -> np.ndarray:
        out = np.zeros(len(draws), dtype=np.int64)
        for s, perm in enumerate(self.permutations):
            mine = sources == s
            if not mine.any():
                continue
            epochs, offsets = np.divmod(draws[mine], perm.n)
            got = np.zeros(len(offsets), dtype=np.int64)
            for epoch in np.unique(epochs):
                at = epochs == epoch
                got[at] = perm.windows(int(epoch), offsets[at])
            out[mine] = got
        return out

    def for_step(self, step: int) -> List[Microbatch]:
        """Micro-batches for 1-based `step`: samples consumed before it = (step-1) * global batch."""
        if step < 1:
            raise ValueError(f"training steps are numbered from 1; got step={step}")
        p = self.part
        sources, draws = self._rank_draws(step)
        windows = self._window_indices(sources, draws)
        out = []
        for m in range(p.grad_accum_steps):
            rows = range(m * p.micro_batch_size, (m + 1) * p.micro_batch_size)
            block = np.stack([self.sources[sources[r]].window(int(windows[r])) for r in rows])
            self._check_ids(block, [(int(sources[r]), int(windows[r])) for r in rows])
            tokens = torch.from_numpy(block)
            ids = pos = None
            if self.want_document_ids or self.want_positions:
                layouts = [self.sources[sources[r]].document_layout(int(windows[r])) for r in rows]
                if self.want_document_ids:
                    ids = torch.from_numpy(np.stack([a for a, _ in layouts]))
                if self.want_positions:
                    pos = torch.from_numpy(np.stack([b for _, b in layouts]))
            src = torch.from_numpy(sources[list(rows)].copy()) if self.mixture else None
            out.append(Microbatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), pos, ids, src))
        return out

    def _check_ids(self, block: np.ndarray, rows: List[Tuple[int, int]]) -> None:
        """Refuse ids >= model.vocab_size for sources no manifest vouches for (else an embedding
        lookup fails deep in the model, or silently reads garbage on some kernels)."""
        if not self.vocab_size:
            return
        for r, (s, w) in enumerate(rows):
            if self.options[s].check_vocab and int(block[r].max()) >= self.vocab_size:
                raise ValueError(
                    f"{self.sources[s].label(w)} (source {self.names[s]!r}) holds token id {int(block[r].max())} "
                    f"but model.vocab_size={self.vocab_size}. Fix: raise model.vocab_size to at least "
                    f"{int(block[r].max()) + 1}, or use data tokenized for this model."
                )


def load_token_arrays(cfg: DataConfig, cache_dir: Path) -> List[np.ndarray]:
    """The token arrays for data.source (embedded | tokens | text)."""
    if cfg.source == "embedded":
        return [embedded_tokens(cfg.embedded_tokens, seed=0)]
    if cfg.source == "tokens":
        return [np.memmap(f, dtype=np.dtype(cfg.dtype), mode="r") for f in shard_files(Path(cfg.path))]
    if cfg.source == "text":
        shard = cached_tokenization(Path(cfg.path), cfg.tokenizer, cfg.dtype, cache_dir)
        return [np.memmap(shard, dtype=np.dtype(cfg.dtype), mode="r")]
    raise ValueError(f"data.source={cfg.source!r} is not one of embedded, tokens, text (indexed: data_step_batches)")


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


def indexed_windows(path: str, seq_len: int) -> Tuple[TokenWindows, bool]:
    """Windows over the indexed dataset at `path` (checked, shards opened on demand), and whether
    its batches need the vocabulary check (no manifest records its largest id)."""
    info = corpus_info(path)
    shards = IndexedShards([s.prefix for s in info.shards], [s.tokens for s in info.shards])
    return TokenWindows(shards, seq_len), not info.has_manifest


def data_step_batches(cfg: DataConfig, *, seq_len: int, seed: int, global_batch_size: int, part: BatchSlice,
                      vocab_size: int, cache_dir: Path, validation: bool = False) -> StepBatches:
    """This rank's step batches of the training data (validation=True: the held-out data)."""
    flags = dict(document_ids=cfg.document_masking, positions=cfg.reset_positions, vocab_size=vocab_size)
    if cfg.source != "indexed":
        if validation:
            arrays = load_val_token_arrays(cfg, cache_dir)
        else:
            arrays = load_token_arrays(cfg, cache_dir)
        check_vocab(arrays, vocab_size)
        return StepBatches(TokenWindows(arrays, seq_len), seed, global_batch_size, part, **flags)

    specs = data_sources(cfg, validation)
    windows, options = [], []
    for spec in specs:
        w, unchecked = indexed_windows(spec.path, seq_len)
        windows.append(w)
        options.append(SourceOptions(spec.name, spec.weight, unchecked))
    return StepBatches(windows, seed, global_batch_size, part, options=options,
                       mixture=is_mixture(cfg, validation), **flags)
