"""The generated DeepSpeed JSON passes DeepSpeed's own validation for every supported combination."""

from __future__ import annotations

import itertools
import json
import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from launcher.config.errors import ConfigError  # noqa: E402
from launcher.plan.decide.resolve import validate  # noqa: E402
from launcher.engines.deepspeed_config import (  # noqa: E402
    build_deepspeed_config,
    validate_deepspeed_config,
    write_deepspeed_config,
)
from launcher.plan.decide.backends import example_spec  # noqa: E402
from launcher.plan.present.plan import build_plan  # noqa: E402

SWITCHES = {
    "parallel.zero_stage": [0, 1, 2, 3],
    "precision.name": ["fp32", "bf16"],
    "offload.optimizer": ["none", "cpu", "nvme"],
    "offload.params": ["none", "cpu", "nvme"],
    "backend.zeropp_quantized_weights": [False, True],
    "backend.zeropp_quantized_gradients": [False, True],
    "activation_checkpointing.mode": ["none", "full"],
    "parallel.dp_replicate": [1, 2],
    "parallel.pp": [1, 2],
}



def _config(spec, plan):
    """The DeepSpeed JSON the engine and the pre-launch check generate for this plan."""
    return build_deepspeed_config(plan.layout, grad_clip=spec.trainer.grad_clip, seed=spec.trainer.seed)

def _debug_spec(overrides, world=4):
    spec = example_spec({"backend.default": "deepspeed", "model.name": "debug", "model.n_layers": 4, "model.dim": 64,
                         "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 192, "model.vocab_size": 256,
                         "model.max_seq_len": 256, "trainer.seq_len": 64, "trainer.micro_batch_size": 1,
                         "trainer.global_batch_size": 8, "offload.nvme_path": "/tmp/nvme", **overrides}, world)
    return spec


def _supported_combinations():
    keys = list(SWITCHES)
    for values in itertools.product(*SWITCHES.values()):
        overrides = dict(zip(keys, values))
        spec = _debug_spec(overrides)
        if validate(spec):  # invalid or a backend conflict: not a supported combination
            continue
        yield overrides, spec


def test_every_supported_combination_passes_deepspeed_validation(tmp_path):
    checked = 0
    stages = set()
    for overrides, spec in _supported_combinations():
        plan = build_plan(spec)
        assert plan.backend("sharding") == "deepspeed"
        cfg = _config(spec, plan)
        dp = plan.world_size // plan.mesh.pp
        assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
        assert cfg["gradient_clipping"] == spec.trainer.grad_clip
        zo = cfg["zero_optimization"]
        if spec.offload.optimizer != "none":
            assert zo["offload_optimizer"]["device"] == spec.offload.optimizer
        if spec.offload.params == "nvme":
            assert zo["offload_param"]["nvme_path"] == "/tmp/nvme"
        ds = validate_deepspeed_config(cfg, dp)
        assert ds.bfloat16_config.enabled == (spec.precision.name == "bf16")
        assert ds.gradient_clipping == spec.trainer.grad_clip
        assert ds.zero_config.zero_quantized_weights == bool(zo.get("zero_quantized_weights", False))
        if "offload_optimizer" in zo:
            assert str(getattr(ds.zero_config.offload_optimizer.device, "value", ds.zero_config.offload_optimizer.device)) == spec.offload.optimizer
        stages.add(zo["stage"])
        checked += 1
    assert stages == {0, 1, 2, 3} and checked >= 40, (stages, checked)
    path = write_deepspeed_config(cfg, tmp_path)
    assert json.loads(path.read_text()) == cfg


def test_hsdp_maps_to_hpz_and_batch_is_consistent():
    spec = _debug_spec({"parallel.dp_replicate": 2, "parallel.zero_stage": 3})
    plan = build_plan(spec)
    cfg = _config(spec, plan)
    assert cfg["zero_optimization"]["zero_hpz_partition_size"] == 2
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (8, 1, 2)


def test_deepspeed_rejects_a_broken_config():
    spec = _debug_spec({"parallel.zero_stage": 2})
    cfg = _config(spec, build_plan(spec))
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "floppy"}
    with pytest.raises(Exception, match="floppy|device"):
        validate_deepspeed_config(cfg, 4)
    cfg = _config(spec, build_plan(spec))
    with pytest.raises(ValueError, match="train_batch_size 8 != 1 x 2 x dp 3"):
        validate_deepspeed_config(cfg, 3)


def test_unsupported_combination_is_refused_before_config():
    spec = _debug_spec({"parallel.zero_stage": 2, "parallel.pp": 2})
    problems = validate(spec)
    assert any("refuses ZeRO-2" in p for p in problems), problems
    with pytest.raises(ConfigError):
        from launcher.plan.decide.backends import resolve_backends

        resolve_backends(spec)


def test_preflight_checks_the_generated_config_with_deepspeed():
    """`train` (action=run) checks the DeepSpeed JSON with DeepSpeed's own classes before launch."""
    import dataclasses

    from launcher.launch.preflight import check_deepspeed_config
    from launcher.plan.present.plan import Plan

    spec = _debug_spec({"parallel.zero_stage": 2, "backend.default": "deepspeed"})
    plan = build_plan(spec)
    assert plan.layout.uses_deepspeed
    check_deepspeed_config(spec, plan)  # accepted
    broken = Plan(layout=dataclasses.replace(plan.layout, memory=dataclasses.replace(plan.layout.memory, offload_optimizer="floppy")))
    with pytest.raises(ConfigError) as err:
        check_deepspeed_config(spec, broken)
    (line,) = err.value.problems
    assert line.startswith("DeepSpeed refused the generated config") and "floppy" in line and "Fix:" in line


def test_cli_runs_the_preflight_before_launching():
    """The run path calls the DeepSpeed check between planning and launching (not plan/search)."""
    import ast
    import inspect

    from launcher import cli

    calls = [n.func.id for n in ast.walk(ast.parse(inspect.getsource(cli._run)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert calls.index("_check_before_launch") < calls.index("executor_for")  # the executor starts the ranks
    for fn in (cli._plan, cli._search):
        assert "_check_before_launch" not in inspect.getsource(fn)
