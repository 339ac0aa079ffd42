"""Numerical health on a real one-rank native engine: a step whose gradients are non-finite is
skipped (weights, optimizer state and LR schedule bitwise as before it), later steps train again,
and K skips in a row end the run naming the step, the rank and the first non-finite gradient.
The 2-rank runs are in tests/test_run_health.py."""

from __future__ import annotations

import json
import math

import pytest
import torch

from launcher.engines.base import NonFiniteStep
from launcher.resilience import debug_hooks
from launcher.resilience.failure import FailureBundle, NonFiniteSteps, classify
from launcher.runtime.numerics import NumericalHealth, SpikeDetector, blame


def _snapshot(engine):
    params = {n: p.detach().clone() for part in engine.parts for n, p in part.named_parameters()}
    opt = [{k: (v.clone() if torch.is_tensor(v) else v) for st in o.state.values() for k, v in st.items()}
           for o in engine.optimizers]
    return params, opt, [s.last_epoch for s in engine.schedulers]


def _bitwise_equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()


def test_a_nonfinite_step_is_skipped_and_leaves_every_state_as_it_was(debug_engine, monkeypatch):
    engine, batches, _ = debug_engine
    monkeypatch.setenv("LAUNCHER_DEBUG_NONFINITE", "0:2")
    hooks = debug_hooks.install_nonfinite(engine.parts, rank=0)
    assert len(hooks) == len(engine.parts)
    try:
        numerics = NumericalHealth(max_skipped_steps=2, rank=0)
        debug_hooks.before_step(0, 1)
        first = engine.train_step(batches.for_step(1))
        assert first.skipped is None and math.isfinite(first.loss)
        before = _snapshot(engine)
        debug_hooks.before_step(0, 2)
        bad = engine.train_step(batches.for_step(2))
        numerics.observe(2, bad.skipped)
        assert math.isnan(bad.loss) and not math.isfinite(bad.grad_norm)
        assert bad.skipped == NonFiniteStep(local_loss_finite=False, first_nonfinite=bad.skipped.first_nonfinite)
        # The first parameter in module order: the embedding (every gradient is NaN here).
        first_name = next(n for n, _ in engine.parts[0].named_parameters())
        assert bad.skipped.first_nonfinite == first_name
        after = _snapshot(engine)
        assert _bitwise_equal(before[0], after[0])  # weights
        assert all(_bitwise_equal(x, y) for x, y in zip(before[1], after[1]))  # AdamW moments and step count
        assert before[2] == after[2]  # LR schedule not advanced
        assert all(p.grad is None for part in engine.parts for p in part.parameters())  # gradients dropped
        assert numerics.metrics() == {"health/skipped_steps": 1}
        debug_hooks.before_step(0, 3)
        good = engine.train_step(batches.for_step(3))
        numerics.observe(3, good.skipped)
        assert good.skipped is None and math.isfinite(good.loss) and numerics.consecutive == 0
        assert not _bitwise_equal(after[0], _snapshot(engine)[0])  # training goes on
    finally:
        for h in hooks:
            h.remove()


def test_k_skips_in_a_row_raise_naming_step_ranks_and_tensor(tmp_path):
    numerics = NumericalHealth(max_skipped_steps=2, rank=1, gather=lambda own: [
        NonFiniteStep(local_loss_finite=True, first_nonfinite="layers.0.w"), own])
    numerics.observe(4, NonFiniteStep(False, "embed.weight"))
    numerics.observe(5, None)  # a good step resets the run of skips
    numerics.observe(6, NonFiniteStep(False, "embed.weight"))
    with pytest.raises(NonFiniteSteps) as raised:
        numerics.observe(7, NonFiniteStep(False, "embed.weight"))
    err = raised.value
    assert (err.step, err.ranks, err.first_nonfinite, err.consecutive) == (7, [1], "embed.weight", 2)
    assert numerics.metrics() == {"health/skipped_steps": 3}
    assert classify(err) == "nonfinite" and "Fix:" in str(err)
    bundle = FailureBundle(tmp_path, rank=0, world_size=2)
    summary = json.loads(bundle.record_exception(err, "tb").read_text())
    assert summary["what"] == "nonfinite" and summary["step"] == 7 and summary["failed_ranks"] == [1]
    assert summary["first_nonfinite"] == "embed.weight" and summary["skipped_in_a_row"] == 2


def test_blame_names_every_rank_when_no_loss_was_nonfinite():
    views = [NonFiniteStep(True, None), NonFiniteStep(True, "b")]
    assert blame(views) == {"ranks": [0, 1], "first_nonfinite": "b"}
    assert NumericalHealth(0, 0).observe(1, NonFiniteStep(False, "x")) is None  # 0: never ends the run


def test_a_loss_over_spike_zscore_deviations_above_the_window_is_a_spike(caplog):
    spikes = SpikeDetector(zscore=4.0, window=5)
    curve = [3.0, 2.9, 3.1, 3.0, 2.95]
    assert [spikes.observe(s, x)["health/loss_spike"] for s, x in enumerate(curve, 1)] == [0] * 5  # history filling
    assert spikes.observe(6, float("nan")) == {"health/loss_spike": 0}  # a skipped step: not in the window
    assert spikes.observe(7, 2.8) == {"health/loss_spike": 0}  # lower is never a spike
    assert spikes.observe(8, 6.0) == {"health/loss_spike": 1}
    assert "loss spike at step 8" in caplog.text
    # The spike joined the window: the spread is wide now, and a loss that stays up is not a spike again.
    assert spikes.observe(9, 6.0) == {"health/loss_spike": 0}
