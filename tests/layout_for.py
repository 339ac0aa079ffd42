"""Test helper: the resolved Layout of a small job, through the real resolver.

Engines are built from a Layout; tests get theirs from `launcher.plan.decide.resolve.resolve` on a
JobConfig (never a hand-made mesh), so what a test runs is what `train` would have planned.
"""

from __future__ import annotations

from typing import Any

from launcher.config.schema import JobConfig, set_dotted
from launcher.plan.layout import Layout
from launcher.plan.decide.resolve import resolve


def job_spec(model_cfg, world: int, **dotted: Any) -> JobConfig:
    """A JobConfig for `model_cfg` on `world` local CPU ranks with dotted-key overrides
    (e.g. ``**{"parallel.tp": 2}``); fp32, 16-token sequences, global batch 4 of micro-batch 1."""
    spec = JobConfig(model=model_cfg)
    spec.cluster.gpus_per_node = world
    spec.trainer.device = "cpu"
    spec.trainer.seq_len = 16
    spec.trainer.global_batch_size = 4
    spec.trainer.micro_batch_size = 1
    spec.precision.name = "fp32"
    spec.precision.fp8.emulate = True
    for key, value in dotted.items():
        set_dotted(spec, key, value)
    return spec


def layout_for(model_cfg, world: int, **dotted: Any) -> Layout:
    """The Layout `train` would plan for this job (raises ConfigError like the CLI would)."""
    return resolve(job_spec(model_cfg, world, **dotted))
