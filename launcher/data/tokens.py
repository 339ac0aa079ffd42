"""Raw token shards (data.source=tokens): the files at a path. Torch-free (the planner checks them)."""

from __future__ import annotations

from pathlib import Path
from typing import List


def shard_files(path: Path, key: str = "data.path") -> List[Path]:
    """A .bin file, or the *.bin files of a folder (sorted); FileNotFoundError naming `key` otherwise."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".bin")
        if files:
            return files
    raise FileNotFoundError(
        f"{key}={path}: no token shards found (expected a .bin file or a folder of .bin files of "
        f"raw uint16/uint32 token ids). Fix: check {key}, or use data.source=text for raw text."
    )
