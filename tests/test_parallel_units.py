"""Pure helpers of launcher/parallel (no process group): splits, schedules, errors, LR."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from launcher.config.schema import ModelConfig, OptimConfig
from launcher.parallel.cp import context_parallel_unsupported_reason, shard_positions
from launcher.parallel.fsdp import check_zero_stage
from launcher.engines.optim import lr_factor
from launcher.parallel.pp import layers_per_stage, stage_ids_for_rank
from launcher.parallel.tp import check_tensor_parallel
from launcher.plan.estimate.params import model_shape, stage_params


def test_even_and_explicit_layer_split():
    assert layers_per_stage(4, 2) == [2, 2]
    assert layers_per_stage(5, 2) == [3, 2]
    assert layers_per_stage(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ValueError, match=r"pp_layers=\[1, 2\].*summing to model.n_layers=4"):
        layers_per_stage(4, 2, [1, 2])
    with pytest.raises(ValueError, match="cannot fill 8 pipeline stages"):
        layers_per_stage(4, 8)


def test_stage_placement_matches_planner():
    from launcher.plan.estimate.params import chunks_of_rank

    assert stage_ids_for_rank(1, 2, 1, "1f1b") == [1]
    assert stage_ids_for_rank(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert stage_ids_for_rank(0, 2, 2, "zbv") == [0, 3]
    for sched, v in (("interleaved_1f1b", 3), ("zero_bubble", 2), ("zbv", 2)):
        for r in range(4):
            assert stage_ids_for_rank(r, 4, v, sched) == chunks_of_rank(r, 4, v, sched)
    with pytest.raises(ValueError, match="pp_virtual_stages=2"):
        stage_ids_for_rank(0, 2, 1, "zbv")
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        stage_ids_for_rank(0, 2, 2, "1f1b")
    with pytest.raises(ValueError, match="not one of"):
        stage_ids_for_rank(0, 2, 1, "bogus")


def test_tp_refuses_gqa_with_too_few_kv_heads():
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load("conf/model/debug.yaml")))
    check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError) as e:
        check_tensor_parallel(cfg, 4)
    msg = str(e.value)
    assert "model.n_kv_heads=2 is not divisible by 4" in msg and "parallel.tp=4" in msg and "Fix:" in msg


def test_zero_stage_below_two_points_to_deepspeed():
    check_zero_stage(2)
    check_zero_stage(3)
    with pytest.raises(ValueError, match="backend.sharding=deepspeed"):
        check_zero_stage(1)


def test_context_parallel_cpu_reason_and_sharding():
    assert "GPU" in context_parallel_unsupported_reason("cpu", "ring")
    assert context_parallel_unsupported_reason("cuda", "ring") is None
    assert context_parallel_unsupported_reason("cpu", "allgather") is None
    assert shard_positions(8, 2, 0) == [0, 1, 6, 7]
    assert shard_positions(8, 2, 1) == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="divisible by 2\\*parallel.cp=4"):
        shard_positions(10, 2, 0)


def test_lr_schedule_warmup_and_decay():
    kw = dict(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_factor(0, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(9, schedule="cosine", **kw) == pytest.approx(1.0)
    assert lr_factor(60, schedule="cosine", **kw) == pytest.approx(0.55)
    assert lr_factor(110, schedule="cosine", **kw) == pytest.approx(0.1)
    assert lr_factor(60, schedule="linear", **kw) == pytest.approx(0.55)
    assert lr_factor(500, schedule="linear", **kw) == pytest.approx(0.1)
    assert lr_factor(60, schedule="constant", **kw) == 1.0


def test_pipeline_stage_sizes_match_planner():
    """The stage modules hold what the planner's stage_params predicts."""
    import torch

    from launcher.models import build_model
    from launcher.parallel.pp import build_stage_module

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load("conf/model/debug_moe.yaml")))
    with torch.device("meta"):
        whole = build_model(cfg)
    counts = layers_per_stage(cfg.n_layers, 4)
    predicted = stage_params(model_shape(cfg), 2, 2, "interleaved_1f1b")
    for rank in range(2):
        ids = stage_ids_for_rank(rank, 2, 2, "interleaved_1f1b")
        n = sum(p.numel() for s in ids for p in build_stage_module(whole, s, counts).parameters())
        assert n == predicted[rank].shared + predicted[rank].routed
