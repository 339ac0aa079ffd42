"""Rank entry point: `python -m launcher.runtime.entry --run-dir DIR`, started by torchrun.

Reads the resolved config and plan.json the launcher wrote, then: dist init -> engine
(model on meta, parallelisms per the plan's Layout) -> resume -> train loop -> final
checkpoint -> export -> clean shutdown. The Layout's decisions are obeyed, never re-made
here: nothing below reads spec.parallel (or re-derives a degree); the engines get the
Layout plus the narrow options it does not cover (launcher/engines/base.py EngineOptions).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import traceback
from dataclasses import asdict
from typing import Any, List, Optional
from pathlib import Path

import torch
import torch.distributed as dist

from launcher.config.loader import load_spec
from launcher.engines import build_engine
from launcher.engines.base import Engine, EngineOptions
from launcher.config.schema import JobConfig
from launcher.data.dataset import BatchSlice, StepBatches, data_step_batches, load_token_arrays
from launcher.hf.weights import tokenizer_files_for
from launcher.plan.estimate.flops import peak_tflops, training_flops_per_token
from launcher.parallel.phase import init_phase_group, phase_barrier, phase_timeout_s
from launcher.plan.present.plan import Plan
from launcher.checkpoint.manager import CheckpointManager, lock_for_run, set_rng_state
from launcher.checkpoint.folder import checkpoint_root, step_of
from launcher.checkpoint.local_tier import LocalTier
from launcher.resilience.failure import FAILURE_DIR, FailureBundle, NodeBlamed, NonFiniteSteps, host_name
from launcher.resilience.health import RunHealth
from launcher.observe.memory_snapshot import MemorySnapshot
from launcher.runtime.dist import RankInfo, exit_after_shutdown, init_distributed, resolve_device_type
from launcher.runtime.matmul_precision import apply_matmul_precision
from launcher.runtime.metrics import MetricsLogger, WandbStart
from launcher import PROCESS_STARTED
from launcher.observe.goodput import GoodputClock, launch_time
from launcher.runtime.numerics import NumericalHealth, SpikeDetector
from launcher.runtime.rewind import apply_on_rank0, latest_rewind, rewind_start
from launcher.runtime.signals import StopWatcher
from launcher.runtime.trainer import LoopConfig, Trainer
from launcher.runtime.heldout_loss import Validator
from launcher.eval.build import build_downstream_eval
from launcher.observe.profiler import StepProfiler, default_profile_ranks
from launcher.resilience.stragglers import StragglerMonitor, gather_hosts
from launcher.resilience.preflight import run_preflight
from launcher.observe.moe_health import MoEHealth
from launcher.observe.run_score import RunScore, environment
from launcher.resilience.restarts import RestartReport
from launcher.job_env import job_facts
from launcher.resilience import debug_hooks
from launcher.data.heldout import load_val_token_arrays
from launcher.resilience.watchdog import HangWatchdog, flight_recorder_env, resolve_hang_timeout
from launcher.plan.present.plots import save_plan_plots
from launcher.observe.rehearsal_table import rehearsal_table
from launcher.runtime.export_action import export_checkpoint

log = logging.getLogger("launcher")


def setup_logging(run_dir: Path, rank: int, level: str) -> None:
    """Every rank logs to logs/rank_<r>.log; rank 0 also to the console."""
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(level)
    file_handler = logging.FileHandler(logs / f"rank_{rank}.log")
    file_handler.setFormatter(fmt)
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
        root.addHandler(console)


def engine_options(spec: JobConfig, run_dir: Path) -> EngineOptions:
    """The narrow settings an engine needs besides the model, optimizer config and Layout."""
    return EngineOptions(
        total_steps=spec.trainer.steps,
        grad_clip=spec.trainer.grad_clip,
        seed=spec.trainer.seed,
        compile=spec.trainer.compile,
        work_dir=Path(run_dir),
        export_dtype=spec.checkpoint.export_dtype,
        export_tokenizer_files=tuple(tokenizer_files_for(spec.data.tokenizer if spec.data.source == "text" else "",
                                                         spec.model.init_from)),
        n_sources=len(spec.data.mix),  # per-source loss sums ride on the step's loss all-reduce
    )


def engine_for_rank(spec: JobConfig, plan: Plan, rank: RankInfo, run_dir: Path) -> Engine:
    """This rank's engine for the job: launcher.engines.build_engine over the plan's Layout, on the
    rank's device, with the options the config gives (engine_options)."""
    return build_engine(spec.model, spec.optim, plan.layout, rank.device, engine_options(spec, run_dir))


def record_built(engine: Engine, plan: Plan, rank: int, run_dir: Path) -> None:
    """Write what this rank's engine built (logs/built_rank_<r>.json) next to plan.json's layout,
    so a test or a user can check the plan was obeyed."""
    built = getattr(engine, "built", None)
    if built is None:
        return
    path = Path(run_dir) / "logs" / f"built_rank_{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(built(), indent=1, sort_keys=True))


def build_local_tier(spec: JobConfig, plan: Plan, rank: RankInfo, run_dir: Path) -> Optional[LocalTier]:
    """checkpoint.local_dir's node-local tier for this rank (None when off)."""
    if not (spec.checkpoint.enabled and spec.checkpoint.local_dir):
        return None
    return LocalTier(spec.checkpoint.local_dir, run_dir, host_name(), rank=rank.rank, world_size=rank.world_size,
                     ranks_per_node=plan.gpus_per_node, mesh=plan.mesh.to_dict(), device=rank.device)


def log_placement(plan: Plan, rank: RankInfo) -> None:
    """One line per rank: which node (SLURM's node name; several dev-cluster nodes share one
    hostname), which node-local rank and torchrun agent, and the rank's mesh coordinates, so a
    multi-node run can be checked from its logs (e.g. that each TP group stays inside a node)."""
    log.info(
        "placement: rank %d local_rank %d node %s host %s torchrun_pid %d coords %s",
        rank.rank, rank.local_rank, host_name(), socket.gethostname(), os.getppid(),
        json.dumps(plan.layout.mesh.coordinates(rank.rank), sort_keys=True),
    )


def data_parallel_rank(plan: Plan, rank: int) -> int:
    mesh = plan.layout.mesh
    coords = mesh.coordinates(rank)
    return coords["dp_replicate"] * mesh.dp_shard + coords["dp_shard"]


def step_batches_from(spec: JobConfig, plan: Plan, rank: int, run_dir: Path, validation: bool = False) -> StepBatches:
    """This rank's step batches of the training data (validation=True: the held-out data)."""
    cache_dir = Path(run_dir) / "data_cache"
    if spec.data.source == "text":
        # Tokenize once (rank 0) into the cache; the other ranks then map the same shard.
        if rank == 0:
            load = load_val_token_arrays if validation else load_token_arrays
            load(spec.data, cache_dir)
        phase_barrier()  # rank 0 may tokenize for long: not bounded by the collective timeout
    lay = plan.layout
    part = BatchSlice(
        dp_rank=data_parallel_rank(plan, rank),
        dp_size=lay.mesh.dp,
        micro_batch_size=lay.batch.micro_batch_size,
        grad_accum_steps=lay.batch.microbatches,
    )
    return data_step_batches(spec.data, seq_len=spec.trainer.seq_len, seed=spec.trainer.seed,
                             global_batch_size=lay.global_batch_size, part=part,
                             vocab_size=spec.model.vocab_size, cache_dir=cache_dir, validation=validation)


def build_batches(spec: JobConfig, plan: Plan, rank: int, run_dir: Path) -> StepBatches:
    """The training data of this rank."""
    return step_batches_from(spec, plan, rank, run_dir)


def build_validator(spec: JobConfig, plan: Plan, rank: int, run_dir: Path, engine: Engine) -> Optional[Validator]:
    """Fixed held-out batches for trainer.val_every (None when validation is off)."""
    if spec.trainer.val_every <= 0:
        return None
    source = step_batches_from(spec, plan, rank, run_dir, validation=True)
    return Validator.from_step_batches(engine, source, spec.trainer.val_steps)


def resume_data(batches: StepBatches, state: dict, rank: int) -> None:
    """Continue each mixture source from its checkpointed read position; warn (rank 0) when the
    mix differs from the checkpoint's (other weights: a new stage of the run, allowed)."""
    notes = batches.resume(int(state["step"]), state.get("data"), int(state.get("batches_skipped", 0)))
    if notes and rank == 0:
        log.warning("the data mix differs from the checkpoint's: %s. The new weights hold from step %d on "
                    "(each source continues from its stored read position).", "; ".join(notes), int(state["step"]) + 1)


def build_profiler(spec: JobConfig, plan: Plan, rank: RankInfo, run_dir: Path,
                   metrics: MetricsLogger) -> Optional[StepProfiler]:
    """The step profiler on the ranks profile.ranks names (default: rank 0 and the last pipeline rank)."""
    cfg = spec.profile
    if not cfg.enabled:
        return None
    ranks = list(cfg.ranks) or default_profile_ranks(plan.layout.mesh)
    if rank.rank not in ranks:
        return None
    return StepProfiler(run_dir, rank.rank, cfg.steps, rank.device.type, record_memory=cfg.record_memory,
                        with_stack=cfg.with_stack, on_trace=lambda path: metrics.save_file(path))


def build_stragglers(spec: JobConfig, plan: Plan, rank: RankInfo, metrics: MetricsLogger) -> Optional[StragglerMonitor]:
    """Per-log-step spread of busy time over ranks (off with one rank or trainer.straggler_factor=0);
    whether a straggler's node is excluded is the plan's decision (Layout.resilience)."""
    if spec.trainer.straggler_factor <= 0 or rank.world_size < 2:
        return None
    t = spec.trainer
    return StragglerMonitor(rank.rank, gather_hosts(host_name()), t.straggler_factor, rank.device,
                            publish=metrics.summary if rank.rank == 0 else None, checks=t.straggler_checks,
                            exclude=plan.layout.resilience.exclude_stragglers)


def log_plan_plots(spec: JobConfig, plan: Plan, run_dir: Path, metrics: MetricsLogger) -> None:
    """The plan's memory and pipeline charts, as PNGs in the run dir and images in W&B."""
    if not spec.plan.plots:
        return
    try:
        paths = save_plan_plots(plan, spec, run_dir)
    except Exception as err:  # a chart must never stop training
        log.warning("could not draw the plan charts: %s", err)
        return
    metrics.log_images({f"plan/{Path(p).stem}": Path(p) for p in paths})


def log_rehearsal(run_dir: Path, metrics: MetricsLogger) -> None:
    """The rehearsal's per-rank comparison (trainer.rehearse=true wrote rehearsal.json before
    the launch) as a W&B table, and its verdict in the summary."""
    path = Path(run_dir) / "rehearsal.json"
    if not path.exists():
        return
    result = json.loads(path.read_text())
    columns, rows = rehearsal_table(result)
    metrics.log_table("rehearsal/ranks", columns, rows)
    metrics.summary({"rehearsal": {"ok": result["ok"], "ranks": len(result["ranks"]),
                                   "world_size": result["world_size"]}})


def check_same_data_position(state: dict, plan: Plan) -> None:
    """The data position is (step + batches skipped by rewinds) x global batch: a changed global
    batch would repeat or skip data."""
    consumed = state.get("samples_consumed")
    expected = (state["step"] + int(state.get("batches_skipped", 0))) * plan.batch.global_batch_size
    if consumed is not None and consumed != expected:
        raise ValueError(
            f"the checkpoint at step {state['step']} consumed {consumed} samples "
            f"(global batch {consumed // max(1, state['step'])}) but this run uses trainer.global_batch_size="
            f"{plan.batch.global_batch_size}, so resuming would repeat or skip data. Fix: resume with "
            f"trainer.global_batch_size={consumed // max(1, state['step'])}, or start a new run directory."
        )


def config_for_logging(spec: JobConfig) -> dict:
    """The resolved config for W&B, with values that may hold secrets (cluster.env, setup) redacted."""
    config = asdict(spec)
    cluster = config["cluster"]
    cluster["env"] = {name: "<redacted>" for name in cluster["env"]}
    cluster["setup"] = ["<redacted>" for _ in cluster["setup"]]
    return config


def warmup_steps(compile_model: bool) -> int:
    """The first steps of a start that compile kernels and warm caches (the hang watchdog's long
    phase, goodput's compile_warmup): one, two with trainer.compile."""
    return 2 if compile_model else 1


def _gather_objects(obj: Any) -> List[Any]:
    """Every rank's `obj`, by rank (one all_gather_object over the world; [obj] on one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def start_health(spec: JobConfig, plan: Plan, bundle: FailureBundle, device_type: str) -> RunHealth:
    """The failure bundle's progress tracking, plus the hang watchdog unless trainer.hang_timeout_s=0."""
    # The path only: failure/ is created when something is written there, so a run that ends well has none.
    memory = MemorySnapshot(Path(bundle.run_dir) / FAILURE_DIR, bundle.rank, spec.trainer.memory_snapshot_steps, device_type,
                            predicted=plan.memory).start()
    timeout = resolve_hang_timeout(spec.trainer.hang_timeout_s, (plan.time or {}).get("step_s", 0.0))
    if timeout is None:
        return RunHealth(bundle, memory=memory)
    # Compiled steps recompile on the second step too: both count as start-up.
    watchdog = HangWatchdog(bundle, timeout, warmup_steps=warmup_steps(spec.trainer.compile))
    return RunHealth(bundle, watchdog.start(), memory=memory)


def run(run_dir: Path, bundle: FailureBundle) -> int:
    spec = load_spec(run_dir)
    plan = Plan.load(run_dir)
    device_type = resolve_device_type(spec.trainer.device)
    for name, value in flight_recorder_env().items():  # read when the process groups are created
        os.environ.setdefault(name, value)
    # Single-rank phases (start-up, saves, tokenizing, export) wait with a longer timeout: the
    # ranks' starts (before the process group) and, after it, a group of their own.
    phase_s = phase_timeout_s(spec.cluster.collective_timeout_s, int((plan.checkpoint or {}).get("shutdown_timeout_s", 0)))
    rank = init_distributed(device_type, timeout_s=spec.cluster.collective_timeout_s,
                            cpu_collectives=plan.layout.fsdp_wraps and plan.layout.offload_to_cpu,
                            startup_timeout_s=phase_s)
    setup_logging(run_dir, rank.rank, spec.logging.level)
    init_phase_group(phase_s)
    if rank.world_size != plan.world_size:
        raise RuntimeError(
            f"started with {rank.world_size} ranks but the plan is for {plan.world_size}. "
            f"Fix: launch with cluster.nodes * cluster.gpus_per_node = {plan.world_size} ranks."
        )
    if spec.trainer.deterministic:
        # cuBLAS is deterministic only with a fixed workspace, read when its handle is made (at the
        # first matmul, after this); without it torch raises at that matmul on CUDA.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(spec.trainer.seed)
    apply_matmul_precision(plan.layout.numerics.precision, plan.layout.numerics.tf32, rank.device.type)
    log.info("rank %d/%d on %s (process group: backend %s), mesh %s", rank.rank, rank.world_size, rank.device,
             dist.get_backend(), plan.mesh.to_dict())
    health = start_health(spec, plan, bundle, rank.device.type)
    log_placement(plan, rank)
    if plan.layout.resilience.health_check:
        # Before anything is built or loaded: an unfit node is named before it costs the allocation.
        with health.phase("health check"):
            run_preflight(rank.device, rank.rank, rank.world_size, host_name(), spec.trainer.health_factor, run_dir,
                          restart=job_facts().in_job_restarts)
    # One job per checkpoint folder, checked before anything is built or written (rank 0 holds it).
    folder_lock = lock_for_run(checkpoint_root(spec.checkpoint.dir, run_dir), run_dir, rank.rank) if spec.checkpoint.enabled else None

    wandb_config = {**config_for_logging(spec), "environment": environment()}
    # Rank 0's W&B run starts now, beside the model build and the checkpoint load (WandbStart).
    wandb_start = WandbStart(spec.logging.wandb, run_dir, wandb_config) if rank.rank == 0 and spec.action != "export" else None
    engine = engine_for_rank(spec, plan, rank, run_dir)
    record_built(engine, plan, rank.rank, run_dir)
    debug_hooks.install_slow_compute(engine.model_parts, rank.rank)
    debug_hooks.install_nonfinite(engine.model_parts, rank.rank)
    debug_hooks.install_spike(engine.model_parts)
    if spec.action == "export":
        export_checkpoint(spec, engine, rank.rank, rank.world_size)
        if folder_lock is not None:
            folder_lock.release()
        return 0
    batches = build_batches(spec, plan, rank.rank, run_dir)
    checkpoints = CheckpointManager(
        checkpoint_root(spec.checkpoint.dir, run_dir),
        keep=spec.checkpoint.keep,
        verify_checksums=spec.checkpoint.verify_checksums,
        rank=rank.rank,
        world_size=rank.world_size,
        async_save=spec.checkpoint.saves_async,  # checkpoint.async: saves finish in the background
        async_timeout_s=phase_s,
    )
    start_step = 0
    restarts = job_facts().in_job_restarts
    local_tier = build_local_tier(spec, plan, rank, run_dir)
    tier, from_replica = "shared", []
    # After an in-job restart or a requeue (SLURM_RESTART_COUNT) the newest checkpoint is this run's
    # own progress: resume=none or an older PATH would throw it away (and set it aside) every time.
    resume = "auto" if restarts or job_facts().restart_count else spec.checkpoint.resume
    # trainer.on_spike=rewind: a rewind the newest checkpoint does not include yet starts from an
    # older checkpoint (rank 0 decides; launcher/runtime/rewind.py).
    rewound = None
    rewind = latest_rewind(run_dir) if resume == "auto" and spec.checkpoint.enabled else None
    if rewind is not None:  # the same on every rank: the decision was written before the ranks started
        root = checkpoint_root(spec.checkpoint.dir, run_dir)
        rewound = _gather_objects(rewind_start(root, rewind) if rank.rank == 0 else None)[0]
        if rewound is not None:
            if rank.rank == 0:
                apply_on_rank0(run_dir, root, rewound)
            resume = rewound.path or "none"
    loaded: dict = {}
    if resume != "none":
        path = checkpoints.select_resume(resume)
        restored = None
        if local_tier is not None and resume == "auto":
            with health.phase("resume"):
                restored = local_tier.restore(step_of(path) if path is not None else -1, engine)
        if restored is not None:
            state = loaded = restored["trainer"]
            set_rng_state(restored["rng"])
            checkpoints.start_step = start_step = int(state["step"])
            agreement = restored["agreement"]
            tier = "local"
            from_replica = sorted(r for r, src in agreement.sources.items() if src.replica)
            bundle.progress.last_step = start_step
            check_same_data_position(state, plan)
            resume_data(batches, state, rank.rank)
            source = agreement.sources[rank.rank]
            log.info("resumed from %s at step %d: the node-local tier (this rank's state: %s; newest shared "
                     "checkpoint: %s; ranks restored from their peer node's replica: %s)",
                     spec.checkpoint.local_dir, start_step,
                     f"{'the replica' if source.replica else 'its own file'} on the node of rank {source.holder}"
                     f"{' (this rank)' if source.holder == rank.rank else ', sent to this rank'}",
                     path or "none", from_replica or "none")
        elif path is not None:
            with health.phase("resume"):
                state = loaded = checkpoints.load(path, engine, spec.trainer.seed)
            health.saved(state["step"], path)
            start_step = state["step"]
            # The failure bundle's "last step" counts from here: a failure before the first step
            # after a resume is at this step (the in-job restart compares failures by step).
            bundle.progress.last_step = start_step
            check_same_data_position(state, plan)
            resume_data(batches, state, rank.rank)
            log.info("resumed from %s at step %d%s", path, start_step,
                     " (the shared tier)" if local_tier is not None else "")
        elif rank.rank == 0:
            log.info("no checkpoint to resume from in %s: starting at step 0", checkpoints.root)
    if local_tier is not None:
        local_tier.forget_newer(start_step)
    rewinds_applied = int(loaded.get("rewinds_applied", 0))
    if rewound is not None:
        batches.skip(rewound.skip)
        rewinds_applied = rewound.rewind.number
    restart_report = RestartReport(run_dir, restarts, rank.rank, host_name())
    restart_report.resumed_at(start_step, tier, from_replica)
    if restarts and rank.rank == 0:
        log.warning("in-job restart %d: resumed at step %d", restarts, start_step)

    metrics = MetricsLogger(
        run_dir,
        enabled=rank.rank == 0,
        wandb_cfg=spec.logging.wandb,
        config=wandb_config,
        total_steps=spec.trainer.steps,
        progress=spec.logging.progress,
        resume_step=start_step,
        wandb_start=wandb_start,
    )
    if rank.rank == 0:
        bundle.publishers.append(lambda summary: metrics.summary({"failure": summary}))
    if rank.rank == 0 and plan.memory:
        metrics.summary({"predicted": {"memory": plan.memory, "time": plan.time}})
        log_plan_plots(spec, plan, run_dir, metrics)
    if rank.rank == 0:
        log_rehearsal(run_dir, metrics)
    stop = StopWatcher(run_dir, rank.device).install()
    loop_cfg = LoopConfig(
        steps=spec.trainer.steps,
        log_every=spec.trainer.log_every,
        checkpoint_interval=spec.checkpoint.interval,
        checkpoint_enabled=spec.checkpoint.enabled,
        save_final=spec.checkpoint.save_final,
        tokens_per_step=plan.batch.tokens_per_step,
        samples_per_step=plan.batch.global_batch_size,
        world_size=rank.world_size,
        mesh=plan.mesh.to_dict(),
        flops_per_token=training_flops_per_token(spec.model, spec.trainer.seq_len),
        peak_tflops_per_gpu=peak_tflops(spec.hardware, plan.layout.numerics.precision) if rank.device.type == "cuda" else 0.0,
        track_memory=spec.trainer.track_memory,
        predicted_memory=plan.memory,
        device_type=rank.device.type,
        val_every=spec.trainer.val_every,
        local_interval=spec.checkpoint.local_interval if local_tier is not None else 0,
    )
    trainer = Trainer(
        loop_cfg, run_dir=run_dir, rank=rank.rank, engine=engine, batches=batches,
        checkpoints=checkpoints, metrics=metrics, stop=stop, start_step=start_step, health=health,
        validator=build_validator(spec, plan, rank.rank, run_dir, engine),
        profiler=build_profiler(spec, plan, rank, run_dir, metrics),
        stragglers=build_stragglers(spec, plan, rank, metrics),
        moe_health=MoEHealth(engine.model_parts, spec.model.n_layers, spec.model.n_experts, rank.rank, rank.device,
                             log_table=metrics.log_table) if spec.model.n_experts > 0 else None,
        score=RunScore(run_dir, plan.time, plan.memory, rank.world_size, rank.device.type, spec.hardware.name,
                       rank.rank),
        restart_report=restart_report,
        local_tier=local_tier,
        numerics=NumericalHealth(spec.trainer.max_skipped_steps, rank.rank, gather=_gather_objects),
        spikes=SpikeDetector(spec.trainer.spike_zscore, spec.trainer.spike_window, spec.trainer.on_spike,
                             spec.trainer.spike_skip_batches, spec.trainer.max_rewinds)
        if spec.trainer.spike_zscore > 0 else None,
        rewinds_applied=rewinds_applied,
        goodput=GoodputClock(run_dir, PROCESS_STARTED, start_step, warmup_steps(spec.trainer.compile),
                             new_launch=restarts == 0, launch=launch_time()) if rank.rank == 0 else None,
        downstream=build_downstream_eval(spec, plan.layout, data_parallel_rank(plan, rank.rank), engine),
    )
    try:
        result = trainer.fit()
        if not result.stopped_early and spec.checkpoint.export != "none":
            out = Path(run_dir) / "export"
            with health.phase("export"):
                engine.export(out, spec.checkpoint.export)
            log.info("exported the consolidated model to %s (%s)", out, spec.checkpoint.export)
    except Exception as err:
        # Recorded here, while W&B is still open (the finally below closes it).
        health.on_exception(err)
        bundle.record_exception(err, traceback.format_exc())
        raise
    finally:
        health.close()
        stop.uninstall()
        metrics.close()
    if result.stopped_early:
        log.info("stopped at step %d (%s); the same command resumes from %s", result.last_step, result.stop_reason,
                 checkpoints.root)
    else:
        log.info("finished %d steps", result.last_step)
    if folder_lock is not None:
        folder_lock.release()
    return 0


def main(argv=None) -> int:
    """Run this rank and return its exit code (0: finished or stopped with a checkpoint); a failed
    rank reports its error and ends the process with 1 here. The caller ends the process."""
    parser = argparse.ArgumentParser(description="launcher rank runtime (started by torchrun)")
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    bundle = FailureBundle(args.run_dir, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    try:
        code = run(args.run_dir, bundle)
    except Exception as err:
        # Surface the failing rank's error on stderr (the main log) and in its rank log, then fail
        # fast: gloo teardown can hang when peers are gone.
        rank = os.environ.get("RANK", "?")
        text = traceback.format_exc()
        logging.getLogger("launcher").error("rank %s failed:\n%s", rank, text)
        if isinstance(err, (ValueError, FileNotFoundError, NodeBlamed, NonFiniteSteps)) and "Fix:" in str(err):
            sys.stderr.write(f"[rank{rank}] {err}\n")  # a user error: the message is the whole story
        else:
            sys.stderr.write(f"[rank{rank}] FAILED:\n{text}")
        sys.stderr.flush()
        try:
            bundle.record_exception(err, text)
        except Exception as bundle_err:  # noqa: BLE001 - never hide the original failure
            sys.stderr.write(f"[rank{rank}] could not write the failure bundle: {bundle_err}\n")
        os._exit(1)
    return code


if __name__ == "__main__":
    exit_code = main()
    # A finished rank leaves without the interpreter's teardown: tearing torch down costs about
    # 0.8 s of CPU per rank (measured with torch, dynamo and the launcher imported: 3.2 s of
    # CPU for a bare import and normal exit, 2.4 s with os._exit) and can abort in gloo's
    # destructors. run() has closed W&B, waited for background checkpoint writes and released
    # the folder lock; logging.shutdown flushes the rank log, exit_after_shutdown the process
    # group and stdio.
    logging.shutdown()
    exit_after_shutdown(exit_code)
