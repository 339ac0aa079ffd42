"""The Plan: what the launcher decided before any GPU is touched.

`build_plan(spec)` is the single place that turns a validated JobConfig into the mesh,
the batch arithmetic, the backend per feature and the estimates. The launcher writes it
to <run_dir>/plan.json and every rank reads it back: the runtime obeys the plan and
never re-decides.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from launcher.config.schema import JobConfig
from launcher.plan.backends import BackendChoice, resolve_backends
from launcher.plan.mesh import MeshPlan, resolve_mesh

PLAN_FILENAME = "plan.json"


@dataclass
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int  # micro-batches per optimizer step on each data-parallel rank
    seq_len: int
    tokens_per_step: int


@dataclass
class Plan:
    world_size: int
    nodes: int
    gpus_per_node: int
    mesh: MeshPlan
    batch: BatchPlan
    backends: Dict[str, BackendChoice]
    # Filled by the estimators (launcher/plan/memory.py, perf.py); plain dicts so that
    # plan.json stays a stable, readable schema.
    params_total: int = 0
    params_active: int = 0
    memory: Dict[str, Any] = field(default_factory=dict)
    comm: Dict[str, Any] = field(default_factory=dict)
    pipeline: Dict[str, Any] = field(default_factory=dict)
    time: Dict[str, Any] = field(default_factory=dict)
    # Predicted checkpoint size, save and stop time (launcher/plan/checkpoint_time.py).
    checkpoint: Dict[str, Any] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)

    def backend(self, feature: str) -> str:
        """The backend ("native" or "deepspeed") chosen for a feature."""
        return self.backends[feature].backend

    @property
    def uses_deepspeed(self) -> bool:
        return any(c.backend == "deepspeed" for c in self.backends.values())

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["mesh"] = self.mesh.to_dict()
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Plan":
        d = dict(d)
        d["mesh"] = MeshPlan(**d["mesh"])
        d["batch"] = BatchPlan(**d["batch"])
        d["backends"] = {k: BackendChoice(**v) for k, v in d["backends"].items()}
        return cls(**d)

    def save(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILENAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, run_dir: Path) -> "Plan":
        return cls.from_dict(json.loads((Path(run_dir) / PLAN_FILENAME).read_text()))


def world_size_of(spec: JobConfig) -> int:
    return spec.cluster.nodes * spec.cluster.gpus_per_node


def build_mesh_plan(spec: JobConfig) -> MeshPlan:
    p = spec.parallel
    return resolve_mesh(
        world_size_of(spec),
        pp=p.pp,
        dp_replicate=p.dp_replicate,
        dp_shard=p.dp_shard,
        cp=p.cp,
        tp=p.tp,
        ep=p.ep,
    )


def build_batch_plan(spec: JobConfig, mesh: MeshPlan) -> BatchPlan:
    t = spec.trainer
    per_step = t.micro_batch_size * mesh.dp
    return BatchPlan(
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=max(1, t.global_batch_size // per_step),
        seq_len=t.seq_len,
        tokens_per_step=t.global_batch_size * t.seq_len,
    )


def build_plan(spec: JobConfig) -> Plan:
    """Plan a validated spec. Call `launcher.config.validate.validate` first."""
    mesh = build_mesh_plan(spec)
    batch = build_batch_plan(spec, mesh)
    plan = Plan(
        world_size=mesh.world_size,
        nodes=spec.cluster.nodes,
        gpus_per_node=spec.cluster.gpus_per_node,
        mesh=mesh,
        batch=batch,
        backends=resolve_backends(spec),
    )
    from launcher.plan import estimate  # estimators fill memory / comm / pipeline / time

    estimate.fill(plan, spec)
    fill_checkpoint_time(plan, spec)
    return plan


def fill_checkpoint_time(plan: Plan, spec: JobConfig) -> None:
    """Predict the save / stop time and warn when the SLURM warning signal comes too late."""
    from launcher.config.validate import stop_lead_warnings
    from launcher.plan.checkpoint_time import checkpoint_estimate

    plan.checkpoint = checkpoint_estimate(plan, spec)
    plan.warnings = list(plan.warnings) + stop_lead_warnings(spec, plan.checkpoint["stop_s"])
