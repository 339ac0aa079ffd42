"""How long `action=rehearse` takes at the recipes' real world sizes, through the real `train` command.

    .venv/bin/python bench/rehearse_speed.py                 # every case, states and fake steps
    .venv/bin/python bench/rehearse_speed.py --only 70b --activations false

Targets (issue 12), wall time including interpreter start on our 2-core machines:
  train +recipe=llama70b action=rehearse                              (64 ranks)     < 3 min
  train +recipe=llama405b action=rehearse cluster.nodes=1024          (8,192 ranks)  < 5 min
Also: mixtral8x7b with expert parallelism (ep=8), and llama8b's DeepSpeed layouts: ZeRO-3,
ZeRO-1, ZeRO-2, ZeRO-2 with CPU optimizer offload, the pipeline engine (deepspeed.initialize on
the fake group; no fake step). Prints one line per case (wall
time, ranks rehearsed, ok, the process's peak RSS from /proc: the host memory stays bounded)
and exits 0. Not a test: timings depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("train"))

CASES = [
    ("70b", "llama70b, 64 ranks", ["+recipe=llama70b"]),
    ("405b", "llama405b, 8192 ranks", ["+recipe=llama405b", "cluster.nodes=1024", "trainer.global_batch_size=2048"]),
    ("mixtral", "mixtral8x7b, 32 ranks, ep=8", ["+recipe=mixtral8x7b"]),
    ("zero3", "llama8b DeepSpeed ZeRO-3, 8 ranks", ["+recipe=llama8b", "backend.sharding=deepspeed"]),
    ("zero1", "llama8b DeepSpeed ZeRO-1 (bf16: BF16_Optimizer), 8 ranks",
     ["+recipe=llama8b", "backend.sharding=deepspeed", "parallel.zero_stage=1"]),
    ("zero2", "llama8b DeepSpeed ZeRO-2, 8 ranks", ["+recipe=llama8b", "backend.sharding=deepspeed", "parallel.zero_stage=2"]),
    ("zero2_offload", "llama8b DeepSpeed ZeRO-2 + CPU optimizer offload, 8 ranks",
     ["+recipe=llama8b", "backend.sharding=deepspeed", "parallel.zero_stage=2", "offload=cpu",
      "backend.offload=deepspeed"]),
    ("ds_pipe", "llama8b DeepSpeed pipeline engine pp 2 x dp 4, ZeRO-1, 8 ranks",
     ["+recipe=llama8b", "backend=deepspeed", "parallel.zero_stage=1", "parallel.pp=2", "activation_checkpointing=full"]),
]


def run_case(args, activations: str, workers: int):
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [TRAIN, *args, "action=rehearse", "plan.format=json", f"rehearse.activations={activations}",
               f"rehearse.workers={workers}", f"hydra.run.dir={tmp}/run"]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        wall = time.time() - t0
        try:
            result = json.loads(proc.stdout[proc.stdout.index("{"):])
        except ValueError:
            result = None
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return wall, proc.returncode, result, peak_kib, proc.stderr.strip().splitlines()[-1:] if proc.returncode else []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case keys: " + ",".join(c[0] for c in CASES))
    ap.add_argument("--activations", default="true", choices=("true", "false"))
    ap.add_argument("--workers", type=int, default=2)
    opts = ap.parse_args()
    only = {k for k in opts.only.split(",") if k}
    print(f"| case | activations | wall s | ranks rehearsed | ok | largest child RSS MiB |")
    print("|---|---|---|---|---|---|")
    for key, label, args in CASES:
        if only and key not in only:
            continue
        wall, code, result, peak_kib, err = run_case(args, opts.activations, opts.workers)
        ranks = len(result["ranks"]) if result else 0
        ok = result["ok"] if result else False
        print(f"| {label} | {opts.activations} | {wall:.1f} | {ranks} | {ok} (exit {code}) | "
              f"{peak_kib / 1024:.0f} |" + (f" {err[0][:160]}" if err else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
