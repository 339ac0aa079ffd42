"""Rehearse layouts of the layout-equivalence matrix (test helper).

    python tests/rehearsal_harness.py CASES.json OUT.json

CASES: [{"name", "model", "model_overrides", "layout": Layout.to_dict(), "compile", "steps"}].
Every rank of each layout is rehearsed (launcher.rehearse.rank.rehearse_rank) with the
engine options the real harness (tests/parallel_harness/run_layouts.py) used; OUT: {name:
[report of rank 0, rank 1, ...]}. Cases without "steps" are rehearsed states-only, one fake
process group after the other in this process; cases with "steps" run the rehearsal's fake
training steps (gradients from a real backward), each rank in a fresh process of its own
(torch's functional collectives keep process-group names across a re-initialised group),
forked from a server process that imported torch once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.config.schema import OptimConfig  # noqa: E402
from launcher.engines.base import EngineOptions  # noqa: E402
from launcher.plan.layout import Layout  # noqa: E402
from launcher.rehearse.rank import rehearse_rank  # noqa: E402
from tests.parallel_harness.run_layouts import model_config  # noqa: E402


def rehearse_case_rank(case: dict, rank: int, activations: bool) -> dict:
    mcfg = model_config(case["model"], case.get("model_overrides"))
    options = EngineOptions(total_steps=10, grad_clip=1.0, seed=7, compile=case.get("compile", False))
    report = rehearse_rank(mcfg, OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1),
                           Layout.from_dict(case["layout"]), options, rank, activations=activations)
    dist.destroy_process_group()
    return report


def _rank_with_steps(case: dict, rank: int) -> dict:
    """One rank of a case with fake steps, in a fresh process (see the module docstring)."""
    return rehearse_case_rank(case, rank, True)


def _fresh_process_per_rank() -> ProcessPoolExecutor:
    """Worker processes forked from a server that imported this module (torch, the engines) once,
    one per task (max_tasks_per_child=1): a fresh process per rank without an interpreter's imports."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__"])
    return ProcessPoolExecutor(max_workers=min(4, os.cpu_count() or 1), mp_context=ctx, max_tasks_per_child=1)


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    # The per-rank processes of the cases with steps run side by side (each is its own fake steps:
    # nothing is shared but the CPUs) while this process rehearses the states-only cases; a failed
    # rank process fails the harness (.result() raises).
    reports = {}
    with _fresh_process_per_rank() as pool:
        for case in cases:
            if case.get("steps"):
                world = Layout.from_dict(case["layout"]).mesh.world_size
                reports[case["name"]] = [pool.submit(_rank_with_steps, case, rank) for rank in range(world)]
        for case in cases:
            if not case.get("steps"):
                world = Layout.from_dict(case["layout"]).mesh.world_size
                reports[case["name"]] = [rehearse_case_rank(case, r, False) for r in range(world)]
        out = {case["name"]: [r.result() if isinstance(r, Future) else r for r in reports[case["name"]]]
               for case in cases}
    out_path.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
