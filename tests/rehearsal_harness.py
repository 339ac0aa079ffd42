"""Rehearse layouts of the layout-equivalence matrix in one process (test helper).

    python tests/rehearsal_harness.py CASES.json OUT.json

CASES: [{"name", "model", "model_overrides", "layout": Layout.to_dict(), "compile"}]. Every
rank of each layout is rehearsed (launcher.runtime.rehearse.rehearse_rank, with its fake training
steps: the gradients are those a backward makes) with the engine
options the real harness (tests/parallel_harness/run_layouts.py) used, one fake process
group at a time in this process; OUT: {name: [report of rank 0, rank 1, ...]}.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.config.schema import OptimConfig  # noqa: E402
from launcher.engines.base import EngineOptions  # noqa: E402
from launcher.plan.layout import Layout  # noqa: E402
from launcher.runtime.rehearse import rehearse_rank  # noqa: E402
from tests.parallel_harness.run_layouts import model_config  # noqa: E402


def main() -> int:
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = {}
    for case in cases:
        mcfg = model_config(case["model"])
        if case.get("model_overrides"):
            mcfg = replace(mcfg, **case["model_overrides"])
        layout = Layout.from_dict(case["layout"])
        options = EngineOptions(total_steps=10, grad_clip=1.0, seed=7, compile=case.get("compile", False))
        reports = []
        for rank in range(layout.world_size):
            reports.append(rehearse_rank(mcfg, OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1), layout,
                                         options, rank, activations=True))
            dist.destroy_process_group()
        out[case["name"]] = reports
    Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
