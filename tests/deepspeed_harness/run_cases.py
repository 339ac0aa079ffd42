"""Run several DeepSpeed configurations in ONE torchrun (start-up and JIT paid once).

    torchrun --standalone --nproc_per_node=2 tests/deepspeed_harness/run_cases.py \
        --work DIR --cases zero1,zero2,... [--resume zero3] [--native]

For each case: build the real DeepSpeedEngine from the composed spec and its plan, train
`trainer.steps` steps, export the consolidated fp32 model; with --resume CASE also save after
SAVE_AT steps, rebuild a fresh engine, load and continue; with --native also run the native
engine (FSDP2 ZeRO-3) on the same data; with --load-from CKPT --load-cases A,B build each case's
engine at this world size, load CKPT (another layout: converted to a universal checkpoint) and
train from SAVE_AT; with --eval-dir DIR --eval-case CASE that case's trained engine also runs the
downstream evaluation of the training loop (eval.tasks: DIR/tasks, tokenizer DIR/tokenizer) after
its export. Rank 0 writes DIR/results.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common import CASES, NATIVE_PIPELINE_MOE, SAVE_AT, SLOW_CASES, dsv3_bf16, rank_microbatches, spec_for  # noqa: E402

from launcher.runtime.dist import exit_after_shutdown  # noqa: E402


def dp_rank_of(plan, rank: int) -> int:
    c = plan.mesh.coordinates(rank)
    return c["dp_replicate"] * plan.mesh.dp_shard + c["dp_shard"]


def run_engine(engine, spec, plan, steps, start=0):
    out = []
    for step in range(start, steps):
        stats = engine.train_step(rank_microbatches(step, spec, plan, dp_rank_of(plan, dist.get_rank())))
        out.append({"loss": stats.loss, "grad_norm": stats.grad_norm, "lr": stats.lr, **stats.extra})
        biases = router_biases(engine)
        if biases:  # a DeepSeek-V3 router: where aux-loss-free balancing moved it this step
            out[-1]["biases"] = biases
    return out


def moe_health_for(engine, spec):
    """The runtime's MoE metrics over this engine's model parts (None for a dense model)."""
    if spec.model.n_experts == 0:
        return None
    from launcher.observe.moe_health import MoEHealth

    return MoEHealth(engine.model_parts, spec.model.n_layers, spec.model.n_experts, dist.get_rank(), torch.device("cpu"))


def router_biases(engine) -> dict:
    """{model name: (dtype, values)} of every MoE router's e_score_correction_bias on this rank."""
    from launcher.models.init import canonical_name

    return {canonical_name(n): (str(b.dtype), b.tolist()) for part in engine.model_parts
            for n, b in part.named_buffers() if n.endswith("e_score_correction_bias")}


def downstream_scores(engine, overrides, plan, eval_dir: Path) -> dict:
    """eval/<task>/<metric> of the loop's downstream evaluation (build_downstream_eval, as a rank of
    `train` builds it) on this engine's live model: the tasks of tests/eval_tasks.py (tiny_cloze's
    first context only: half the forward calls)."""
    from launcher.eval.build import build_downstream_eval
    from tests.eval_tasks import TASKS, one_context_limit

    limit = one_context_limit(spec_for(overrides).model.vocab_size)
    spec = spec_for([*overrides, f"eval.tasks=[{','.join(TASKS)}]", "eval.every=1", f"eval.limit={limit}",
                     f"eval.include_path=[{eval_dir / 'tasks'}]", f"eval.tokenizer={eval_dir / 'tokenizer'}"])
    evaluation = build_downstream_eval(spec, plan.layout, dp_rank_of(plan, dist.get_rank()), engine)
    return evaluation.run()


def run_case(name, overrides, work: Path, resume: bool, save_only: bool = False, eval_dir: Path = None):
    from launcher.engines.deepspeed import DeepSpeedEngine
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime.entry import engine_options

    run_dir = work / name
    spec = spec_for(overrides, run_dir)
    plan = build_plan(spec, check(spec))  # as `train` does: every rule, then the plan
    assert plan.backend("sharding") == "deepspeed", plan.backends["sharding"]

    def build():
        return DeepSpeedEngine(spec.model, spec.optim, plan.layout, torch.device("cpu"), engine_options(spec, run_dir))

    t0 = time.time()
    engine = build()
    result = {"build_s": time.time() - t0, "biases_built": router_biases(engine),
              "backends": {k: v.impl for k, v in plan.backends.items()},
              "layout": plan.to_dict()["layout"], "built": engine.built(),
              "memory_parts": len(engine.model_parts), "memory_optimizers": len(engine.optimizers)}
    # Each rank's ZeRO partition bytes, for the rehearsal's comparison
    # (tests/test_deepspeed_runtime.py: test_rehearsal_holds_the_real_*_partitions).
    from launcher.rehearse.rank import deepspeed_held_bytes

    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, deepspeed_held_bytes(engine.optimizers[0], plan.layout.memory.zero_stage))
    result["held_per_rank"] = per_rank
    steps = spec.trainer.steps
    health = moe_health_for(engine, spec)
    if resume:
        result["steps"] = run_engine(engine, spec, plan, SAVE_AT)
        engine.save(run_dir / "ckpt")
        result["steps"] += run_engine(engine, spec, plan, steps, SAVE_AT)
    else:
        result["steps"] = run_engine(engine, spec, plan, steps)
    # After real steps: the bytes of the states the optimizer inside DeepSpeed's wrapper
    # created (AdamW's exp_avg / exp_avg_sq of each fp32 master partition), which the
    # rehearsal can only infer from the masters' shapes.
    from launcher.observe.state_bytes import StateBytesProbe

    inner = StateBytesProbe(engine.optimizers)
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, {"states": inner.optimizer_state_bytes()})
    inner.remove()
    result["optimizer_after_steps_per_rank"] = states
    if health is not None:  # collective: the moe/* metrics of the whole run, as a log step sees them
        result["moe_metrics"] = health.observe(steps)
    if spec.offload.nvme_path and "nvme" in (spec.offload.optimizer, spec.offload.params):
        # Swap files exist while the engine lives (DeepSpeed removes them at teardown).
        files = [f for f in Path(spec.offload.nvme_path).rglob("*") if f.is_file()]
        result["nvme_bytes"] = sum(f.stat().st_size for f in files)
    if not save_only:
        engine.export(run_dir / "export" / "model.pt", "fp32")
        result["export"] = str(run_dir / "export" / "model.pt")
    if eval_dir is not None:  # on the exported weights (tests/test_deepspeed_runtime.py scores them with HFLM)
        t_eval = time.time()
        result["eval"] = downstream_scores(engine, overrides, plan, eval_dir)
        result["eval_s"] = time.time() - t_eval
    result["step_s"] = (time.time() - t0 - result["build_s"] - result.get("eval_s", 0.0)) / steps
    del engine
    gc.collect()
    if resume and not save_only:
        fresh = build()
        fresh.load(run_dir / "ckpt")
        result["resumed"] = run_engine(fresh, spec, plan, steps, SAVE_AT)
        del fresh
        gc.collect()
    return result


def run_loaded(name, overrides, work: Path, checkpoint: Path):
    """Build the case's engine at this world size, load `checkpoint` (saved at step SAVE_AT), continue."""
    from launcher.engines.deepspeed import DeepSpeedEngine
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime.entry import engine_options

    run_dir = work / f"loaded_{name}"
    spec = spec_for([*overrides, f"cluster.gpus_per_node={dist.get_world_size()}"], run_dir)
    plan = build_plan(spec, check(spec))
    engine = DeepSpeedEngine(spec.model, spec.optim, plan.layout, torch.device("cpu"), engine_options(spec, run_dir))
    engine.load(checkpoint)
    result = {"load": engine.last_load, "built": engine.built(),
              "resumed": run_engine(engine, spec, plan, spec.trainer.steps, SAVE_AT)}
    del engine
    gc.collect()
    return result


def run_native(work: Path, overrides=("parallel.zero_stage=3", "backend=native")):
    from launcher.engines.native import NativeEngine
    from launcher.plan.present.plan import build_plan
    from launcher.plan.decide.resolve import check
    from launcher.runtime.entry import engine_options

    spec = spec_for(list(overrides))
    plan = build_plan(spec, check(spec))
    engine = NativeEngine(spec.model, spec.optim, plan.layout, torch.device("cpu"), engine_options(spec, work))
    health = moe_health_for(engine, spec)
    biases_built = router_biases(engine)
    steps = run_engine(engine, spec, plan, spec.trainer.steps)
    result = {"steps": steps, "moe_metrics": health.observe(spec.trainer.steps) if health is not None else None,
              "biases_built": biases_built}
    del engine
    gc.collect()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--resume", default="")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--save-only", action="store_true", help="the --resume case saves, but neither reloads nor exports")
    parser.add_argument("--load-from", type=Path)
    parser.add_argument("--load-cases", default="")
    parser.add_argument("--eval-dir", type=Path, help="tasks/ and tokenizer/ of tests/eval_tasks.py")
    parser.add_argument("--eval-case", default="", help="the case whose trained engine runs the evaluation")
    parser.add_argument("--native-pipeline-moe", action="store_true", help="first, the native engine on debug_moe, pp=2")
    parser.add_argument("--bias-bf16", action="store_true",
                        help="last, DeepSeek-V3's router bias under bf16 ZeRO-3: DeepSpeed, then the native engine")
    args = parser.parse_args()
    from launcher.engines.deepspeed import init_deepspeed_distributed

    init_deepspeed_distributed("cpu")
    results = {}
    everything = {**CASES, **SLOW_CASES}
    if args.native_pipeline_moe:  # before any DeepSpeed pipeline engine sets its process-global topology
        results["native_pipeline_moe"] = run_native(args.work, NATIVE_PIPELINE_MOE)
    for name in [c for c in args.cases.split(",") if c]:
        results[name] = run_case(name, everything[name], args.work, resume=name == args.resume,
                                 save_only=args.save_only,
                                 eval_dir=args.eval_dir if name == args.eval_case else None)
        dist.barrier()
    for name in [c for c in args.load_cases.split(",") if c]:
        results[f"loaded_{name}"] = run_loaded(name, everything[name], args.work, args.load_from)
        dist.barrier()
    if args.native:
        results["native_zero3"] = run_native(args.work)
    if args.bias_bf16:
        results["bias_bf16_deepspeed"] = run_case("bias_bf16_deepspeed", dsv3_bf16("deepspeed"), args.work,
                                                  resume=False, save_only=True)
        results["bias_bf16_native"] = run_native(args.work, dsv3_bf16("native"))
    if dist.get_rank() == 0:
        (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    exit_after_shutdown(main())  # results written: skip the interpreter's teardown of torch and DeepSpeed
