"""Optimizer step time of Muon vs AdamW on the same layout, measured and predicted.

    .venv/bin/python bench/muon.py [--ranks 4] [--model debug_moe] [--rounds 5] [--steps 5]

Starts itself under torchrun (gloo on CPU; FSDP2 over `--ranks` ranks, EP 2 for a MoE model), and
on every rank builds the native engine twice from the same Layout: optim=adamw and optim=muon.
After one real training step (the states exist), both optimizers step the same random gradients in
alternating rounds, so that machine load hits both alike; a side's time is the median over rounds
of the round's wall time / its steps (rank 0's clock; the steps are collective).

The prediction uses the formulas the engine uses (`launcher/plan/estimate/muon.py`: Newton-Schulz
FLOPs per matrix, owners balanced over the ranks) with this CPU's rates measured here: a bf16
matmul's FLOP/s and an fp32 elementwise pass's bytes/s. AdamW's step reads and writes about 4
fp32 tensors per parameter (p, g, m, v); Muon's elementwise part 3 (p, g, buf) plus the busiest
rank's Newton-Schulz and the exchange of its matrices' shards with their owners (bf16, each matrix
to its owner and back: (N-1)/N x T/N bytes received per rank for T fp32 bytes of Muon matrices,
at the measured elementwise rate: gloo on one machine copies memory). It also prints the bytes
each rank received in Muon's exchange, measured, beside what an all-gather of the updates plus a
reduce-scatter of the results (the algorithm before the exchange) would have received. The planner proper does not price Muon yet
(docs/optimizers.md, "Not built yet"), and these terms leave out per-tensor dispatch and
collective latency, which dominate on the debug models (measured on 2 loaded cores, debug_moe,
4 ranks, 3 runs: ratio 3.2, 3.6, 1.4, predicted 12-83 as the measured rates swing with the load;
11.0, 10.0, 12.6 before Muon's exchange replaced the all-gather: the prediction is not yet useful
at this size).
The last line is `muon/adamw step time ratio R (predicted P)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _measure_rates(torch) -> tuple:
    """(bf16 matmul FLOP/s, fp32 elementwise bytes/s) of this rank's CPU thread."""
    a = torch.randn(128, 384).bfloat16()
    t0 = time.perf_counter()
    for _ in range(20):
        (a @ a.T) @ a
    flops = 20 * (2 * 128 * 128 * 384 * 2) / (time.perf_counter() - t0)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    t0 = time.perf_counter()
    for _ in range(20):
        x.lerp_(y, 0.1)
    bw = 20 * 3 * 4 * (1 << 20) / (time.perf_counter() - t0)
    return flops, bw


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from launcher.config.loader import compose_spec
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.models.param_list import trainable_parameters
    from launcher.plan.decide.optim_groups import assign_groups
    from launcher.plan.decide.resolve import resolve
    from launcher.plan.estimate.params import model_shape, stage_params
    from launcher.plan.estimate.perf import knee, muon_step_s, optimizer_update_s

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    moe = args.model != "debug"
    over = ["+recipe=debug", f"model={args.model}", f"cluster.gpus_per_node={world}", "trainer.device=cpu",
            "precision=fp32", f"parallel.dp_shard={world}", "trainer.global_batch_size=8", "trainer.micro_batch_size=1",
            "trainer.seq_len=16", "parallel.ep=2" if moe else "parallel.ep=1"]
    engines, layouts = {}, {}
    for name in ("adamw", "muon"):
        spec = compose_spec(over + [f"optim={name}"])
        layouts[name] = resolve(spec)
        engines[name] = NativeEngine(spec.model, spec.optim, layouts[name], torch.device("cpu"),
                                     EngineOptions(total_steps=100, grad_clip=1.0, seed=0))
    vocab = spec.model.vocab_size
    g = torch.Generator().manual_seed(rank)
    per = 8 // world
    mbs = [(torch.randint(0, vocab, (1, 16), generator=g), torch.randint(0, vocab, (1, 16), generator=g))
           for _ in range(per)]
    for e in engines.values():
        e.train_step(mbs)  # creates the optimizer states
        for part in e.parts:
            for p in part.parameters():
                p.grad = torch.randn_like(p) * 1e-3
    times = {k: [] for k in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                for opt in e.optimizers:
                    opt.step()
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
    # The prediction: the planner's optimizer update time (launcher/plan/estimate/perf.py
    # optimizer_update_s: AdamW's and Muon's elementwise bytes, Newton-Schulz on the busiest owner,
    # the gathers to the owners) on this CPU as the planner's hardware, from the rates measured here.
    flops_rate, bw = _measure_rates(torch)
    hw = dataclasses.replace(spec.hardware, bf16_tflops=flops_rate / knee(128, 384) / 1e12, achievable_fraction=1.0,
                             hbm_gbps=bw / 0.7 / 1e9, nvlink_gbps=bw / 1e9, network_gbps=bw / 1e9, comm_efficiency=1.0)
    stage = stage_params(model_shape(spec.model), 1)[0]
    predicted = {name: optimizer_update_s(stage, lay, hw) for name, lay in layouts.items()}
    muon_parts = muon_step_s(stage, layouts["muon"], hw)
    a = assign_groups(trainable_parameters(spec.model), spec.optim)
    numel = {"muon": 0, "adamw": 0}
    for _, shape, gi in a.members:
        numel[a.groups[gi].optimizer] += math.prod(shape)
    moved = [0, 0]  # this rank's (received in the exchange, an all-gather + reduce-scatter's)
    for opt in engines["muon"].optimizers:
        got, allgather = getattr(opt, "exchange_bytes", (0, 0))
        moved[0] += got
        moved[1] += allgather
    per_rank = [None] * world
    dist.all_gather_object(per_rank, moved)
    if rank == 0:
        m, w = statistics.median(times["muon"]), statistics.median(times["adamw"])
        print(f"model {args.model}, {world} ranks (FSDP2{' x EP 2' if moe else ''}), {muon_parts['matrices']} Muon "
              f"matrices, {numel['muon']:,} Muon / {numel['adamw']:,} AdamW parameters")
        print(f"adamw step {w * 1e3:.1f} ms, muon step {m * 1e3:.1f} ms (medians of {args.rounds} rounds x {args.steps} steps)")
        print(f"rates: bf16 matmul {flops_rate / 1e9:.1f} GFLOP/s, elementwise {bw / 1e9:.1f} GB/s per rank")
        print(f"planner: adamw {predicted['adamw'] * 1e3:.2f} ms, muon {predicted['muon'] * 1e3:.2f} ms (Newton-Schulz "
              f"{muon_parts['ns_s'] * 1e3:.2f} ms, busiest owner {muon_parts['ns_imbalance']:.2f}x the mean; gather/scatter "
              f"{muon_parts['gather_scatter_s'] * 1e3:.2f} ms; elementwise {muon_parts['elementwise_s'] * 1e3:.2f} ms)")
        print(f"muon exchange, received per rank and step: {max(r[0] for r in per_rank) / 1e3:.1f} kB at most "
              f"(an all-gather + reduce-scatter of the same updates: {max(r[1] for r in per_rank) / 1e3:.1f} kB)")
        print(f"muon/adamw step time ratio {m / w:.2f} (predicted {predicted['muon'] / predicted['adamw']:.2f})")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--model", default="debug_moe")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return 0
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           __file__, "--ranks", str(args.ranks), "--model", args.model, "--rounds", str(args.rounds),
           "--steps", str(args.steps)]
    return subprocess.call(cmd, env=env, cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
