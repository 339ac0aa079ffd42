"""Count FSDP2's all-gathers and reduce-scatters per optimizer step on 2 gloo ranks.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 \
    tests/accumulation_harness/count_collectives.py RESULTS.json
Rank 0 writes {"<zero_stage>_<accumulate_unsharded>_<micro-batches>": {"all_gather": n,
"reduce_scatter": n, "loss": ...}} for the debug model with dp_shard=2, ZeRO-2 and ZeRO-3,
accumulate_unsharded true/false, 2 and 4 micro-batches per step.

Counted by wrapping torch.distributed's all-gather / reduce-scatter entry points that FSDP2
calls (torch 2.13's CommDebugMode fails on this model: its module tracker raises IndexError in
a forward hook). The second step is counted (the first includes FSDP2's lazy initialisation).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.parallel_harness.run_layouts import model_config  # noqa: E402


def count(step_fn) -> dict:
    """All-gathers and reduce-scatters issued by step_fn(), counted at torch.distributed's
    entry points that FSDP2's collectives call (torch/distributed/fsdp/_fully_shard/
    _fsdp_collectives.py looks them up on the module at call time)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    names = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
             "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}
    originals = {}

    def counting(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapper

    for kind, fns in names.items():
        for fn in fns:
            if hasattr(dist, fn):
                originals[fn] = getattr(dist, fn)
                setattr(dist, fn, counting(kind, originals[fn]))
    try:
        step_fn()
    finally:
        for fn, orig in originals.items():
            setattr(dist, fn, orig)
    return counts


def run(zero_stage: int, unsharded: bool, micro: int) -> dict:
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from launcher.plan.decide.resolve import resolve
    from tests.layout_for import job_spec

    mcfg = model_config("debug")
    job = job_spec(mcfg, 2, **{"parallel.dp_shard": 2, "parallel.zero_stage": zero_stage,
                               "trainer.global_batch_size": 2 * micro,
                               "parallel.accumulate_unsharded": "true" if unsharded else "false"})
    layout = resolve(job)
    assert layout.batch.microbatches == micro and layout.memory.accumulate_unsharded == unsharded, layout
    engine = NativeEngine(mcfg, OptimConfig(lr=1e-3, warmup_steps=1), layout, torch.device("cpu"),
                          EngineOptions(total_steps=4, grad_clip=1.0, seed=7, compile=False))
    rank = dist.get_rank()
    batches = lambda step: [(x, y) for x, y in _split(step, mcfg.vocab_size, rank, micro)]  # noqa: E731
    engine.train_step(batches(0))
    losses = []
    counts = count(lambda: losses.append(engine.train_step(batches(1)).loss))
    return counts | {"loss": losses[0]}


def _split(step: int, vocab: int, rank: int, micro: int):
    """This rank's `micro` micro-batches of one sequence each (a fixed-size global batch of 2*micro)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = 2 * micro
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    seq = (start + stride * torch.arange(17)) % vocab
    x, y = seq[:, :-1], seq[:, 1:]
    mine = range(rank * micro, (rank + 1) * micro)
    return [(x[i:i + 1].contiguous(), y[i:i + 1].contiguous()) for i in mine]


def main() -> int:
    dist.init_process_group("gloo")
    results = {}
    for zero_stage in (2, 3):
        for unsharded in (True, False):
            for micro in (2, 4):
                results[f"zero{zero_stage}_{str(unsharded).lower()}_{micro}"] = run(zero_stage, unsharded, micro)
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
    from launcher.runtime.dist import exit_after_shutdown

    exit_after_shutdown()


if __name__ == "__main__":
    sys.exit(main())
