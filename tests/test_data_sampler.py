"""The sampler: every window exactly once per epoch, a pure function of (seed, source, epoch,
position), and nothing built per window, so a corpus of terabytes costs no memory."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher.data.sampler import WindowPermutation

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 17, 100, 1000, 4097, 65_537])
def test_every_window_exactly_once_per_epoch(n):
    perm = WindowPermutation(n, seed=1234, stream="web")
    orders = [perm.windows(epoch, np.arange(n)) for epoch in range(3)]
    for order in orders:
        assert np.array_equal(np.sort(order), np.arange(n))  # a bijection of [0, n)
    if n > 3:
        assert not np.array_equal(orders[0], orders[1])  # each epoch its own order
        assert not np.array_equal(orders[0], np.arange(n))  # shuffled


def test_order_is_a_pure_function_of_seed_source_epoch_position():
    a = WindowPermutation(10_000, seed=7, stream="web")
    b = WindowPermutation(10_000, seed=7, stream="web")
    positions = np.array([9_999, 0, 5_000, 17])
    assert np.array_equal(a.windows(3, positions), b.windows(3, positions))
    assert [a.at(3 * 10_000 + int(p)) for p in positions] == list(a.windows(3, positions))
    full = a.windows(3, np.arange(10_000))
    assert np.array_equal(full[positions], a.windows(3, positions))  # random access, no state
    assert not np.array_equal(full, WindowPermutation(10_000, seed=8, stream="web").windows(3, np.arange(10_000)))
    assert not np.array_equal(full, WindowPermutation(10_000, seed=7, stream="code").windows(3, np.arange(10_000)))


def test_a_huge_sparse_corpus_is_indexed_and_sampled_without_memory(tmp_path):
    """A 4 TiB .bin (sparse: no disk used) with a real .idx of a few very long documents opens and
    yields windows while the process's peak RSS grows by a few MB (a per-window array would need
    16 GB here: 2 billion windows of 1,024 tokens)."""
    code = f"""
import os, resource, sys
import numpy as np
sys.path.insert(0, {str(REPO)!r})
from launcher.data.indexed import write_index
from launcher.data.dataset import BatchSlice, StepBatches, indexed_windows
prefix = {str(tmp_path / 'huge')!r}
tokens = 2 * 2**40  # uint16: 4 TiB
docs = 4096  # 2^29 tokens each (a sequence length is int32)
with open(prefix + '.bin', 'wb') as f:
    f.truncate(tokens * 2)
write_index(prefix + '.idx', np.uint16, [tokens // docs] * docs)
import torch  # counted before the baseline, like any rank has it
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
windows, unchecked = indexed_windows(prefix, 1024)
assert windows.n_windows == (tokens - 1) // 1024, windows.n_windows
batches = StepBatches(windows, 1234, 4096, BatchSlice(2047, 2048, 2, 1), document_ids=True, positions=True)
mbs = batches.for_step(1) + batches.for_step(10**6)
assert mbs[0].inputs.shape == (2, 1024)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print('GROWTH_KB', after - before)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    growth_kb = int(proc.stdout.split("GROWTH_KB")[1].split()[0])
    assert growth_kb < 64 * 1024, f"peak RSS grew by {growth_kb} KB while indexing 2 billion windows"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
