"""The launcher's training step vs a bare hand-written PyTorch loop, same model and layout.

    .venv/bin/python bench/step_overhead.py [--ranks 2] [--rounds 4] [--steps 10] [--warmup 5] [--data-path]

Starts itself under torchrun (`--nproc_per_node=--ranks`, gloo on CPU, NCCL on GPUs), then on
every rank, in one process, trains two copies of the same model (same config, init, data and
optimizer settings) and times them in alternating rounds so that machine load hits both alike:

- bare: build_model + `fully_shard` per block and root (the Layout's FSDP2, ZeRO-3), AdamW,
  then for each step: forward, `F.cross_entropy`, backward, `clip_grad_norm_`, `opt.step()`,
  `zero_grad()`; the loss is read (`.item()`) only at log steps, as a hand-written loop would;
- launcher: the real `launcher.runtime.trainer.Trainer.fit` over the engine `train` builds
  (`entry.engine_for_rank`), with everything a real run does per step: token-count and loss
  all-reduces, metrics.jsonl + W&B (offline) rows at log steps, the straggler all-gather at log
  steps, the hang watchdog's heartbeat, the stop-request all-reduce, the failure bundle's progress;
- engine (reported beside the ratio, not in it): a third copy driven by `Engine.train_step` alone,
  which tells how much of the overhead is the engine's step and how much the loop around it.

Both take their micro-batches from the same `StepBatches` (data loading is not overhead). The
step time of a side is the median over its rounds of the round's wall time / its steps (rank 0's
clock; the steps are collective, so every rank waits for the slowest). The last line is `overhead ratio R`,
R = launcher step time / bare step time (target <= 1.03).

`--data-path` measures the cost of the real data path instead (issue 26): rank 0 writes a small
3-source indexed corpus (launcher.data.indexed shards + manifest, as `action=prepare` leaves them),
and every rank trains two copies of the launcher (the real `Trainer.fit` over the engine `train`
builds, same model, same init) with `data=indexed`, a 0.5/0.3/0.2 `data.mix`,
`data.document_masking=true` and `data.reset_positions=true`, in alternating rounds:

- indexed: the Trainer fed by the `StepBatches` of `launcher.data.dataset.data_step_batches`
  (memory-mapped shards, the mixture assignment, the on-the-fly window permutation, document ids
  and positions per row), loaded through the Trainer's background Prefetcher as in a real run;
- in-memory: the same Trainer fed the identical micro-batches (inputs, labels, positions, document
  ids, sources) and per-source token counts, computed before the rounds and kept in memory, so the
  attention mask, the per-source loss and the logged rows are the same and only the data path differs.

The last line is `data path ratio R`, R = indexed step time / in-memory step time (target <= 1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(REPO))

from bench.torchrun_workers import end_worker, run_workers  # noqa: E402


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (torchrun --nproc_per_node)")
    p.add_argument("--rounds", type=int, default=8, help="alternating timed rounds per side")
    p.add_argument("--steps", type=int, default=5, help="steps per round (a multiple of --log-every)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per side before the rounds")
    p.add_argument("--log-every", type=int, default=5, help="trainer.log_every of the launcher side")
    p.add_argument("--model", default="debug", help="conf/model entry")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step (no accumulation)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--data-path", action="store_true",
                   help="time the launcher on a 3-source indexed mix with document masking against the same "
                        "launcher on the same micro-batches held in memory (ratio target <= 1.02)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def compose(args: argparse.Namespace, run_dir: Path, data: Sequence[str] = ()):
    """The JobConfig `train` would build: dp_shard over every rank (FSDP2, ZeRO-3), fp32 on CPU;
    `data`: extra `data.*` overrides (--data-path)."""
    from launcher.config.loader import compose_spec

    return compose_spec([
        f"model={args.model}",
        f"precision={'fp32' if args.device == 'cpu' else 'bf16'}",
        f"trainer.device={args.device}",
        f"trainer.seq_len={args.seq_len}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={args.micro_batch * args.ranks}",
        f"trainer.steps={args.warmup + args.rounds * args.steps}",
        f"trainer.log_every={args.log_every}",
        "cluster.nodes=1",
        f"cluster.gpus_per_node={args.ranks}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",  # the bare loop then needs no scheduler
        "checkpoint.enabled=false",
        "checkpoint.interval=0",
        "logging.wandb.mode=offline",
        "logging.progress=false",
        *data,
    ])


# --data-path: three sources of the mix (name, weight, documents, seed).
SOURCES = (("web", 0.5, 3000, 1), ("code", 0.3, 2000, 2), ("math", 0.2, 1500, 3))


def write_mix_corpus(root: Path, vocab_size: int, seq_len: int) -> None:
    """Three indexed datasets (two shards each, manifest included) of random documents of 1/8 to
    3/4 of a sequence, so a packed row holds several documents."""
    from tests.indexed_corpus import random_documents, write_corpus  # the launcher's writer + a manifest

    for name, _, n_docs, seed in SOURCES:
        docs = random_documents(n_docs, min(vocab_size, 2**16), seed, low=max(2, seq_len // 8), high=seq_len * 3 // 4)
        write_corpus(root / name, [docs[: n_docs // 2], docs[n_docs // 2:]], tokenizer_sha256="bench")


def mix_overrides(root: Path) -> List[str]:
    """data=indexed over the corpus of write_mix_corpus, with document masking and position reset."""
    entries = ",".join(f"{{path:{root / name},weight:{weight},name:{name}}}" for name, weight, _, _ in SOURCES)
    return ["data=indexed", f"data.mix=[{entries}]", "data.document_masking=true", "data.reset_positions=true"]


class InMemoryBatches:
    """The micro-batches (and per-source token counts) of `source` for steps 1..steps, computed
    once and kept in memory: what the Trainer reads from it costs a dict lookup."""

    def __init__(self, source, steps: int):
        self.names = list(source.names)
        self._batches = {}
        self._metrics = {}
        # What the indexed side's loader does: the first step opens the shards, each later one reads.
        t0 = t1 = time.perf_counter()
        for step in range(1, steps + 1):
            self._batches[step] = source.for_step(step)
            self._metrics[step] = source.step_metrics(step)
            if step == 1:
                t1 = time.perf_counter()
        self.first_load_s = t1 - t0
        self.load_s_per_step = (time.perf_counter() - t1) / max(steps - 1, 1)

    def for_step(self, step: int):
        return self._batches[step]

    def step_metrics(self, step: int):
        return self._metrics[step]


def check_layout(plan, ranks: int) -> None:
    """The bare loop hand-codes this layout; refuse to compare against another one."""
    lay = plan.layout
    got = dict(dp=lay.mesh.dp, tp=lay.mesh.tp, pp=lay.mesh.pp, cp=lay.mesh.cp, microbatches=lay.batch.microbatches, zero=lay.memory.zero_stage,
               fsdp=lay.fsdp_wraps, ac=lay.memory.ac_mode, backend=lay.owners.sharding_backend, offload=lay.offload_to_cpu)
    want = dict(dp=ranks, tp=1, pp=1, cp=1, microbatches=1, zero=3, fsdp=ranks > 1, ac="none", backend="native",
                offload=False)
    if got != want:
        raise SystemExit(f"the plan's layout {got} is not the one the bare loop implements {want}")


def bare_loop(spec, rank, batches):
    """A hand-written FSDP2 training step on the same model: no launcher code after build_model."""
    import torch
    import torch.nn.functional as F
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from launcher.models import build_model

    with torch.device("meta"):
        model = build_model(spec.model)
    if rank.world_size > 1:
        mesh = init_device_mesh(rank.device.type, (rank.world_size,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.to_empty(device=rank.device)
    model.init_weights(seed=spec.trainer.seed, buffer_device=rank.device)
    model.train()
    o = spec.optim
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    params = list(model.parameters())
    losses = {}

    def run(first: int, last: int) -> None:
        for step in range(first, last + 1):
            for mb in batches.for_step(step):
                inputs, labels = mb.inputs, mb.labels
                logits = model(inputs.to(rank.device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.to(rank.device).flatten())
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, spec.trainer.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step % spec.trainer.log_every == 0:
                value = loss.detach()
                if dist.is_initialized():
                    dist.all_reduce(value)
                losses[step] = float(value) / rank.world_size

    return run, losses


def launcher_loop(spec, plan, rank, run_dir: Path, batches):
    """The real Trainer with the pieces launcher.runtime.entry.run gives it."""
    from launcher.runtime import entry
    from launcher.resilience.failure import FailureBundle
    from launcher.runtime.metrics import MetricsLogger
    from launcher.observe.moe_health import MoEHealth
    from launcher.checkpoint.manager import CheckpointManager
    from launcher.checkpoint.folder import checkpoint_root
    from launcher.runtime.signals import StopWatcher
    from launcher.runtime.trainer import LoopConfig, Trainer
    from launcher.plan.estimate.flops import training_flops_per_token

    bundle = FailureBundle(run_dir, rank.rank, rank.world_size)
    health = entry.start_health(spec, plan, bundle, rank.device.type)
    engine = entry.engine_for_rank(spec, plan, rank, run_dir)
    metrics = MetricsLogger(run_dir, enabled=rank.rank == 0, wandb_cfg=spec.logging.wandb,
                            config=entry.config_for_logging(spec), total_steps=spec.trainer.steps,
                            progress=spec.logging.progress)
    stop = StopWatcher(run_dir, rank.device).install()
    checkpoints = CheckpointManager(checkpoint_root(spec.checkpoint.dir, run_dir), keep=spec.checkpoint.keep,
                                    verify_checksums=spec.checkpoint.verify_checksums, rank=rank.rank,
                                    world_size=rank.world_size)
    stragglers = entry.build_stragglers(spec, plan, rank, metrics)
    moe = (MoEHealth(engine.model_parts, spec.model.n_layers, spec.model.n_experts, rank.rank, rank.device,
                     log_table=metrics.log_table) if spec.model.n_experts > 0 else None)
    losses = {}

    def run(first: int, last: int) -> None:
        cfg = LoopConfig(
            steps=last, log_every=spec.trainer.log_every, checkpoint_interval=0, checkpoint_enabled=False,
            save_final=False, tokens_per_step=plan.batch.tokens_per_step, samples_per_step=plan.batch.global_batch_size,
            world_size=rank.world_size, mesh=plan.mesh.to_dict(),
            flops_per_token=training_flops_per_token(spec.model, spec.trainer.seq_len), device_type=rank.device.type)
        trainer = Trainer(cfg, run_dir=run_dir, rank=rank.rank, engine=engine, batches=batches,
                          checkpoints=checkpoints, metrics=metrics, stop=stop, start_step=first - 1, health=health,
                          stragglers=stragglers, moe_health=moe)
        trainer.fit()

    def close() -> None:
        health.close()
        stop.uninstall()
        metrics.close()
        if rank.rank == 0:
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["step"] % spec.trainer.log_every == 0:
                    losses[row["step"]] = row["loss"]

    return run, losses, close


def engine_loop(spec, plan, rank, run_dir: Path, batches):
    """A third copy: the launcher's engine alone (Engine.train_step per step, no Trainer around it),
    which splits the overhead into the engine's part and the loop's part."""
    from launcher.runtime import entry

    engine = entry.engine_for_rank(spec, plan, rank, run_dir / "engine_only")

    def run(first: int, last: int) -> None:
        for step in range(first, last + 1):
            engine.train_step(batches.for_step(step))

    return run


def timer(rank):
    """fn(first, last) -> its wall time, started together on every rank (steps are collective)."""
    import torch

    def timed(fn, first: int, last: int) -> float:
        if rank.device.type == "cuda":
            torch.cuda.synchronize()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        fn(first, last)
        if rank.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return timed


def alternate(sides: dict, timed, args: argparse.Namespace) -> dict:
    """--warmup untimed steps per side, then --rounds rounds of --steps steps per side, the side that
    goes first rotating so that a drift in machine load is shared; returns each side's round times."""
    for fn in sides.values():
        fn(1, args.warmup)
    times: dict = {name: [] for name in sides}
    order = list(sides)
    for r in range(args.rounds):
        first = args.warmup + r * args.steps + 1
        last = first + args.steps - 1
        k = r % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(timed(sides[name], first, last))
    return times


def data_path_worker(args: argparse.Namespace) -> None:
    """--data-path: the launcher on a 3-source indexed mix with document masking vs the same
    launcher on the same micro-batches held in memory."""
    import torch
    import torch.distributed as dist

    from launcher.config.loader import compose_spec
    from launcher.parallel.phase import init_phase_group
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime import entry
    from launcher.runtime.dist import init_distributed

    rank = init_distributed(args.device, timeout_s=600)
    init_phase_group(1800)
    root = args.out.parent
    vocab = compose_spec([f"model={args.model}"]).model.vocab_size
    corpus = root / "corpus"
    if rank.rank == 0:
        write_mix_corpus(corpus, vocab, args.seq_len)
    dist.barrier()
    spec = compose(args, root / "indexed", mix_overrides(corpus))
    plan = build_plan(spec, check(spec))
    check_layout(plan, rank.world_size)
    torch.manual_seed(spec.trainer.seed)
    indexed = entry.build_batches(spec, plan, rank.rank, root / "indexed")
    # A second StepBatches of the same spec, read to the end before the rounds.
    in_memory = InMemoryBatches(entry.build_batches(spec, plan, rank.rank, root / "in_memory"), spec.trainer.steps)
    run_a, losses_a, close_a = launcher_loop(spec, plan, rank, root / "indexed", indexed)
    run_b, losses_b, close_b = launcher_loop(spec, plan, rank, root / "in_memory", in_memory)
    times = alternate({"indexed": run_a, "in_memory": run_b}, timer(rank), args)
    close_b()
    close_a()
    step_a = statistics.median(times["indexed"]) / args.steps
    step_b = statistics.median(times["in_memory"]) / args.steps
    if rank.rank == 0:
        common = sorted(set(losses_a) & set(losses_b))
        mb = in_memory.for_step(1)[0]
        docs = [len(torch.unique(row)) for row in mb.document_ids]
        result = {
            "mode": "data_path", "ranks": rank.world_size, "device": rank.device.type, "model": args.model,
            "seq_len": args.seq_len, "micro_batch": args.micro_batch, "log_every": args.log_every,
            "timed_steps": args.rounds * args.steps, "sources": [[n, w] for n, w, _, _ in SOURCES],
            "documents_per_row_step1": docs,
            "indexed_step_s": step_a, "in_memory_step_s": step_b, "ratio": step_a / step_b,
            "first_load_s": in_memory.first_load_s, "load_s_per_step": in_memory.load_s_per_step,
            # The median of the per-round ratios (the two sides' rounds run back to back).
            "paired_ratio": statistics.median(a / b for a, b in zip(times["indexed"], times["in_memory"])),
            "indexed_round_s": times["indexed"], "in_memory_round_s": times["in_memory"],
            "loss_step": common[-1] if common else None,
            "indexed_loss": losses_a[common[-1]] if common else None,
            "in_memory_loss": losses_b[common[-1]] if common else None,
            "load_avg": os.getloadavg()[0],
        }
        args.out.write_text(json.dumps(result, indent=1))


def worker(args: argparse.Namespace) -> None:
    import torch

    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime import entry
    from launcher.runtime.dist import init_distributed

    rank = init_distributed(args.device, timeout_s=600)
    from launcher.parallel.phase import init_phase_group

    init_phase_group(1800)  # as entry.run: the stop agreement and checkpoint waits use it
    run_dir = args.out.parent / "run"
    spec = compose(args, run_dir)
    plan = build_plan(spec, check(spec))
    check_layout(plan, rank.world_size)
    torch.manual_seed(spec.trainer.seed)
    batches = entry.build_batches(spec, plan, rank.rank, run_dir)
    bare, bare_losses = bare_loop(spec, rank, batches)
    launcher, launcher_losses, close = launcher_loop(spec, plan, rank, run_dir, batches)
    engine_only = engine_loop(spec, plan, rank, run_dir, batches)

    times = alternate({"bare": bare, "launcher": launcher, "engine": engine_only}, timer(rank), args)
    close()
    t_bare, t_launcher = times["bare"], times["launcher"]
    engine_step = statistics.median(times["engine"]) / args.steps
    n = args.rounds * args.steps
    # Step time of a side: the median over its rounds (a load spike from another process on a
    # shared machine then moves one round, not the result).
    bare_step, launcher_step = statistics.median(t_bare) / args.steps, statistics.median(t_launcher) / args.steps
    if rank.rank == 0:
        common = sorted(set(bare_losses) & set(launcher_losses))
        result = {
            "ranks": rank.world_size, "device": rank.device.type, "model": args.model, "seq_len": args.seq_len,
            "micro_batch": args.micro_batch, "log_every": args.log_every, "timed_steps": n,
            "bare_step_s": bare_step, "launcher_step_s": launcher_step, "ratio": launcher_step / bare_step,
            "engine_step_s": engine_step,
            "bare_round_s": t_bare, "launcher_round_s": t_launcher, "engine_round_s": times["engine"],
            "loss_step": common[-1] if common else None,
            "bare_loss": bare_losses[common[-1]] if common else None,
            "launcher_loss": launcher_losses[common[-1]] if common else None,
            "load_avg": os.getloadavg()[0],
        }
        args.out.write_text(json.dumps(result, indent=1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        (data_path_worker if args.data_path else worker)(args)
        end_worker()
    if args.steps % args.log_every:
        raise SystemExit(f"--steps {args.steps} must be a multiple of --log-every {args.log_every}")
    r = run_workers(__file__, args.ranks, list(argv if argv is not None else sys.argv[1:]), prefix="step_overhead_")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    print(f"{r['ranks']} ranks on {r['device']}, model {r['model']}, seq {r['seq_len']}, micro-batch {r['micro_batch']}, "
          f"log_every {r['log_every']}, {r['timed_steps']} timed steps per side, load average {r['load_avg']:.2f}")
    if args.data_path:
        print("data=indexed, mix " + " ".join(f"{n}:{w}" for n, w in r["sources"]) + ", document masking + position "
              f"reset ({'/'.join(map(str, r['documents_per_row_step1']))} documents per row at step 1)")
        print(f"loss at step {r['loss_step']}: indexed {r['indexed_loss']:.4f}  in-memory {r['in_memory_loss']:.4f}")
        print(f"loading on the indexed side (in the background): first step {r['first_load_s'] * 1e3:.1f} ms "
              f"(opens the shards), then {r['load_s_per_step'] * 1e3:.2f} ms per step = "
              f"{r['load_s_per_step'] / r['in_memory_step_s'] * 100:.1f} % of the in-memory step")
        print(f"indexed step {r['indexed_step_s'] * 1e3:.1f} ms  in-memory step {r['in_memory_step_s'] * 1e3:.1f} ms  "
              f"(median of the per-round ratios {r['paired_ratio']:.3f})")
        print(f"data path ratio {r['ratio']:.3f}")
        return 0
    print(f"loss at step {r['loss_step']}: bare {r['bare_loss']:.4f}  launcher {r['launcher_loss']:.4f}")
    print(f"bare step {r['bare_step_s'] * 1e3:.1f} ms  launcher step {r['launcher_step_s'] * 1e3:.1f} ms  "
          f"(engine alone {r['engine_step_s'] * 1e3:.1f} ms: engine / bare {r['engine_step_s'] / r['bare_step_s']:.3f})")
    print(f"overhead ratio {r['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
