"""Megatron's indexed token format (`PREFIX.bin` + `PREFIX.idx`): read memory-mapped, write.

The format Megatron-LM, NeMo and GPT-NeoX read and write. `.bin` holds the token ids of every
sequence back to back; `.idx` holds, in this order (little-endian):

    b"MMIDIDX\\x00\\x00"   magic
    <Q  1                  version
    <B  dtype code         1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    <Q  sequence count     S
    <Q  document count     D + 1 (the document index array has one more entry than documents)
    int32[S]               tokens per sequence
    int64[S]               byte offset of each sequence in .bin
    int64[D + 1]           sequence index where each document starts, from 0, ending at S

We write one sequence per document (Megatron's tools do the same for plain text), so a
document boundary is a sequence boundary. The reader maps both files: nothing proportional to
the corpus is read into memory; a bad file is refused with its path and what is wrong.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Union

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents + 1


class IndexedFormatError(ValueError):
    """A .bin/.idx pair that is not a readable indexed dataset (the message names the file and a fix)."""


def code_for_dtype(dtype: np.dtype) -> int:
    """The .idx dtype code of a token dtype (uint16 or int32 for token ids, as Megatron picks)."""
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == np.dtype(dtype):
            return code
    raise ValueError(f"dtype {np.dtype(dtype)} has no code in Megatron's indexed format (use uint16 or int32)")


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (the vocabulary is below 65,500, Megatron's own cut), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65_500 else np.dtype(np.int32)


def dataset_prefixes(path: Union[str, Path]) -> List[Path]:
    """The dataset prefixes at `path`: a prefix (`/d/web_000` for web_000.bin/.idx), a .bin or .idx
    file, or a folder whose *.idx files are the shards (sorted by name)."""
    path = Path(path)
    if path.is_dir():
        prefixes = sorted(p.with_suffix("") for p in path.glob("*.idx"))
        if not prefixes:
            raise FileNotFoundError(
                f"{path}: no indexed dataset here (no *.idx files). Fix: point it at a folder written by "
                f"`train action=prepare` (or Megatron's preprocess_data.py), or at a PREFIX of PREFIX.bin/PREFIX.idx."
            )
        return prefixes
    prefix = path.with_suffix("") if path.suffix in (".bin", ".idx") else path
    if not Path(f"{prefix}.idx").is_file():
        raise FileNotFoundError(
            f"{path}: no indexed dataset here ({prefix}.idx does not exist). Fix: point it at a folder written by "
            f"`train action=prepare` (or Megatron's preprocess_data.py), or at a PREFIX of PREFIX.bin/PREFIX.idx."
        )
    return [prefix]


@dataclass(frozen=True)
class IndexHeader:
    """The fixed-size head of an .idx file."""

    dtype: np.dtype
    n_sequences: int
    n_documents: int  # documents (the .idx stores one more index entry than this)
    header_bytes: int


def read_index_header(idx_path: Path) -> IndexHeader:
    """Parse and check the head of an .idx file (magic, version, dtype code)."""
    with open(idx_path, "rb") as f:
        raw = f.read(_HEADER.size)
    if len(raw) < _HEADER.size:
        raise IndexedFormatError(f"{idx_path}: {len(raw)} bytes, too short for an index header. Fix: re-run prepare.")
    magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(raw)
    if magic != INDEX_MAGIC:
        raise IndexedFormatError(
            f"{idx_path}: not a Megatron indexed-dataset index (magic {magic!r}, expected {INDEX_MAGIC!r}). "
            f"Fix: point the path at files written by `train action=prepare` or Megatron's preprocess_data.py."
        )
    if version != INDEX_VERSION:
        raise IndexedFormatError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} is read. "
                                 f"Fix: re-write the dataset with `train action=prepare`.")
    if code not in DTYPE_CODES:
        raise IndexedFormatError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)}). "
                                 f"Fix: re-write the dataset with `train action=prepare`.")
    dtype = np.dtype(DTYPE_CODES[code])
    if dtype.kind not in "iu":
        raise IndexedFormatError(f"{idx_path}: dtype {dtype} is not an integer type, so these are not token ids. "
                                 f"Fix: use a token dataset.")
    return IndexHeader(dtype, int(n_seq), max(0, int(n_doc_idx) - 1), _HEADER.size)


class IndexedDataset:
    """One `.bin`/`.idx` pair, memory-mapped. `tokens` is the whole `.bin` as one flat array of
    token ids (sequences back to back); `document_starts(...)` answers boundary questions
    without loading the index."""

    def __init__(self, prefix: Union[str, Path]):
        self.prefix = Path(prefix)
        self.idx_path = Path(f"{self.prefix}.idx")
        self.bin_path = Path(f"{self.prefix}.bin")
        head = read_index_header(self.idx_path)
        self.dtype = head.dtype
        n_seq = head.n_sequences
        expected = head.header_bytes + n_seq * 4 + n_seq * 8 + (head.n_documents + 1) * 8
        actual = self.idx_path.stat().st_size
        if actual < expected:
            raise IndexedFormatError(
                f"{self.idx_path}: {actual} bytes but its header declares {n_seq} sequences and "
                f"{head.n_documents} documents ({expected} bytes). Fix: the file is truncated; re-run prepare."
            )
        offset = head.header_bytes
        self.sequence_lengths = np.memmap(self.idx_path, np.int32, "r", offset, (n_seq,)) if n_seq else np.zeros(0, np.int32)
        offset += n_seq * 4
        self.sequence_pointers = np.memmap(self.idx_path, np.int64, "r", offset, (n_seq,)) if n_seq else np.zeros(0, np.int64)
        offset += n_seq * 8
        self.document_indices = np.memmap(self.idx_path, np.int64, "r", offset, (head.n_documents + 1,))
        if not self.bin_path.is_file():
            raise FileNotFoundError(f"{self.bin_path} is missing (its index {self.idx_path} exists). "
                                    f"Fix: copy the .bin next to the .idx, or re-run prepare.")
        itemsize = self.dtype.itemsize
        self.n_tokens = int(self.sequence_pointers[-1]) // itemsize + int(self.sequence_lengths[-1]) if n_seq else 0
        bin_bytes = self.bin_path.stat().st_size
        if bin_bytes < self.n_tokens * itemsize:
            raise IndexedFormatError(
                f"{self.bin_path}: {bin_bytes} bytes but its index says {self.n_tokens} tokens of {self.dtype} "
                f"({self.n_tokens * itemsize} bytes). Fix: the .bin is truncated or belongs to another index; re-run prepare."
            )
        self.tokens = np.memmap(self.bin_path, self.dtype, "r", 0, (self.n_tokens,)) if self.n_tokens else np.zeros(0, self.dtype)

    @property
    def n_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def n_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_token_starts(self, first_token: int, end_token: int) -> np.ndarray:
        """Token offsets (into `tokens`) of the document starts inside [first_token, end_token).

        A document starts where its first sequence starts. Binary searches over the mapped
        index: cost logarithmic in the corpus, proportional only to the documents in the range."""
        itemsize = self.dtype.itemsize
        pointers = self.sequence_pointers
        lo = int(np.searchsorted(pointers, first_token * itemsize, side="left"))
        hi = int(np.searchsorted(pointers, end_token * itemsize, side="left"))
        if lo >= hi:
            return np.zeros(0, np.int64)
        seq_ids = np.arange(lo, hi)
        docs = self.document_indices
        # A sequence starts a document when it is listed in document_indices.
        at = np.searchsorted(docs, seq_ids, side="left")
        starts = seq_ids[(at < len(docs)) & (np.asarray(docs[np.minimum(at, len(docs) - 1)]) == seq_ids)]
        return np.asarray(pointers[starts], dtype=np.int64) // itemsize


def write_index(idx_path: Path, dtype: np.dtype, sequence_lengths: Iterable[int]) -> None:
    """Write an .idx for one-sequence-per-document data with these lengths (atomically: written
    aside, then renamed into place)."""
    lengths = np.asarray(list(sequence_lengths) if not isinstance(sequence_lengths, np.ndarray) else sequence_lengths,
                         dtype=np.int64)
    if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
        raise ValueError(f"a document of {int(lengths.max())} tokens exceeds the format's int32 sequence length")
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    documents = np.arange(len(lengths) + 1, dtype=np.int64)
    tmp = Path(f"{idx_path}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, code_for_dtype(dtype), len(lengths), len(documents)))
        f.write(lengths.astype(np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(documents.tobytes())
    tmp.replace(idx_path)


def write_indexed_dataset(prefix: Union[str, Path], documents: Iterable[np.ndarray], dtype: np.dtype) -> int:
    """Write documents (arrays of token ids) as PREFIX.bin + PREFIX.idx; returns the token count.
    Small-data helper for tests and tools; `action=prepare` streams shards itself."""
    prefix = Path(prefix)
    lengths = []
    tmp_bin = Path(f"{prefix}.bin.tmp-{os.getpid()}")
    with open(tmp_bin, "wb") as f:
        for doc in documents:
            arr = np.asarray(doc, dtype=dtype)
            f.write(arr.tobytes())
            lengths.append(len(arr))
    tmp_bin.replace(Path(f"{prefix}.bin"))
    write_index(Path(f"{prefix}.idx"), dtype, lengths)
    return int(sum(lengths))
