"""The Plan: what the launcher decided before any GPU is touched.

`build_plan(spec, layout)` turns a spec and its resolved `Layout` (launcher/plan/decide/resolve.py,
every derived decision made once) into the plan: the layout plus the estimates. The launcher
writes it to <run_dir>/plan.json and every rank reads it back: the runtime obeys
``plan.layout`` and never re-decides. The mesh, batch and backend sections of plan.json are
views of the layout, written for readers; `Plan.from_dict` reads the layout only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.config.schema import JobConfig
from launcher.config.validate import rope_scaling_warnings, stop_lead_warnings
from launcher.data.checks import repeat_warnings
from launcher.plan.estimate import figures
from launcher.plan.estimate.budget import budget
from launcher.plan.estimate.checkpoint_time import checkpoint_estimate, lost_work_warnings
from launcher.plan.estimate.eval_time import eval_estimate, eval_workload
from launcher.plan.features import BackendChoice
from launcher.plan.layout import Layout
from launcher.plan.degrees import MeshPlan
from launcher.plan.decide.resolve import resolve

PLAN_FILENAME = "plan.json"
# The Plan's own sections besides the layout, in plan.json order.
ESTIMATE_KEYS = ("params_total", "params_active", "memory", "comm", "pipeline", "time", "checkpoint", "eval",
                 "budget", "warnings")


@dataclass(frozen=True)
class BatchPlan:
    """The batch arithmetic of a Layout (a view: global = micro x accumulation x dp)."""

    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int  # micro-batches per optimizer step on each data-parallel rank
    seq_len: int
    tokens_per_step: int


@dataclass
class Plan:
    layout: Layout
    # Filled by the estimators (launcher/plan/estimate/memory.py, perf.py); plain dicts so that
    # plan.json stays a stable, readable schema.
    params_total: int = 0
    params_active: int = 0
    memory: Dict[str, Any] = field(default_factory=dict)
    comm: Dict[str, Any] = field(default_factory=dict)
    pipeline: Dict[str, Any] = field(default_factory=dict)
    time: Dict[str, Any] = field(default_factory=dict)
    # Predicted checkpoint size, save and stop time (launcher/plan/estimate/checkpoint_time.py).
    checkpoint: Dict[str, Any] = field(default_factory=dict)
    # In-loop evaluation's tokens and time per call (launcher/plan/estimate/eval_time.py; {} when off).
    eval: Dict[str, Any] = field(default_factory=dict)
    # Steps, wall time, GPU-hours and cost of the run (launcher/plan/estimate/budget.py).
    budget: Dict[str, Any] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)

    # ------------------------------------------------------------------ views of the layout
    @property
    def world_size(self) -> int:
        return self.layout.mesh.world_size

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    @property
    def gpus_per_node(self) -> int:
        return self.layout.gpus_per_node

    @property
    def mesh(self) -> MeshPlan:
        return self.layout.mesh

    @property
    def batch(self) -> BatchPlan:
        lay, b = self.layout, self.layout.batch
        return BatchPlan(lay.global_batch_size, b.micro_batch_size, b.microbatches, b.seq_len, lay.tokens_per_step)

    @property
    def backends(self) -> Dict[str, BackendChoice]:
        return self.layout.backends

    def backend(self, feature: str) -> str:
        """The backend ("native" or "deepspeed") chosen for a feature."""
        return self.backends[feature].backend

    @property
    def uses_deepspeed(self) -> bool:
        return any(c.backend == "deepspeed" for c in self.backends.values())

    # ------------------------------------------------------------------ plan.json
    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {
            "layout": self.layout.to_dict(),
            "world_size": self.world_size,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "mesh": self.mesh.to_dict(),
            "batch": asdict(self.batch),
            "backends": {k: asdict(v) for k, v in self.backends.items()},
        }
        for key in ESTIMATE_KEYS:
            d[key] = getattr(self, key)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        return cls(layout=Layout.from_dict(d["layout"]), **{k: d[k] for k in ESTIMATE_KEYS if k in d})

    def save(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILENAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Plan":
        return cls.from_dict(json.loads((Path(run_dir) / PLAN_FILENAME).read_text()))


def build_plan(spec: JobConfig, layout: Optional[Layout] = None) -> Plan:
    """Plan a spec: its Layout (resolved here unless the caller already has it) plus estimates.

    Raises ConfigError when the spec cannot be resolved (`launcher.plan.decide.resolve.check` reports
    every problem at once; call it first).
    """
    if layout is None:
        layout = resolve(spec)
    plan = Plan(layout=layout)
    figures.fill(plan, spec)
    fill_checkpoint_time(plan, spec)
    plan.eval = eval_estimate(eval_workload(spec), plan.time["compute_s"], layout.tokens_per_step)
    plan.budget = budget(spec.trainer.steps, layout.tokens_per_step, plan.time["step_s"], plan.time["step_s_range"],
                         layout.mesh.world_size, spec.hardware.usd_per_gpu_hour, plan.eval.get("total_s", 0.0))
    plan.warnings = (list(plan.warnings) + repeat_warnings(spec, spec.trainer.steps, layout.global_batch_size)
                     + rope_scaling_warnings(spec))
    return plan


def fill_checkpoint_time(plan: Plan, spec: JobConfig) -> None:
    """Predict the save / stop time and warn when the SLURM warning signal comes too late."""
    plan.checkpoint = checkpoint_estimate(plan, spec)
    plan.warnings = (list(plan.warnings) + stop_lead_warnings(spec, plan.checkpoint["stop_s"])
                     + lost_work_warnings(plan.checkpoint, plan.time["step_s"]))
