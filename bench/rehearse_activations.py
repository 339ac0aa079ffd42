"""The rehearsal's fake-tensor step against the same step on real tensors: activation peak and peak.

    .venv/bin/python bench/rehearse_activations.py

One rank (debug model, seq 128, micro-batch 2, 2 micro-batches), AC none/full x fp32/bf16: the
engine built for real (NativeEngine on real CPU tensors) and tracked with
launcher.observe.memtrack.track_step_memory, then rehearsed (launcher.rehearse.rank, fake
tensors, fake process group of 1), the same step function in both. Each measurement runs in a
fresh process. Prints a markdown table; not a test.

    .venv/bin/python bench/rehearse_activations.py --multi

Two ranks, bf16, AC none, FSDP2 (dp_shard 2), TP (tp 2) with and without SP, and PP (pp 2,
1F1B and interleaved 1F1B with 2 virtual stages, the layout's 4 micro-batches): a real 2-process
gloo run (torchrun) tracks each rank's step as above (a pipeline rank: the rehearsal's schedule
step, after one untracked step like the rehearsal); each rank is then rehearsed on a fake group
of 2 (docs/notes/2026-11-rehearsal-findings.md has the table of 2026-11-23; docs/planner.md,
"Rehearsal", the tolerance it supports).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


MULTI = {"fsdp2": {"parallel.dp_shard": 2},
         "tp2_sp": {"parallel.tp": 2, "parallel.sp": True, "parallel.dp_shard": 1},
         "tp2": {"parallel.tp": 2, "parallel.sp": False, "parallel.dp_shard": 1},
         "pp2_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.dp_shard": 1},
         "pp2_interleaved_1f1b": {"parallel.pp": 2, "parallel.pp_schedule": "interleaved_1f1b",
                                  "parallel.pp_virtual_stages": 2, "parallel.dp_shard": 1}}


def _layout(ac: str, precision: str, world: int = 1, extra=None):
    from launcher.plan.decide.resolve import resolve
    from tests.layout_for import job_spec
    from tests.parallel_harness.run_layouts import model_config

    mcfg = model_config("debug")
    dotted = {"trainer.seq_len": 128, "trainer.micro_batch_size": 2, "trainer.global_batch_size": 4 * world,
              "activation_checkpointing.mode": ac, "precision.name": precision, **(extra or {})}
    return mcfg, resolve(job_spec(mcfg, world, **dotted))


def measure_multi(mode: str, name: str, rank: int = -1) -> dict:
    """One rank of a 2-rank layout: real (inside torchrun, every rank) or fake (rank `rank`)."""
    import torch
    import torch.distributed as dist

    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.observe.memtrack import track_step_memory
    from launcher.rehearse.rank import rehearse_rank
    from launcher.rehearse.step import pipeline_step_runner, step_runner

    mcfg, lay = _layout("none", "bf16", 2, MULTI[name])
    opts, optim = EngineOptions(total_steps=10, seed=7), OptimConfig(lr=3e-3, warmup_steps=1)
    if mode == "fake":
        return rehearse_rank(mcfg, optim, lay, opts, rank, activations=True)["memory"]
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same token batch on both ranks (the step runner draws it)
    eng = NativeEngine(mcfg, optim, lay, torch.device("cpu"), opts)
    if lay.mesh.pp > 1:  # the rehearsal's pipeline step (static stage shapes), a real warm-up step first
        from launcher.parallel.pp import schedule_stages
        from launcher.rehearse.step import register_recv_buffers

        # The receive buffers counted from the step's start, as the rehearsal counts them.
        m = track_step_memory(eng.model_parts, eng.optimizers, pipeline_step_runner(eng, lay, mcfg.vocab_size),
                              on_enter=register_recv_buffers(schedule_stages(eng.pp_schedule)))
    else:
        m = track_step_memory(eng.model_parts, eng.optimizers, step_runner(eng, lay, mcfg.vocab_size, 2))
    out = [None, None]
    dist.all_gather_object(out, {"activations": m["activations"], "peak": m["total"]})
    dist.barrier()
    dist.destroy_process_group()
    return out


def measure(mode: str, ac: str, precision: str) -> dict:
    import torch

    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.plan.decide.resolve import resolve
    from launcher.observe.memtrack import track_step_memory
    from launcher.rehearse.rank import rehearse_rank
    from launcher.rehearse.step import step_runner
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
    m = track_step_memory(eng.model_parts, eng.optimizers, step_runner(eng, lay, mcfg.vocab_size, 2))
    return {"activations": m["activations"], "peak": m["total"]}


def main_multi() -> int:
    print("| layout (2 ranks, bf16, AC none) | rank | activations real / fake | peak real / fake |")
    print("|---|---|---|---|")
    for name in MULTI:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              __file__, "--multi-one", "real", name], capture_output=True, text=True, check=True)
        real = json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("[")][0])
        for rank in range(2):
            fake = json.loads(subprocess.run([sys.executable, __file__, "--multi-one", "fake", name, str(rank)],
                                             capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
            print(f"| {name} | {rank} | {real[rank]['activations']} / {fake['activations']} | "
                  f"{real[rank]['peak']} / {fake['peak']} |", flush=True)
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        print(json.dumps(measure(*sys.argv[2:])))
        return 0
    if len(sys.argv) >= 4 and sys.argv[1] == "--multi-one":
        got = measure_multi(sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else -1)
        import os
        if sys.argv[2] == "fake" or os.environ.get("RANK") == "0":
            print(json.dumps(got))
        return 0
    if len(sys.argv) == 2 and sys.argv[1] == "--multi":
        return main_multi()
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
