"""Training time blocked per checkpoint save: synchronous vs `checkpoint.async=true`, in one run.

    .venv/bin/python bench/checkpoint_blocking.py [--ranks 2] [--rounds 3] [--steps 6]

Starts itself under torchrun (`--nproc_per_node=--ranks`, gloo on CPU), then on every rank
builds the engine `train` builds (`launcher.runtime.entry.engine_for_rank`, FSDP2 over all ranks)
and two CheckpointManagers on separate folders, one synchronous and one asynchronous. It times
rounds of `--steps` training steps (`Engine.train_step`) of three kinds, alternating so that a
change in machine load hits all alike:

- none: the steps alone (the baseline);
- sync: a synchronous `CheckpointManager.save` before the steps;
- async: an asynchronous save before the steps, and `wait()` for its completion after them
  (so a write longer than the round is counted as blocking, as the next save would wait for it).

Blocked time per save of a kind = median round time of that kind - median round time of `none`:
the save's blocking part plus whatever the background write takes from the steps running
beside it (on a 2-core CPU machine the write competes with training for the cores). The last
line is `blocking ratio R`, R = async blocked time / sync blocked time (lower is better).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from bench.torchrun_workers import end_worker, run_workers  # noqa: E402

KINDS = ("none", "sync", "async")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per kind")
    p.add_argument("--steps", type=int, default=6, help="training steps per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the rounds")
    p.add_argument("--model", default="debug", help="conf/model entry")
    p.add_argument("--dim", type=int, default=256, help="model.dim override (0: the entry's)")
    p.add_argument("--layers", type=int, default=8, help="model.n_layers override (0: the entry's)")
    p.add_argument("--vocab", type=int, default=4096, help="model.vocab_size override (0: the entry's)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def compose(args: argparse.Namespace):
    """The JobConfig `train` would build for this model: FSDP2 over every rank, constant LR."""
    from launcher.config.loader import compose_spec

    model = [f"model.dim={args.dim}", f"model.ffn_dim={3 * args.dim}"] if args.dim else []
    model += [f"model.n_layers={args.layers}"] if args.layers else []
    model += [f"model.vocab_size={args.vocab}"] if args.vocab else []
    total = args.warmup + args.rounds * len(KINDS) * args.steps
    return compose_spec([
        f"model={args.model}", *model,
        f"precision={'fp32' if args.device == 'cpu' else 'bf16'}",
        f"trainer.device={args.device}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={args.micro_batch * args.ranks}",
        f"trainer.steps={total}",
        "cluster.nodes=1",
        f"cluster.gpus_per_node={args.ranks}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "checkpoint.keep=1",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
    ])


def worker(args: argparse.Namespace) -> None:
    import torch

    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime import entry
    from launcher.checkpoint.manager import CheckpointManager
    from launcher.runtime.dist import init_distributed
    from launcher.parallel.phase import init_phase_group

    rank = init_distributed(args.device, timeout_s=600)
    init_phase_group(1800)
    run_dir = args.out.parent / "run"
    spec = compose(args)
    plan = build_plan(spec, check(spec))
    torch.manual_seed(spec.trainer.seed)
    batches = entry.build_batches(spec, plan, rank.rank, run_dir)
    engine = entry.engine_for_rank(spec, plan, rank, run_dir)
    managers = {
        kind: CheckpointManager(run_dir / f"checkpoints_{kind}", keep=1, verify_checksums=True, rank=rank.rank,
                                world_size=rank.world_size, async_save=kind == "async", async_timeout_s=1800)
        for kind in ("sync", "async")
    }
    state = {"world_size": rank.world_size}
    step = 0

    def sync_device() -> None:
        if rank.device.type == "cuda":
            torch.cuda.synchronize()

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            step += 1
            engine.train_step(batches.for_step(step))

    def round_of(kind: str) -> tuple:
        """(round wall time, time inside save())."""
        sync_device()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        in_save = 0.0
        if kind != "none":
            t1 = time.perf_counter()
            managers[kind].save(step, engine, dict(state, step=step))
            in_save = time.perf_counter() - t1
        train(args.steps)
        if kind == "async":
            managers[kind].wait()
        sync_device()
        return time.perf_counter() - t0, in_save

    train(args.warmup)
    times = {k: [] for k in KINDS}
    calls = {k: [] for k in KINDS}
    for r in range(args.rounds):
        for kind in KINDS[r % 3:] + KINDS[:r % 3]:  # rotate the order: load drift is shared
            wall, in_save = round_of(kind)
            times[kind].append(wall)
            calls[kind].append(in_save)
    median = {k: statistics.median(v) for k, v in times.items()}
    blocked = {k: median[k] - median["none"] for k in ("sync", "async")}
    if rank.rank == 0:
        ckpt = run_dir / "checkpoints_sync"
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
        result = {
            "ranks": rank.world_size, "device": rank.device.type, "model": args.model, "dim": args.dim,
            "layers": args.layers, "vocab": args.vocab, "steps_per_round": args.steps, "rounds": args.rounds,
            "checkpoint_bytes": size, "round_s": times, "save_call_s": calls, "median_round_s": median,
            "blocked_sync_s": blocked["sync"], "blocked_async_s": blocked["async"],
            "ratio": blocked["async"] / blocked["sync"] if blocked["sync"] > 0 else float("nan"),
            "load_avg": os.getloadavg()[0],
        }
        args.out.write_text(json.dumps(result, indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        end_worker()
    r = run_workers(__file__, args.ranks, list(argv if argv is not None else sys.argv[1:]), prefix="checkpoint_blocking_")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    med = r["median_round_s"]
    print(f"{r['ranks']} ranks on {r['device']}, model {r['model']} (dim {r['dim']}, layers {r['layers']}, vocab "
          f"{r['vocab']}), checkpoint {r['checkpoint_bytes'] / 2**20:.1f} MiB, {r['rounds']} rounds x "
          f"{r['steps_per_round']} steps per kind, load average {r['load_avg']:.2f}")
    print(f"median round: none {med['none']:.3f} s  sync {med['sync']:.3f} s  async {med['async']:.3f} s")
    print(f"inside save(): sync {statistics.median(r['save_call_s']['sync']):.3f} s  "
          f"async {statistics.median(r['save_call_s']['async']):.3f} s")
    print(f"blocked per save: sync {r['blocked_sync_s']:.3f} s  async {r['blocked_async_s']:.3f} s")
    print(f"blocking ratio {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
