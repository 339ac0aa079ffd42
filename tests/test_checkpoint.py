"""Checkpoint manager on a real (single-process) native engine: pruning never loses the good state."""

from __future__ import annotations

import shutil

import torch

from launcher.config.loader import compose_spec
from launcher.plan.plan import build_plan
from launcher.runtime.checkpoint import CheckpointManager, verify_checkpoint
from launcher.engines.native import NativeEngine
from launcher.runtime.entry import build_batches, engine_options


def _engine_and_batches(tmp_path):
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=1", "trainer.global_batch_size=2", "trainer.seq_len=32"])
    spec.trainer.steps, spec.trainer.grad_clip, spec.trainer.seed = 10, 1.0, 0
    plan = build_plan(spec)
    engine = NativeEngine(spec.model, spec.optim, plan.layout, torch.device("cpu"), engine_options(spec, tmp_path))
    return engine, build_batches(spec, plan, 0, tmp_path)


def test_prune_keeps_the_new_checkpoint_and_drops_a_newer_broken_timeline(tmp_path):
    engine, batches = _engine_and_batches(tmp_path)
    manager = CheckpointManager(tmp_path / "ckpt", keep=1, verify_checksums=True, rank=0, world_size=1)
    engine.train_step(batches.for_step(1))
    manager.save(2, engine, {"samples_consumed": 4})
    # A newer checkpoint of an abandoned run, corrupted: resume must skip it...
    broken = tmp_path / "ckpt" / "step_00000008"
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", broken)
    (broken / "trainer.json").write_text("{}")
    assert manager.select_resume("auto") == tmp_path / "ckpt" / "step_00000002"
    # ...and saving step 3 with keep=1 must keep step 3 itself, not the broken step 8.
    engine.train_step(batches.for_step(2))
    manager.save(3, engine, {"samples_consumed": 6})
    assert [p.name for p in manager.checkpoints()] == ["step_00000003"]
    assert verify_checkpoint(tmp_path / "ckpt" / "step_00000003") is None


def test_resume_path_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt", keep=1, verify_checksums=True, rank=0, world_size=1)
    try:
        manager.select_resume(str(tmp_path / "typo"))
    except ValueError as err:
        assert "not a folder" in str(err) and "Fix:" in str(err)
    else:
        raise AssertionError("a missing resume path was accepted")
