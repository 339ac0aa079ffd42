"""A training corpus generated in-package: works offline, on a fresh machine, with no downloads.

The text is produced by a small seeded grammar (sentences about objects, simple arithmetic,
counting), so it has real structure a model can learn: the loss of the tiny debug model
visibly falls from ln(256) ~ 5.5 nats within a few dozen steps. Tokens are raw bytes (0-255).

Generating the default 2M tokens takes about 0.6 s of CPU in every rank of every launch, so the
bytes are cached per machine in ~/.cache/launcher/embedded/ (XDG_CACHE_HOME is honoured), under
a key that holds this module's own source: a change to the grammar never reads an old corpus.
An unwritable cache only costs the generation.
"""

from __future__ import annotations

import hashlib
import os
import random
import uuid
from pathlib import Path

import numpy as np

_SUBJECTS = ["the cat", "a dog", "the old man", "my friend", "the robot", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "builds", "remembers"]
_OBJECTS = ["the red ball", "a green box", "the river", "an apple", "the tall tree", "a blue car", "the map", "a song"]
_PLACES = ["in the park", "at home", "near the sea", "on the hill", "in the city", "under the bridge"]
_TIMES = ["today", "every morning", "at night", "in spring", "after lunch", "before dawn"]


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(_PLACES)}"
        if rng.random() < 0.3:
            s += f" {rng.choice(_TIMES)}"
        return s[0].upper() + s[1:] + "."
    if kind < 0.75:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        if rng.random() < 0.5:
            return f"{a} plus {b} is {a + b}."
        return f"{max(a, b)} minus {min(a, b)} is {max(a, b) - min(a, b)}."
    start = rng.randint(1, 20)
    n = rng.randint(3, 6)
    return "Count: " + ", ".join(str(start + i) for i in range(n)) + "."


def embedded_corpus_text(n_bytes: int, seed: int = 0) -> str:
    """About `n_bytes` of generated English-like text (deterministic for a seed)."""
    rng = random.Random(seed)
    parts = []
    size = 0
    while size < n_bytes:
        line = " ".join(_sentence(rng) for _ in range(rng.randint(2, 5))) + "\n"
        parts.append(line)
        size += len(line)
    return "".join(parts)[:n_bytes]


def embedded_tokens(n_tokens: int, seed: int = 0) -> np.ndarray:
    """The corpus as byte tokens (uint16 so it batches like any token shard)."""
    return np.frombuffer(_corpus_bytes(n_tokens, seed), dtype=np.uint8).astype(np.uint16)


def _cache_file(n_bytes: int, seed: int) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    grammar = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return Path(base) / "launcher" / "embedded" / f"{grammar}-seed{seed}-{n_bytes}.txt"


def _corpus_bytes(n_bytes: int, seed: int) -> bytes:
    """embedded_corpus_text's bytes, read from the per-machine cache when an earlier process wrote them."""
    path = _cache_file(n_bytes, seed)
    try:
        cached = path.read_bytes()
        if len(cached) == n_bytes:
            return cached
    except OSError:
        pass
    data = embedded_corpus_text(n_bytes, seed).encode("ascii")
    try:  # atomic: ranks of one launch may write the same file at once
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError:
        pass
    return data
