"""data=indexed: document ids and positions per packed row, the manifest's shard list, Megatron
data without a manifest, the background loader, and bad input refused before launch (exit 2,
every problem at once) or, where only the rank can see it, with the file named."""

from __future__ import annotations

import struct
import subprocess

import numpy as np
import pytest
import torch

from launcher.data.dataset import BatchSlice, SourceOptions, StepBatches, indexed_windows
from launcher.data.prefetch import Prefetcher
from tests.conftest import TRAIN, train_env
from tests.indexed_corpus import random_documents, write_corpus

SEQ = 16


def test_rows_carry_document_ids_and_positions_that_restart_at_each_document(tmp_path):
    # Document k holds the value k + 1 in every token, so a token tells its document.
    docs = [np.full(n, k + 1, dtype=np.uint16) for k, n in enumerate([5, 30, 3, 1, 12, 40, 7, 2, 25])]
    windows, unchecked = indexed_windows(str(write_corpus(tmp_path / "d", [docs])), SEQ)
    assert not unchecked  # the manifest records the largest id
    b = StepBatches(windows, 0, windows.n_windows, BatchSlice(0, 1, windows.n_windows, 1), document_ids=True,
                    positions=True)
    mb = b.for_step(1)[0]
    assert mb.document_ids.dtype == torch.int32 and mb.positions.dtype == torch.int64 and mb.sources is None
    seen = set()
    for tokens, ids, pos in zip(mb.inputs, mb.document_ids, mb.positions):
        seen.add(int(tokens[0]))
        new_doc = torch.cat([torch.tensor([False]), tokens[1:] != tokens[:-1]])
        assert torch.equal(ids, torch.cumsum(new_doc.int(), 0).int())  # numbered from 0 in each row
        assert int(pos[0]) == 0  # the row start restarts positions (Megatron's reset_position_ids)
        for t in range(1, SEQ):
            assert int(pos[t]) == (0 if new_doc[t] else int(pos[t - 1]) + 1)
    assert len(seen) > 3
    plain = StepBatches(windows, 0, 4, BatchSlice(0, 1, 4, 1)).for_step(1)[0]
    assert plain.positions is None and plain.document_ids is None  # a plain run pays nothing


def test_manifest_lists_the_complete_shards_and_megatron_data_reads_without_one(tmp_path):
    folder = write_corpus(tmp_path / "d", [random_documents(20, 100, 1), random_documents(20, 100, 2)])
    (folder / "shard_00002.idx").write_bytes(b"half-written")  # not in the manifest: ignored
    assert len(indexed_windows(str(folder), SEQ)[0].shards) == 2
    megatron = write_corpus(tmp_path / "m", [random_documents(20, 100, 1)], manifest=False)
    windows, unchecked = indexed_windows(str(megatron / "shard_00000"), SEQ)  # a PREFIX
    assert unchecked and windows.n_windows > 0


def test_ids_beyond_the_vocabulary_fail_on_the_rank_naming_the_file(tmp_path):
    folder = write_corpus(tmp_path / "m", [[np.arange(0, 400, dtype=np.uint16)]], manifest=False)
    windows, unchecked = indexed_windows(str(folder), SEQ)
    b = StepBatches([windows], 0, 24, BatchSlice(0, 1, 24, 1), options=[SourceOptions("m", 1.0, unchecked)],
                    vocab_size=256)
    with pytest.raises(ValueError, match=r"shard_00000\.bin.*token id .*vocab_size=256.*Fix:"):
        b.for_step(1)


def test_background_loader_yields_the_same_batches_in_order(tmp_path):
    windows = indexed_windows(str(write_corpus(tmp_path / "d", [random_documents(50, 100, 3)])), SEQ)[0]
    make = lambda: StepBatches(windows, 5, 4, BatchSlice(0, 1, 2, 2), positions=True)  # noqa: E731
    direct = make()
    loader = Prefetcher(make(), 1, 6)
    try:
        for step in range(1, 7):
            got, waited_ms = loader.get(step)
            assert waited_ms >= 0
            for a, b in zip(got, direct.for_step(step)):
                assert torch.equal(a.inputs, b.inputs) and torch.equal(a.positions, b.positions)
    finally:
        loader.close()


def _plan(tmp_path, *overrides):
    proc = subprocess.run([TRAIN, "+recipe=debug", "action=plan", "plan.plots=false", *overrides,
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=180,
                          env=train_env(tmp_path), cwd=tmp_path)
    return proc.returncode, proc.stdout + proc.stderr


def _idx_with(path, *, magic=None, version=None, code=None):
    raw = bytearray(path.read_bytes())
    if magic is not None:
        raw[:9] = magic
    if version is not None:
        raw[9:17] = struct.pack("<Q", version)
    if code is not None:
        raw[17] = code
    path.write_bytes(bytes(raw))


def test_bad_indexed_data_exits_2_before_launch_with_every_problem(tmp_path):
    docs = random_documents(30, 200, 4)
    good = write_corpus(tmp_path / "good", [docs], tokenizer_sha256="tok-a")
    other_tok = write_corpus(tmp_path / "other_tok", [docs], tokenizer_sha256="tok-b")
    big_ids = write_corpus(tmp_path / "big_ids", [docs], max_token_id=5000)
    magic = write_corpus(tmp_path / "magic", [docs], manifest=False)
    _idx_with(magic / "shard_00000.idx", magic=b"NOTANIDX\x00")
    version = write_corpus(tmp_path / "version", [docs], manifest=False)
    _idx_with(version / "shard_00000.idx", version=2)
    dtype = write_corpus(tmp_path / "dtype", [docs], manifest=False)
    _idx_with(dtype / "shard_00000.idx", code=6)  # float64: not token ids
    short = write_corpus(tmp_path / "short", [docs], manifest=False)
    with open(short / "shard_00000.bin", "r+b") as f:
        f.truncate(10)
    mix = ",".join(f"{{path:{p},weight:{w}}}" for p, w in [
        (good, 1), (other_tok, 1), (big_ids, 1), (magic, 1), (version, 1), (dtype, 1), (short, 1),
        (tmp_path / "nothing", 1), (good, 0)])
    code, out = _plan(tmp_path, "data=indexed", f"data.mix=[{mix}]")
    assert code == 2, out
    for fragment in ("not a Megatron indexed-dataset index", "index version 2", "not an integer type",
                     "shard_00000.bin: 10 bytes but its index says", "token id 5000", "model.vocab_size=256",
                     "different tokenizers", f"{tmp_path / 'nothing'} does not exist", "weights must be > 0",
                     "several sources are named good"):
        assert fragment in out, (fragment, out[-4000:])
    assert "(9 problems)" in out and out.count("Fix:") == 9 and "Traceback" not in out


def test_paths_without_data_and_document_options_without_boundaries_exit_2(tmp_path):
    code, out = _plan(tmp_path, "data=tokens", "data.path=/etc", "data.document_masking=true",
                      "data.reset_positions=true", "parallel.cp=2", "backend.cp_impl=ring", "trainer.device=cuda",
                      "trainer.global_batch_size=4")
    assert code == 2, out
    for fragment in ("data.path=/etc: no token shards found", "data.document_masking=true needs document boundaries",
                     "data.reset_positions=true needs document boundaries",
                     "ring attention takes no document mask"):
        assert fragment in out, (fragment, out[-4000:])
    assert "Traceback" not in out


def test_plan_warns_when_a_source_would_repeat_more_than_max_epochs(tmp_path):
    from launcher.config.loader import compose_spec
    from launcher.plan.present.plan import build_plan

    small = write_corpus(tmp_path / "small", [random_documents(40, 200, 5)])  # ~4,000 tokens: ~31 windows of 128
    big = write_corpus(tmp_path / "big", [random_documents(4000, 200, 6)])
    mix = f"data.mix=[{{path:{small},weight:0.5}},{{path:{big},weight:0.5}}]"
    spec = compose_spec(["+recipe=debug", "data=indexed", mix, "trainer.steps=40"])  # 320 samples
    warnings = [w for w in build_plan(spec).warnings if "data.max_epochs" in w]
    assert len(warnings) == 1 and "source 'small'" in warnings[0], warnings
    relaxed = compose_spec(["+recipe=debug", "data=indexed", mix, "trainer.steps=40", "data.max_epochs=10"])
    assert not [w for w in build_plan(relaxed).warnings if "data.max_epochs" in w]
