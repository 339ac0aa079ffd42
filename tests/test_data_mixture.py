"""Mixtures: each source's share within one sample of weight x samples after every step, the same
stream on every layout and across a resume at another world size, and a warned weight change."""

from __future__ import annotations

import json
import logging
from fractions import Fraction

import numpy as np
import pytest
import torch

from launcher.config.loader import compose_spec
from launcher.data.dataset import BatchSlice, SourceOptions, StepBatches, indexed_windows
from launcher.data.mixture import MixtureState
from tests.indexed_corpus import random_documents, write_corpus

SEQ = 16
NAMES = ["web", "code", "math"]
WEIGHTS = [0.5, 0.3, 0.2]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    return [write_corpus(root / name, [random_documents(60, 250, seed=i), random_documents(30, 250, seed=10 + i)])
            for i, name in enumerate(NAMES)]


def _batches(corpora, part, weights=WEIGHTS, global_batch=8, seed=3):
    windows = [indexed_windows(str(p), SEQ)[0] for p in corpora]
    options = [SourceOptions(n, w) for n, w in zip(NAMES, weights)]
    return StepBatches(windows, seed, global_batch, part, options=options, mixture=True,
                       document_ids=True, positions=True)


def _within_one_sample(counts, weights, since=None):
    base = since or [0] * len(counts)
    drawn = [c - b for c, b in zip(counts, base)]
    total = sum(drawn)
    shares = [Fraction(repr(w)) / sum(Fraction(repr(x)) for x in weights) for w in weights]
    return max(abs(d - s * total) for d, s in zip(drawn, shares)) < 1


def test_share_within_one_sample_after_every_step_for_1000_steps():
    state = MixtureState.fresh(NAMES, WEIGHTS)
    for _ in range(1000):
        state.assign(12)
        assert _within_one_sample(state.counts, WEIGHTS), state.counts
    # Seven sources with skewed weights: where the "largest deficit" rule drifts past 1.19 samples.
    skewed = [0.256, 0.034, 0.695, 0.006, 0.006, 0.001, 0.002]
    state = MixtureState.fresh([str(i) for i in range(7)], skewed)
    for _ in range(1000):
        state.assign(1)
        assert _within_one_sample(state.counts, skewed), state.counts


def _rows(mbs):
    return {f: torch.cat([getattr(mb, f) for mb in mbs]) for f in ("inputs", "labels", "positions", "document_ids", "sources")}


def _global(per_rank):
    """Concatenate the data-parallel ranks' rows (rank order) field by field."""
    return {f: torch.cat([r[f] for r in per_rank]) for f in per_rank[0]}


def _equal(a, b):
    return all(torch.equal(a[f], b[f]) for f in a)


def test_the_stream_is_the_same_on_one_rank_and_on_dp2_x_tp2(corpora):
    from launcher.plan.present.plan import build_plan
    from launcher.runtime.entry import data_parallel_rank

    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=4", "parallel.tp=2", "trainer.global_batch_size=8",
                         "trainer.micro_batch_size=2"])
    plan = build_plan(spec)
    lay = plan.layout
    assert (lay.mesh.dp, lay.mesh.tp, plan.world_size) == (2, 2, 4)
    single = _batches(corpora, BatchSlice(0, 1, 2, 4))
    ranks = {r: _batches(corpora, BatchSlice(data_parallel_rank(plan, r), lay.mesh.dp, lay.batch.micro_batch_size, lay.batch.microbatches))
             for r in range(4)}
    for step in (1, 2, 7):
        by_dp = {}
        for r, b in ranks.items():
            rows = _rows(b.for_step(step))
            dp = data_parallel_rank(plan, r)
            if dp in by_dp:
                assert _equal(by_dp[dp], rows)  # tensor-parallel peers load the same rows
            by_dp[dp] = rows
        assert _equal(_global([by_dp[d] for d in sorted(by_dp)]), _rows(single.for_step(step)))
    shares = single.step_metrics(7)
    assert shares == {"data/web/tokens": 28 * SEQ, "data/code/tokens": 17 * SEQ, "data/math/tokens": 11 * SEQ}


def test_resume_at_another_world_size_continues_the_same_stream(corpora):
    reference = _batches(corpora, BatchSlice(0, 1, 8, 1))
    expected = {s: _rows(reference.for_step(s)) for s in range(1, 21)}
    first = [_batches(corpora, BatchSlice(r, 2, 2, 2)) for r in range(2)]
    for s in range(1, 11):
        assert _equal(_global([_rows(b.for_step(s)) for b in first]), expected[s])
    stored = json.loads(json.dumps(first[0].checkpoint_state(10)))  # through trainer.json
    assert stored == first[1].checkpoint_state(10)
    second = [_batches(corpora, BatchSlice(r, 4, 1, 2)) for r in range(4)]
    for b in second:
        assert b.resume(10, stored) == []  # same sources and weights: nothing to warn about
    for s in range(11, 21):
        assert _equal(_global([_rows(b.for_step(s)) for b in second]), expected[s])
    # Every source's rows come from its own windows; the mixture field says which.
    assert set(expected[20]["sources"].tolist()) <= {0, 1, 2}


def test_changing_weights_on_resume_warns_and_the_new_shares_hold_from_there(corpora, caplog):
    from launcher.runtime.entry import resume_data

    old = _batches(corpora, BatchSlice(0, 1, 8, 1))
    for s in range(1, 6):
        old.for_step(s)
    stored = old.checkpoint_state(5)
    new_weights = [0.2, 0.2, 0.6]
    new = _batches(corpora, BatchSlice(0, 1, 8, 1), weights=new_weights)
    with caplog.at_level(logging.WARNING, logger="launcher"):
        resume_data(new, {"step": 5, "data": stored}, rank=0)
    assert "web: weight 0.5 -> 0.2" in caplog.text and "math: weight 0.2 -> 0.6" in caplog.text
    base = stored["mixture"]["counts"]
    for s in range(6, 106):
        new.for_step(s)
        counts = new.checkpoint_state(s)["mixture"]["counts"]
        assert _within_one_sample(counts, new_weights, since=base)
        assert all(c >= b for c, b in zip(counts, base))  # each source continues from its read position


def test_source_rows_read_only_their_own_data(tmp_path):
    """Two sources with disjoint token ranges: each row's tokens come from the source it is tagged with."""
    low = write_corpus(tmp_path / "low", [[np.arange(1, 100, dtype=np.uint16)] * 5])
    high = write_corpus(tmp_path / "high", [[np.arange(200, 250, dtype=np.uint16)] * 9])
    windows = [indexed_windows(str(p), SEQ)[0] for p in (low, high)]
    b = StepBatches(windows, 1, 10, BatchSlice(0, 1, 10, 1), options=[SourceOptions("low", 1), SourceOptions("high", 4)],
                    mixture=True)
    mb = b.for_step(1)[0]
    assert mb.sources.tolist().count(0) == 2 and mb.sources.tolist().count(1) == 8
    for row, src in zip(mb.inputs, mb.sources):
        assert bool(((row >= 200) if int(src) else (row < 200)).all())


@pytest.mark.multiprocess
def test_train_on_a_mix_then_resume_on_one_rank_with_new_weights(tmp_path):
    """`train` end to end (2 ranks, then 1): per-source tokens, per-source loss and data_wait_ms in
    metrics.jsonl, read positions in the checkpoint, a resume with document masking that is
    bit-identical to the uninterrupted run, and a resume at another world size with other weights
    that warns and holds the new shares from there."""
    from tests.conftest import read_metrics, run_train

    web = write_corpus(tmp_path / "web", [random_documents(300, 250, 1)])
    code = write_corpus(tmp_path / "code", [random_documents(300, 250, 2)])
    run_dir = tmp_path / "run"
    common = ["+recipe=debug", "data=indexed", "data.document_masking=true", "data.reset_positions=true",
              "data.max_epochs=1000", "trainer.log_every=1", "checkpoint.interval=3"]
    run_train([*common, f"data.mix=[{{path:{web},weight:0.7}},{{path:{code},weight:0.3}}]", "trainer.steps=6",
               "trainer.val_every=3", f"data.val_mix=[{{path:{web},weight:1}}]"], run_dir, check=True)
    records = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert records[3]["val_loss/web"] > 0 and records[6]["val_loss/web"] > 0  # data.val_mix: per source
    for step, r in records.items():
        assert r["data_wait_ms"] >= 0
        counts = [r["data/web/tokens"] // 128, r["data/code/tokens"] // 128]
        assert sum(counts) == 8 * step and _within_one_sample(counts, [0.7, 0.3])
        assert r["loss/web"] > 0 and r["loss/code"] > 0  # per-source loss of this step's rows
    # With document masking and position reset, a run stopped at step 3 and resumed equals the
    # uninterrupted run bit for bit.
    mix = f"data.mix=[{{path:{web},weight:0.7}},{{path:{code},weight:0.3}}]"
    halves = tmp_path / "run_halves"
    run_train([*common, mix, "trainer.steps=3"], halves, check=True)
    run_train([*common, mix, "trainer.steps=6"], halves, check=True)
    resumed = {r["step"]: r for r in read_metrics(halves) if "loss" in r and r["step"] > 3}
    assert [resumed[s]["loss"] for s in (4, 5, 6)] == [records[s]["loss"] for s in (4, 5, 6)]
    assert [resumed[s]["loss/code"] for s in (4, 5, 6)] == [records[s]["loss/code"] for s in (4, 5, 6)]
    stored = json.loads((run_dir / "checkpoints" / "step_00000006" / "trainer.json").read_text())["data"]
    assert stored["mixture"]["counts"] == [records[6]["data/web/tokens"] // 128, records[6]["data/code/tokens"] // 128]

    proc = run_train([*common, f"data.mix=[{{path:{web},weight:0.5}},{{path:{code},weight:0.5}}]", "trainer.steps=10",
                      "cluster.gpus_per_node=1"], run_dir, check=True)
    assert "the data mix differs from the checkpoint's: web: weight 0.7 -> 0.5; code: weight 0.3 -> 0.5" in proc.stdout
    later = {r["step"]: r for r in read_metrics(run_dir) if "loss" in r and r["step"] > 6}
    assert sorted(later) == [7, 8, 9, 10]
    for r in later.values():
        counts = [r["data/web/tokens"] // 128, r["data/code/tokens"] // 128]
        assert _within_one_sample(counts, [0.5, 0.5], since=stored["mixture"]["counts"])


def test_skipping_batches_after_a_resume_reads_the_stream_further_on(corpora):
    """trainer.on_spike=rewind: resumed at step 6 with 2 batches skipped, step 7 reads what step 9
    of the uninterrupted stream read; the checkpoint of a later step resumes the same stream."""
    reference = _batches(corpora, BatchSlice(0, 1, 8, 1))
    expected = {s: _rows(reference.for_step(s)) for s in range(1, 15)}
    first = _batches(corpora, BatchSlice(0, 1, 8, 1))
    for s in range(1, 7):
        first.for_step(s)
    stored = json.loads(json.dumps(first.checkpoint_state(6)))
    rewound = _batches(corpora, BatchSlice(0, 1, 8, 1))
    rewound.resume(6, stored)
    rewound.skip(2)
    for s in range(7, 10):
        assert _equal(_rows(rewound.for_step(s)), expected[s + 2])
    # Its step-9 checkpoint holds the position of data step 11: a resume with batches_skipped=2
    # continues where it left off.
    later = json.loads(json.dumps(rewound.checkpoint_state(9)))
    assert later == reference.checkpoint_state(11)
    again = _batches(corpora, BatchSlice(0, 1, 8, 1))
    again.resume(9, later, skipped=2)
    assert _equal(_rows(again.for_step(10)), expected[12])
