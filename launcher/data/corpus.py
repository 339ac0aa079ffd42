"""What an indexed dataset on disk holds, read without torch and without mapping the token files.

A dataset is a folder written by `train action=prepare` (shards listed in its manifest.json;
a shard not listed there is incomplete and ignored), or Megatron-written data without a manifest
(a PREFIX of PREFIX.bin/.idx, or a folder of them: every *.idx). `corpus_info` checks every shard
(index magic, version and dtype; index and .bin long enough) from the .idx header and the last
index entries (two small reads) and a stat of the .bin, so the planner can check 10,000 shards
before launch and count the tokens each source has. Results are cached by path and mtimes.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

from launcher.data.indexed import IndexedFormatError, dataset_prefixes, read_index_header

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    prefix: Path
    tokens: int
    documents: int


@dataclass(frozen=True)
class CorpusInfo:
    """An indexed dataset's shards and what its manifest says (None: not known, no manifest)."""

    path: Path
    shards: Tuple[ShardInfo, ...]
    max_token_id: Optional[int]
    tokenizer_sha256: Optional[str]
    complete: bool

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def has_manifest(self) -> bool:
        return self.max_token_id is not None

    def windows(self, seq_len: int) -> int:
        """Samples of seq_len + 1 tokens (windows never cross a shard boundary)."""
        return sum(max(0, (s.tokens - 1) // seq_len) for s in self.shards)


def read_manifest(folder: Path) -> Optional[dict]:
    """The folder's manifest.json as a dict, None when there is none (Megatron-written data)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise IndexedFormatError(f"{path}: not readable JSON ({err}). Fix: re-run `train action=prepare` "
                                 f"into this folder (it resumes), or delete the manifest to read the shards as Megatron data.")
    if not isinstance(manifest, dict) or manifest.get("format") != "launcher-indexed" or not isinstance(
            manifest.get("shards"), list):
        raise IndexedFormatError(f"{path}: not a launcher-indexed manifest (no format/shards). Fix: re-run "
                                 f"`train action=prepare` into this folder.")
    return manifest


def shard_stats(prefix: Path) -> Tuple[int, int]:
    """(tokens, documents) of PREFIX.bin/.idx after checking both files, without mapping them."""
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    head = read_index_header(idx_path)
    n_seq = head.n_sequences
    expected = head.header_bytes + n_seq * 12 + (head.n_documents + 1) * 8
    actual = idx_path.stat().st_size
    if actual < expected:
        raise IndexedFormatError(
            f"{idx_path}: {actual} bytes but its header declares {n_seq} sequences and {head.n_documents} "
            f"documents ({expected} bytes). Fix: the file is truncated; re-run prepare.")
    tokens = 0
    if n_seq:
        with open(idx_path, "rb") as f:
            f.seek(head.header_bytes + (n_seq - 1) * 4)
            (last_len,) = struct.unpack("<i", f.read(4))
            f.seek(head.header_bytes + n_seq * 4 + (n_seq - 1) * 8)
            (last_ptr,) = struct.unpack("<q", f.read(8))
        tokens = last_ptr // head.dtype.itemsize + last_len
    if not bin_path.is_file():
        raise FileNotFoundError(f"{bin_path} is missing (its index {idx_path} exists). "
                                f"Fix: copy the .bin next to the .idx, or re-run prepare.")
    bin_bytes = bin_path.stat().st_size
    if bin_bytes < tokens * head.dtype.itemsize:
        raise IndexedFormatError(
            f"{bin_path}: {bin_bytes} bytes but its index says {tokens} tokens of {head.dtype} "
            f"({tokens * head.dtype.itemsize} bytes). Fix: the .bin is truncated or belongs to another index; re-run prepare.")
    return tokens, head.n_documents


def corpus_prefixes(path: Path) -> Tuple[List[Path], Optional[dict]]:
    """The shard prefixes to read at `path` and its manifest (None without one)."""
    path = Path(path)
    manifest = read_manifest(path) if path.is_dir() else None
    if manifest is None:
        return dataset_prefixes(path), None
    prefixes = [path / str(s["name"]) for s in manifest["shards"]]
    if not prefixes:
        raise FileNotFoundError(f"{path}: its manifest lists no complete shard yet. Fix: let "
                                f"`train action=prepare` finish (re-run it: it resumes).")
    return prefixes, manifest


def _stamp(path: Path) -> Tuple:
    """What invalidates the cache: the folder's (or the prefix's files') mtimes."""
    path = Path(path)
    parts = [path / MANIFEST, path] if path.is_dir() else [Path(f"{path.with_suffix('') if path.suffix in ('.bin', '.idx') else path}.{e}") for e in ("idx", "bin")]
    return tuple(os.stat(p).st_mtime_ns if p.exists() else 0 for p in parts)


def corpus_info(path: str) -> CorpusInfo:
    """Every shard of the dataset at `path`, checked (IndexedFormatError / FileNotFoundError with
    the file and a Fix otherwise). Cached: cheap to ask again."""
    return _corpus_info(str(path), _stamp(Path(path)))


@functools.lru_cache(maxsize=64)
def _corpus_info(path: str, stamp: Tuple) -> CorpusInfo:
    prefixes, manifest = corpus_prefixes(Path(path))
    shards = tuple(ShardInfo(p, *shard_stats(p)) for p in prefixes)
    if manifest is None:
        return CorpusInfo(Path(path), shards, None, None, True)
    tok = manifest.get("tokenizer") or {}
    return CorpusInfo(Path(path), shards, int(manifest.get("max_token_id", -1)),
                      tok.get("sha256"), bool(manifest.get("complete", True)))
