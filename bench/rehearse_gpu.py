"""The rehearsal's step memory (fake tensors on the CPU) against the same step on a real GPU.

    python bench/rehearse_gpu.py --json out.json      # on a machine with a CUDA GPU
    python bench/rehearse_gpu.py --smoke              # CPU only: checks the harness (real = CPU)

`action=rehearse` measures a rank's training step with fake tensors on the CPU, so its
activation peak is that of our CPU kernels for the real shapes. This benchmark puts a number on
how that relates to a GPU. For each row (one rank, bf16 autocast over fp32 master weights,
AdamW, two micro-batches per step):

    real   launcher.rehearse.real.rehearse_real_rank: what `action=rehearse rehearse.device=cuda
           rehearse.tensors=real` runs for the rank (real tensors on the GPU, a fake process group
           of one rank): one warm-up step, one timed step (torch.cuda.max_memory_allocated over
           it), then one step tracked by MemTracker (categories)
    fake   launcher.rehearse.rank.rehearse_rank: what `action=rehearse` reports for the rank
    plan   launcher.plan.present.plan.build_plan: the planner's per-category prediction

The step is the rehearsal's own (launcher/rehearse/step.py) in both, so the only
difference is the device's kernels and allocator. Each measurement runs in a fresh process.
Prints a markdown table (bytes in MiB, errors relative to the GPU's MemTracker figure).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (row name, conf/model entry, dotted overrides). Sizes fit one 80 GB GPU with fp32 states.
ROWS = (
    ("debug s128 AC none", "debug", {"trainer.seq_len": 128, "trainer.micro_batch_size": 2}),
    ("debug s128 AC full", "debug", {"trainer.seq_len": 128, "trainer.micro_batch_size": 2,
                                     "activation_checkpointing.mode": "full"}),
    ("debug_moe s128 AC none", "debug_moe", {"trainer.seq_len": 128, "trainer.micro_batch_size": 2}),
    ("llama_1b s4096 mb1 AC none", "llama_1b", {"trainer.seq_len": 4096, "trainer.micro_batch_size": 1}),
    ("llama_1b s4096 mb1 AC full", "llama_1b", {"trainer.seq_len": 4096, "trainer.micro_batch_size": 1,
                                                "activation_checkpointing.mode": "full"}),
    ("llama_1b s2048 mb2 AC selective", "llama_1b", {"trainer.seq_len": 2048, "trainer.micro_batch_size": 2,
                                                      "activation_checkpointing.mode": "selective"}),
)
SMOKE_ROWS = ROWS[:3]
MICROBATCHES = 2


def _spec(model: str, dotted: Dict, device: str):
    from tests.layout_for import job_spec
    from tests.parallel_harness.run_layouts import model_config

    mb = dotted.get("trainer.micro_batch_size", 1)
    return job_spec(model_config(model), 1, **{"precision.name": "bf16", "trainer.global_batch_size": MICROBATCHES * mb,
                                               "trainer.device": device, **dotted})


def measure(mode: str, row: str, device: str) -> Dict[str, int]:
    """One measurement of row `row`: mode real (on `device`), fake (rehearsal) or plan."""
    import torch

    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.plan.decide.resolve import resolve

    name, model, dotted = next(r for r in ROWS if r[0] == row)
    spec = _spec(model, dotted, device)
    optim, opts = OptimConfig(lr=3e-4, warmup_steps=1), EngineOptions(total_steps=10, seed=7)
    if mode == "plan":
        from launcher.plan.estimate.memory import category_maxima
        from launcher.plan.present.plan import build_plan
        from launcher.plan.decide.resolve import check

        mem = build_plan(spec, check(spec)).memory
        detail = mem.get("detail", {})
        # The planner's reserve (CUDA context, NCCL) and fragmentation are not allocations.
        unallocated = int(detail.get("reserved", 0)) + int(detail.get("allocator_fragmentation", 0))
        # Categories at their own maxima, as measured (the plan's are what exists at its peak).
        maxima = category_maxima(mem)
        return {**{k: maxima[k] for k in ("params", "grads", "optimizer", "activations")},
                "peak": int(mem["total"]) - unallocated}
    layout = resolve(spec)
    if mode == "fake":
        from launcher.rehearse.rank import rehearse_rank

        got = rehearse_rank(spec.model, optim, layout, opts, 0, activations=True,
                            fake_microbatches=MICROBATCHES)["memory"]
        return {k: int(got[k]) for k in ("params", "grads", "optimizer", "activations", "peak")}
    from launcher.rehearse.real import rehearse_real_rank

    torch.manual_seed(0)
    got = rehearse_real_rank(spec.model, optim, layout, opts, 0, device=device, warmup_steps=1, timed_steps=1,
                             microbatches=MICROBATCHES)
    out = {k: int(got["memory"][k]) for k in ("params", "grads", "optimizer", "activations", "peak")}
    if device == "cuda":
        out["cuda_max_allocated"] = int(got["real"]["peak_allocated"])
    return out


def _run_one(mode: str, row: str, device: str) -> Dict:
    proc = subprocess.run([sys.executable, __file__, "--one", mode, row, device], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"failed": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _err(got, ref) -> str:
    if got is None or not ref:
        return "-"
    return f"{(got - ref) / ref:+.1%}"


def main(argv: List[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        print(json.dumps(measure(*argv[1:4])))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the first rows with the real side on the CPU")
    p.add_argument("--rows", default="all", help="comma-separated row names (default all)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark compares against a GPU. Fix: run it on a GPU "
                         "machine, or --smoke to check the harness on the CPU.")
    rows = SMOKE_ROWS if args.smoke else ROWS
    if args.rows != "all":
        wanted = [r.strip() for r in args.rows.split(",")]
        rows = tuple(r for r in ROWS if r[0] in wanted)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    print(f"rehearse_gpu {_dt.date.today().isoformat()} real on {where}, torch {torch.__version__}")
    print("| row | activations GPU (tracked) / rehearsal / plan | peak GPU (tracked) / GPU allocator / "
          "rehearsal / plan | rehearsal vs GPU: activations, peak | plan vs GPU: activations, peak |")
    print("|---|---|---|---|---|")
    results = []
    for name, _, _ in rows:
        got = {mode: _run_one(mode, name, device) for mode in ("real", "fake", "plan")}
        results.append({"row": name, **got})
        if any("failed" in v for v in got.values()):
            print(f"| {name} | failed: {json.dumps({k: v['failed'] for k, v in got.items() if 'failed' in v})} |||| ",
                  flush=True)
            continue
        real, fake, plan = got["real"], got["fake"], got["plan"]
        print(f"| {name} | {_mib(real['activations'])} / {_mib(fake['activations'])} / {_mib(plan['activations'])} "
              f"| {_mib(real['peak'])} / {_mib(real.get('cuda_max_allocated'))} / {_mib(fake['peak'])} / "
              f"{_mib(plan['peak'])} | {_err(fake['activations'], real['activations'])}, "
              f"{_err(fake['peak'], real['peak'])} | {_err(plan['activations'], real['activations'])}, "
              f"{_err(plan['peak'], real['peak'])} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
