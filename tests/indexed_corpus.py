"""Small indexed datasets for tests: shards written with launcher.data.indexed and, optionally,
the manifest `train action=prepare` writes next to them (launcher/data/corpus.py reads it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from launcher.data.indexed import write_indexed_dataset


def write_corpus(folder: Path, shards: Sequence[Sequence[np.ndarray]], *, manifest: bool = True,
                 tokenizer_sha256: str = "tok-a", max_token_id: Optional[int] = None, dtype=np.uint16) -> Path:
    """Write `shards` (each a list of documents) as shard_00000.bin/.idx, ... into `folder`, plus a
    manifest unless manifest=False (then it reads like Megatron-written data)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    listed = []
    for i, docs in enumerate(shards):
        name = f"shard_{i:05d}"
        tokens = write_indexed_dataset(folder / name, docs, dtype)
        listed.append({"name": name, "documents": len(docs), "tokens": tokens, "dtype": np.dtype(dtype).name,
                       "bin_sha256": "", "idx_sha256": ""})
    if manifest:
        top = max(int(np.max(d)) for docs in shards for d in docs if len(d))
        (folder / "manifest.json").write_text(json.dumps({
            "format": "launcher-indexed", "version": 1, "dtype": np.dtype(dtype).name,
            "tokenizer": {"path": "tokenizer.json", "sha256": tokenizer_sha256, "vocab_size": top + 1,
                          "eos_id": 0, "bos_id": None},
            "max_token_id": top if max_token_id is None else max_token_id,
            "documents": sum(s["documents"] for s in listed), "tokens": sum(s["tokens"] for s in listed),
            "skipped": 0, "shards": listed, "sources": [], "complete": True}))
    return folder


def random_documents(n: int, vocab: int, seed: int, low: int = 5, high: int = 200) -> List[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(low, high))).astype(np.uint16) for _ in range(n)]
