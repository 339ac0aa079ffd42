"""Megatron's indexed format: our reader and writer against megatron-core's own code, and bad files.

megatron-core is a test-only dependency (the `test` extra); its indexed dataset needs no GPU.
"""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest

from launcher.data.indexed import IndexedDataset, IndexedFormatError, write_indexed_dataset


def _megatron():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": not used here
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset

    return indexed_dataset


def _documents(seed: int, n: int, high: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65_000), (np.int32, 200_000)])
def test_files_written_by_megatron_read_back_token_for_token(tmp_path, dtype, high):
    import torch

    md = _megatron()
    docs = _documents(1, 40, high)
    prefix = str(tmp_path / "meg")
    builder = md.IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    # Megatron may split a document into several sequences (e.g. sentences): document 3k has two.
    for k, doc in enumerate(docs):
        if k % 3 == 0 and len(doc) > 1:
            builder.add_item(torch.from_numpy(doc[: len(doc) // 2].astype(np.int64)))
            builder.add_item(torch.from_numpy(doc[len(doc) // 2:].astype(np.int64)))
        else:
            builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")

    ours, theirs = IndexedDataset(prefix), md.IndexedDataset(prefix)
    assert ours.dtype == np.dtype(dtype) and ours.n_documents == len(docs) == len(theirs.document_indices) - 1
    assert ours.tokens.tolist() == np.concatenate(docs).tolist()
    assert ours.sequence_lengths.tolist() == theirs.sequence_lengths.tolist()
    assert ours.document_indices.tolist() == theirs.document_indices.tolist()
    for i in range(len(theirs)):
        start = int(ours.sequence_pointers[i]) // ours.dtype.itemsize
        assert ours.tokens[start:start + int(ours.sequence_lengths[i])].tolist() == theirs[i].tolist()
    # Document starts (not sequence starts) are the boundaries.
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    assert ours.document_token_starts(0, ours.n_tokens).tolist() == starts.tolist()


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65_000), (np.int32, 200_000)])
def test_files_we_write_are_read_by_megatron_and_equal_its_builder_byte_for_byte(tmp_path, dtype, high):
    import torch

    md = _megatron()
    docs = _documents(2, 50, high)
    write_indexed_dataset(tmp_path / "ours", docs, np.dtype(dtype))
    theirs = md.IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs) and theirs.index.dtype == dtype
    for i, doc in enumerate(docs):
        assert theirs[i].tolist() == doc.tolist()
    builder = md.IndexedDatasetBuilder(str(tmp_path / "meg.bin"), dtype=dtype)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc.astype(np.int64)))
        builder.end_document()
    builder.finalize(str(tmp_path / "meg.idx"))
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"meg.{ext}").read_bytes()


def _patched(tmp_path: Path, offset: int, data: bytes) -> Path:
    write_indexed_dataset(tmp_path / "d", _documents(3, 5, 1000), np.dtype(np.uint16))
    raw = bytearray((tmp_path / "d.idx").read_bytes())
    raw[offset:offset + len(data)] = data
    (tmp_path / "d.idx").write_bytes(bytes(raw))
    return tmp_path / "d"


@pytest.mark.parametrize("offset, data, message", [
    (0, b"NOTANIDX\x00", "not a Megatron indexed-dataset index (magic"),
    (9, struct.pack("<Q", 2), "index version 2, only version 1 is read"),
    (17, struct.pack("<B", 99), "unknown dtype code 99"),
    (17, struct.pack("<B", 7), "dtype float32 is not an integer type"),
])
def test_a_bad_index_is_refused_with_the_file_and_a_fix(tmp_path, offset, data, message):
    prefix = _patched(tmp_path, offset, data)
    with pytest.raises(IndexedFormatError) as err:
        IndexedDataset(prefix)
    assert str(prefix) + ".idx" in str(err.value) and message in str(err.value) and "Fix:" in str(err.value)


def test_a_truncated_bin_or_idx_is_refused(tmp_path):
    docs = _documents(4, 5, 1000)
    write_indexed_dataset(tmp_path / "d", docs, np.dtype(np.uint16))
    full = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(full[:-2])
    with pytest.raises(IndexedFormatError) as err:
        IndexedDataset(tmp_path / "d")
    n = sum(map(len, docs))
    assert f"{tmp_path / 'd.bin'}: {2 * n - 2} bytes but its index says {n} tokens" in str(err.value)
    assert "Fix:" in str(err.value)
    (tmp_path / "d.bin").write_bytes(full)
    (tmp_path / "d.idx").write_bytes((tmp_path / "d.idx").read_bytes()[:-8])
    with pytest.raises(IndexedFormatError, match="truncated"):
        IndexedDataset(tmp_path / "d")
