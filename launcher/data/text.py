"""Raw text files -> token shard, with a local Hugging Face `tokenizer.json` (never downloaded)."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path
from typing import List

import numpy as np


def text_files(path: Path) -> List[Path]:
    """A text file, or every *.txt / *.md / *.jsonl-free text file below a folder, sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ".text"))
    if not files:
        raise FileNotFoundError(f"data.path={path} holds no .txt/.md/.text files. Fix: point data.path at a text file or folder.")
    return files


def _load_tokenizer(tokenizer_path: str):
    if not tokenizer_path:
        return None
    path = Path(tokenizer_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"data.tokenizer={tokenizer_path} does not exist. Fix: give the path of a local tokenizer.json "
            f"(the launcher never downloads tokenizers), or data.tokenizer='' for byte tokens."
        )
    from tokenizers import Tokenizer  # lazy: tokenizers (a Rust extension) only when a tokenizer.json is read

    return Tokenizer.from_file(str(path))


def tokenize_text(path: Path, tokenizer_path: str, dtype: str) -> np.ndarray:
    """Tokenize all text under `path` (files concatenated in sorted order); byte tokens when no tokenizer is given."""
    tok = _load_tokenizer(tokenizer_path)
    chunks = []
    for f in text_files(path):
        text = f.read_text(encoding="utf-8", errors="replace")
        if tok is None:
            ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        else:
            ids = np.asarray(tok.encode(text).ids, dtype=np.int64)
        chunks.append(ids)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    np_dtype = np.dtype(dtype)
    if tokens.size and tokens.max() > np.iinfo(np_dtype).max:
        raise ValueError(f"token id {int(tokens.max())} does not fit data.dtype={dtype}. Fix: data.dtype=uint32.")
    return tokens.astype(np_dtype)


def cached_tokenization(path: Path, tokenizer_path: str, dtype: str, cache_dir: Path) -> Path:
    """Tokenize once into `cache_dir` (a .bin shard keyed by inputs); return the shard path."""
    key = hashlib.sha256()
    for f in text_files(path):
        st = f.stat()
        key.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    tok_stamp = Path(tokenizer_path).stat().st_mtime_ns if tokenizer_path and Path(tokenizer_path).is_file() else 0
    key.update(f"{tokenizer_path}:{tok_stamp}:{dtype}".encode())
    out = Path(cache_dir) / f"text-{key.hexdigest()[:16]}.{dtype}.bin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp-{uuid.uuid4().hex}")
        tokenize_text(path, tokenizer_path, dtype).tofile(tmp)
        tmp.replace(out)
    return out
