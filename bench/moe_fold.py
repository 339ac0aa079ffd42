"""MoE block time under tensor parallelism: experts folded over TP vs replicated, in one run.

    .venv/bin/python bench/moe_fold.py [--tp 2] [--tokens 2048] [--reps 7]

Starts itself under torchrun (`--tp` ranks, gloo on CPU): the same world size for both. On every
rank it builds two copies of a 2-block MoE model (`debug_moe` widened: dim 256, 8 experts of
width 512, top-2, one shared expert), tensor-parallel over all ranks (no SP):

- folded: the runtime's layout (`Layout.experts_folded`): each TP rank routes its own 1/tp of the
  tokens, the experts spread over the TP ranks (ep = tp, all-to-all dispatch), the router and
  shared expert replicated with gradients summed over TP (docs/parallelism.md, "Expert folding");
- replicated: `apply_tensor_parallel(..., fold_experts=False)`, what the runtime did before:
  every TP rank runs the whole MoE on every token (experts whole on every rank).

It times forward + backward of the MoE block alone (`block.moe`) on a replicated [1, tokens, dim]
input, alternating the two so a change in machine load hits both alike, and prints the median
of each and `folded speed-up R` = replicated / folded (higher is better; about tp when the expert
GEMMs dominate, less the dispatch and the output all-gather).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from bench.torchrun_workers import end_worker, run_workers  # noqa: E402

WIDE = {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "moe_ffn_dim": 512, "n_experts": 8, "top_k": 2,
        "n_layers": 2, "n_dense_layers": 1, "max_seq_len": 8192}


def _model(tp_world, folded: bool, tp: int):
    """The widened debug_moe, TP over all ranks, folded or replicated, initialised (seed 0)."""
    import torch
    from omegaconf import OmegaConf

    from launcher.config.schema import ModelConfig
    from launcher.models import build_model
    from launcher.parallel.ep import apply_moe_parallel
    from launcher.parallel.tp import apply_tensor_parallel

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                              OmegaConf.load(REPO / "conf" / "model" / "debug_moe.yaml")))
    cfg = replace(cfg, **WIDE)
    with torch.device("meta"):
        model = build_model(cfg)
    apply_tensor_parallel(model, tp_world["tp"], sequence_parallel=False, loss_parallel=True, fold_experts=folded)
    if folded:  # as launcher/engines/native.py does for Layout.experts_folded, ep = tp
        apply_moe_parallel(model, tp_world, ep=tp, folded=True, fsdp=False)
    model.to_empty(device="cpu")
    model.init_weights(0, buffer_device=torch.device("cpu"))
    model.train()
    return model.layers["1"].moe


def worker(args) -> Optional[dict]:
    import torch
    import torch.distributed as dist

    from launcher.parallel.device_mesh import build_device_mesh
    from launcher.plan.degrees import MeshPlan

    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    world = build_device_mesh(MeshPlan(tp=tp, ep=tp), "cpu")
    moes = {"folded": _model(world, True, tp), "replicated": _model(world, False, tp)}
    x = torch.randn(1, args.tokens, WIDE["dim"], generator=torch.Generator().manual_seed(1))  # same on every rank
    times = {k: [] for k in moes}
    for rep in range(args.reps + 1):  # the first round warms up, untimed
        for kind, moe in moes.items():
            inp = x.clone().requires_grad_(True)
            dist.barrier()
            t0 = time.perf_counter()
            moe(inp).float().square().mean().backward()
            dist.barrier()
            if rep:
                times[kind].append(time.perf_counter() - t0)
            moe.zero_grad(set_to_none=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    rank = dist.get_rank()
    dist.destroy_process_group()
    if rank:
        return None
    return {"tp": tp, "tokens": args.tokens, "median_s": med, "speedup": med["replicated"] / med["folded"]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        result = worker(args)
        if args.out and result is not None:
            Path(args.out).write_text(json.dumps(result))
        end_worker()
    r = run_workers(__file__, args.tp, ["--tokens", str(args.tokens), "--reps", str(args.reps)], "moe_fold_")
    med = r["median_s"]
    print(f"MoE block forward+backward, tp={r['tp']}, {r['tokens']} tokens, CPU (gloo):")
    print(f"  folded     {med['folded'] * 1e3:8.1f} ms")
    print(f"  replicated {med['replicated'] * 1e3:8.1f} ms")
    print(f"folded speed-up {r['speedup']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
