"""The order windows are read in: a keyed permutation computed on the fly, in constant memory.

Each epoch of a source visits every one of its `n` windows exactly once, in an order that is a
pure function of (seed, source, epoch, position). Nothing per window is ever built: the window
at `position` is the image of `position` under a bijection of [0, n), computed when asked.

The bijection is a balanced Feistel network (six rounds, a splitmix64-style round function
keyed by the seed, the source and the epoch) over the smallest power of four >= n, restricted
to [0, n) by cycle-walking: encrypt again while the value is >= n. A permutation of the larger
domain restricted this way is a permutation of [0, n); since the domain is at most 4n, a value
walks about 4 times at most on average. All arithmetic is vectorised over numpy uint64 arrays,
whose multiplications wrap modulo 2^64 as the hash needs. No torch: the planner may import it.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Tuple

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a good 64-bit avalanche in three multiply-xorshifts."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, stream: str, epoch: int) -> int:
    """A 64-bit key for one (seed, source, epoch): stable across Python versions and machines."""
    digest = hashlib.blake2b(f"{int(seed)}\x1f{stream}\x1f{int(epoch)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class WindowPermutation:
    """A bijection of [0, n) per epoch: `windows(epoch, positions)` gives the window read at each
    position of that epoch. `stream` names the source, so sources are shuffled independently."""

    def __init__(self, n: int, seed: int, stream: str = ""):
        if n < 1:
            raise ValueError(f"a permutation needs at least one window, got n={n}")
        self.n = int(n)
        self.seed = int(seed)
        self.stream = stream
        bits = max(2, (self.n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self._keys: Dict[int, Tuple[np.uint64, ...]] = {}

    def _round_keys(self, epoch: int) -> Tuple[np.uint64, ...]:
        keys = self._keys.get(epoch)
        if keys is None:
            base = stream_key(self.seed, self.stream, epoch)
            keys = tuple(np.uint64((base + (r + 1) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF) for r in range(ROUNDS))
            if len(self._keys) > 8:  # a run touches one or two epochs at a time
                self._keys.clear()
            self._keys[epoch] = keys
        return keys

    def _encrypt(self, x: np.ndarray, keys) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << half) | right

    def windows(self, epoch: int, positions) -> np.ndarray:
        """The window index (int64) at each position (0 <= position < n) of `epoch`."""
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n}) within an epoch")
        if self.n == 1:
            return np.zeros(pos.shape, dtype=np.int64)
        keys = self._round_keys(int(epoch))
        out = self._encrypt(pos.astype(np.uint64), keys)
        walking = out >= np.uint64(self.n)
        while walking.any():  # cycle-walk the few values that left [0, n)
            out[walking] = self._encrypt(out[walking], keys)
            walking = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def at(self, sample: int) -> int:
        """The window of a source's `sample`-th draw (epoch = sample // n): one value."""
        epoch, offset = divmod(int(sample), self.n)
        return int(self.windows(epoch, [offset])[0])
