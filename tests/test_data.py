"""Data: deterministic, resumable sampling, data-parallel slicing, token shards, local tokenizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from launcher.config.schema import DataConfig
from launcher.data.dataset import BatchSlice, StepBatches, TokenWindows, check_vocab, load_token_arrays
from launcher.data.embedded import embedded_corpus_text, embedded_tokens


def _batches(arrays, dp_rank, dp_size, micro, accum, seed=7, global_batch=8, seq=16):
    return StepBatches(TokenWindows(arrays, seq), seed, global_batch, BatchSlice(dp_rank, dp_size, micro, accum))


def _rows(microbatches):
    return torch.cat([mb.inputs for mb in microbatches])


def test_layouts_see_the_same_global_batch():
    arrays = [embedded_tokens(20_000)]
    single = _rows(_batches(arrays, 0, 1, 2, 4).for_step(3))
    split = torch.cat([_rows(_batches(arrays, r, 2, 1, 4).for_step(3)) for r in range(2)])
    assert torch.equal(single, split)


def test_embedded_corpus_is_cached_per_machine_and_read_back_exactly(tmp_path, monkeypatch):
    """The generated corpus is written once under XDG_CACHE_HOME and read back by later calls;
    a cached file of the wrong length (a torn copy) is generated again, and every result equals
    the generator's own text."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    want = np.frombuffer(embedded_corpus_text(3_000, seed=5).encode("ascii"), dtype=np.uint8).astype(np.uint16)
    first = embedded_tokens(3_000, seed=5)
    (cached,) = (tmp_path / "launcher" / "embedded").glob("*-seed5-3000.txt")
    assert first.dtype == np.uint16 and np.array_equal(first, want)
    cached.write_bytes(b"x" * 3_000)  # read back, not generated again
    assert bytes(embedded_tokens(3_000, seed=5).astype(np.uint8)) == b"x" * 3_000
    cached.write_bytes(b"torn")
    assert np.array_equal(embedded_tokens(3_000, seed=5), want) and cached.read_bytes() == bytes(want.astype(np.uint8))
    assert not list(cached.parent.glob(".*"))  # no temporary file left behind


def test_labels_are_inputs_shifted_by_one():
    inp, lab = _batches([embedded_tokens(5_000)], 0, 1, 2, 1).for_step(1)[0][:2]
    assert inp.shape == lab.shape == (2, 16)
    assert torch.equal(inp[:, 1:], lab[:, :-1])


def test_sampling_is_a_pure_function_of_seed_and_step():
    arrays = [embedded_tokens(20_000)]
    a = _batches(arrays, 0, 1, 2, 2)
    first = [_rows(a.for_step(s)) for s in (1, 2, 3)]
    b = _batches(arrays, 0, 1, 2, 2)  # a "resumed" loader jumps straight to step 3
    assert torch.equal(_rows(b.for_step(3)), first[2])
    assert not torch.equal(first[0], first[1])
    assert not torch.equal(_rows(_batches(arrays, 0, 1, 2, 2, seed=8).for_step(1)), first[0])


def test_epochs_wrap_with_a_new_order():
    arrays = [np.arange(200, dtype=np.uint16)]
    windows = TokenWindows(arrays, 16)
    assert windows.n_windows == 12
    loader = _batches(arrays, 0, 1, 1, 1, global_batch=1)
    epoch0 = [int(loader.for_step(s)[0].inputs[0, 0]) for s in range(1, 13)]
    epoch1 = [int(loader.for_step(s)[0].inputs[0, 0]) for s in range(13, 25)]
    assert sorted(epoch0) == sorted(epoch1) == [16 * i for i in range(12)]
    assert epoch0 != epoch1


def test_token_shards_from_a_folder(tmp_path):
    np.arange(0, 100, dtype=np.uint32).tofile(tmp_path / "a.bin")
    np.arange(1000, 1100, dtype=np.uint32).tofile(tmp_path / "b.bin")
    arrays = load_token_arrays(DataConfig(source="tokens", path=str(tmp_path), dtype="uint32"), tmp_path)
    windows = TokenWindows(arrays, 10)
    assert windows.n_windows == 18
    for i in range(windows.n_windows):
        w = windows.window(i)
        assert len(w) == 11 and np.all(np.diff(w) == 1)  # never crosses a shard boundary


def test_missing_shards_error_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        load_token_arrays(DataConfig(source="tokens", path=str(tmp_path / "nope")), tmp_path)


def test_text_with_a_local_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("the cat sat on the mat " * 50)
    cfg = DataConfig(source="text", path=str(tmp_path / "corpus"), tokenizer=str(tmp_path / "tokenizer.json"), dtype="uint16")
    arrays = load_token_arrays(cfg, tmp_path / "cache")
    assert list(arrays[0][:6]) == [1, 2, 3, 4, 1, 5]
    shards = list((tmp_path / "cache").glob("*.bin"))
    assert len(shards) == 1
    stamp = shards[0].stat().st_mtime_ns
    load_token_arrays(cfg, tmp_path / "cache")  # tokenized once: the second load reuses the cache
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*.bin")] == [stamp]
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_token_arrays(DataConfig(source="text", path=str(tmp_path / "corpus"), tokenizer="missing.json"), tmp_path)


def test_vocab_check():
    with pytest.raises(ValueError, match="vocab_size=100"):
        check_vocab([np.array([5, 150], dtype=np.uint16)], 100)
    big = np.zeros(5_000_000, dtype=np.uint16)
    big[-10] = 150  # large arrays are sampled, not skipped: the tail is always read
    with pytest.raises(ValueError, match="token id 150"):
        check_vocab([big], 100, sample=1_000_000)


def test_too_little_data_is_explained():
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows([np.arange(10, dtype=np.uint16)], 16)
