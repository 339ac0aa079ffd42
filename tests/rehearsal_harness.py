"""Rehearse layouts of the layout-equivalence matrix (test helper).

    python tests/rehearsal_harness.py CASES.json OUT.json

CASES: [{"name", "model", "model_overrides", "layout": Layout.to_dict(), "compile", "steps"}].
Every rank of each layout is rehearsed (launcher.rehearse.rank.rehearse_rank) with the
engine options the real harness (tests/parallel_harness/run_layouts.py) used; OUT: {name:
[report of rank 0, rank 1, ...]}. Cases without "steps" are rehearsed states-only, one fake
process group after the other in this process; cases with "steps" run the rehearsal's fake
training steps (gradients from a real backward), each rank in a fresh process of its own
(torch's functional collectives keep process-group names across a re-initialised group).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
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


def _rehearse_in_own_process(case_file: Path, rank: int, out: Path) -> dict:
    """One rank of a case with fake steps, in a fresh process (see the module docstring)."""
    subprocess.run([sys.executable, __file__, "--one", str(case_file), str(rank), str(out)], check=True)
    return json.loads(out.read_text())


def main() -> int:
    if sys.argv[1] == "--one":  # CASE.json RANK OUT.json: one rank with fake steps
        case = json.loads(Path(sys.argv[2]).read_text())
        Path(sys.argv[4]).write_text(json.dumps(rehearse_case_rank(case, int(sys.argv[3]), True)))
        return 0
    cases = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    # The per-rank processes of the cases with steps run side by side (each is mostly its torch
    # import and its own fake steps: nothing is shared but the CPUs) while this process rehearses
    # the states-only cases; a failed rank process fails the harness (check=True, .result()).
    reports = {}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        for i, case in enumerate(cases):
            if case.get("steps"):
                case_file = out_path.with_name(f"case_{i}.json")
                case_file.write_text(json.dumps(case))
                world = Layout.from_dict(case["layout"]).mesh.world_size
                reports[case["name"]] = [
                    pool.submit(_rehearse_in_own_process, case_file, rank,
                                out_path.with_name(f"case_{i}_rank_{rank}.json"))
                    for rank in range(world)]
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
