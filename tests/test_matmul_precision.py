"""precision.tf32: fp32 runs on CUDA use TF32 tensor cores (as the planner costs them) unless turned off."""

from __future__ import annotations

import logging

import pytest
import torch

from launcher.config.loader import compose_spec
from launcher.plan.present.plan import build_plan
from launcher.runtime.matmul_precision import apply_matmul_precision


@pytest.fixture
def flags():
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _state():
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def test_fp32_on_cuda_turns_tf32_on_and_logs_it(flags, caplog):
    spec = compose_spec(["precision=fp32"])
    assert spec.precision.tf32 is True  # the default: what the planner costs
    with caplog.at_level(logging.INFO, logger="launcher.runtime.matmul_precision"):
        assert apply_matmul_precision(spec.precision.name, spec.precision.tf32, "cuda") is True
    assert _state() == (True, True)
    assert "TF32" in caplog.text


def test_tf32_false_keeps_full_fp32_and_the_plan_says_its_time_is_optimistic(flags):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    spec = compose_spec(["precision=fp32", "precision.tf32=false", "action=plan", "plan.plots=false"])
    assert apply_matmul_precision(spec.precision.name, spec.precision.tf32, "cuda") is False
    assert _state() == (False, False)
    assert any("precision.tf32=false" in w and "Fix:" in w for w in build_plan(spec).warnings)
    assert not any("tf32" in w for w in build_plan(compose_spec(["precision=fp32", "action=plan"])).warnings)


@pytest.mark.parametrize("precision,device", [("bf16", "cuda"), ("fp8", "cuda"), ("fp32", "cpu")])
def test_other_precisions_and_devices_are_left_alone(flags, precision, device):
    assert apply_matmul_precision(precision, True, device) is False
    assert _state() == (False, False)
