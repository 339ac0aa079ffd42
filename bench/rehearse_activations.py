"""The rehearsal's fake-tensor step against the same step on real tensors: activation peak and peak.

    .venv/bin/python bench/rehearse_activations.py

One rank (debug model, seq 128, micro-batch 2, 2 micro-batches), AC none/full x fp32/bf16: the
engine built for real (NativeEngine on real CPU tensors) and tracked with
launcher.runtime.memtrack.track_step_memory, then rehearsed (launcher.runtime.rehearse, fake
tensors, fake process group of 1), the same step function in both. Each measurement runs in a
fresh process. Prints a markdown table; not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def measure(mode: str, ac: str, precision: str) -> dict:
    import torch

    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.plan.resolve import resolve
    from launcher.runtime.memtrack import track_step_memory
    from launcher.runtime.rehearse import _fake_step_runner, rehearse_rank
    from tests.layout_for import job_spec
    from tests.parallel_harness.run_layouts import model_config

    mcfg = model_config("debug")
    lay = resolve(job_spec(mcfg, 1, **{"trainer.seq_len": 128, "trainer.micro_batch_size": 2,
                                       "trainer.global_batch_size": 4, "activation_checkpointing.mode": ac,
                                       "precision.name": precision}))
    opts, optim = EngineOptions(total_steps=10, seed=7), OptimConfig(lr=3e-3, warmup_steps=1)
    if mode == "fake":
        return rehearse_rank(mcfg, optim, lay, opts, 0, activations=True)["memory"]
    eng = NativeEngine(mcfg, optim, lay, torch.device("cpu"), opts)
    m = track_step_memory(eng.model_parts, eng.optimizers, _fake_step_runner(eng, lay, mcfg.vocab_size, 2))
    return {"activations": m["activations"], "peak": m["total"]}


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(measure(*sys.argv[2:])))
        return 0
    print("| AC | precision | activations real / fake | peak real / fake |")
    print("|---|---|---|---|")
    for ac in ("none", "full"):
        for precision in ("fp32", "bf16"):
            got = {}
            for mode in ("real", "fake"):
                out = subprocess.run([sys.executable, __file__, "--one", mode, ac, precision], capture_output=True,
                                     text=True, check=True).stdout.strip().splitlines()[-1]
                got[mode] = json.loads(out)
            print(f"| {ac} | {precision} | {got['real']['activations']} / {got['fake']['activations']} | "
                  f"{got['real']['peak']} / {got['fake']['peak']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
