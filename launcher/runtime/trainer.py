"""The training loop: data -> engine step -> metrics -> checkpoints -> stop requests.

The loop knows nothing about how a step is computed (that is the Engine's job) and nothing
about the parallel layout beyond which slice of the global batch this rank loads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.data.dataset import StepBatches
from launcher.data.prefetch import Prefetcher, should_pin
from launcher.plan.estimate.flops import achieved_tflops, mfu
from launcher.checkpoint.manager import CheckpointManager, rng_state
from launcher.checkpoint.local_tier import LocalTier
from launcher.engines.base import Engine
from launcher.runtime.metrics import MetricsLogger
from launcher.resilience.health import RunHealth
from launcher.runtime.heldout_loss import Validator
from launcher.eval.loop import DownstreamEval
from launcher.observe.profiler import StepProfiler
from launcher.resilience.stragglers import StragglerMonitor
from launcher.observe.moe_health import MoEHealth
from launcher.observe.moe_load import with_aux_loss_names
from launcher.observe.goodput import GoodputClock, as_summary, metrics as goodput_metrics, summary_line
from launcher.observe.run_score import RunScore
from launcher.resilience.restarts import RestartReport
from launcher.runtime.signals import StopWatcher
from launcher.resilience.failure import StopWithoutCheckpoint
from launcher.runtime.stop_control import write_stopped
from launcher.resilience.debug_hooks import before_step as debug_before_step
from launcher.resilience.debug_hooks import hold_after_step as debug_hold_after_step
from launcher.runtime.numerics import NumericalHealth, SpikeDetector

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    """The narrow view of the job the loop needs."""

    steps: int
    log_every: int
    checkpoint_interval: int  # 0: no periodic saves
    checkpoint_enabled: bool
    save_final: bool
    tokens_per_step: int
    samples_per_step: int
    world_size: int
    mesh: Dict[str, int]
    flops_per_token: float = 0.0  # model FLOPs (launcher.plan.estimate.flops) for TFLOP/s and MFU
    peak_tflops_per_gpu: float = 0.0  # 0: no MFU (e.g. on CPU, where no peak is meaningful)
    # Measure peak memory per category on the second step of this run (the first allocates
    # optimizer states) and record it next to the plan's prediction.
    track_memory: bool = False
    predicted_memory: Optional[Dict[str, Any]] = None
    device_type: str = "cpu"
    val_every: int = 0  # validation loss every N steps (0: off); needs a Validator
    local_interval: int = 0  # steps between node-local saves (checkpoint.local_dir; 0: off)


@dataclass
class LoopResult:
    last_step: int
    stopped_early: bool
    stop_reason: Optional[str] = None


class Trainer:
    def __init__(
        self,
        cfg: LoopConfig,
        *,
        run_dir: Path,
        rank: int,
        engine: Engine,
        batches: StepBatches,
        checkpoints: CheckpointManager,
        metrics: MetricsLogger,
        stop: StopWatcher,
        start_step: int = 0,
        health: Optional[RunHealth] = None,
        validator: Optional[Validator] = None,
        profiler: Optional[StepProfiler] = None,
        stragglers: Optional[StragglerMonitor] = None,
        moe_health: Optional[MoEHealth] = None,
        score: Optional[RunScore] = None,
        restart_report: Optional[RestartReport] = None,
        local_tier: Optional[LocalTier] = None,
        numerics: Optional[NumericalHealth] = None,
        spikes: Optional[SpikeDetector] = None,
        rewinds_applied: int = 0,
        goodput: Optional[GoodputClock] = None,
        downstream: Optional[DownstreamEval] = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.engine = engine
        self.batches = batches
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.stop = stop
        self.start_step = start_step
        self.health = health
        self.validator = validator
        self.profiler = profiler
        self.stragglers = stragglers
        self.moe_health = moe_health
        self.score = score  # measured vs planned: plan/* metrics and run_summary.json
        self.restart_report = restart_report  # resilience/* metrics after an in-job restart
        self._reported_save = None  # the (step, path) last given to health.saved
        self.local_tier = local_tier  # checkpoint.local_dir: the node-local tier (None: off)
        self.numerics = numerics  # skipped non-finite steps: health/skipped_steps, trainer.max_skipped_steps
        self.spikes = spikes  # health/loss_spike (trainer.spike_zscore > 0)
        self.rewinds_applied = rewinds_applied  # the run's rewinds this timeline includes (trainer.json)
        self.goodput = goodput  # rank 0: where the wall time goes (goodput/* metrics)
        self.downstream = downstream  # eval.tasks every eval.every steps: eval/<task>/<metric>

    def _trainer_state(self, step: int) -> Dict[str, Any]:
        skipped = getattr(self.batches, "skipped", 0)  # global batches skipped by rewinds (trainer.on_spike)
        return {
            "step": step,
            # The data position: batches trained plus batches skipped.
            "samples_consumed": (step + skipped) * self.cfg.samples_per_step,
            "tokens_seen": step * self.cfg.tokens_per_step,
            "batches_skipped": skipped,
            "rewinds_applied": self.rewinds_applied,
            "world_size": self.cfg.world_size,
            "mesh": self.cfg.mesh,
            **self._data_state(step),
        }

    def _data_state(self, step: int) -> Dict[str, Any]:
        """Each mixture source's read position after `step` (launcher/data/mixture.py)."""
        state = getattr(self.batches, "checkpoint_state", lambda _: None)(step)
        return {"data": state} if state else {}

    def _data_metrics(self, step: int, stats) -> Dict[str, float]:
        """data/<name>/tokens (consumed so far) and loss/<name> (this step's per-source loss)."""
        out = dict(getattr(self.batches, "step_metrics", lambda _: {})(step))
        names = getattr(self.batches, "names", [])
        for index, loss in (getattr(stats, "source_loss", None) or {}).items():
            if 0 <= int(index) < len(names):
                out[f"loss/{names[int(index)]}"] = loss
        return out

    def _save(self, step: int) -> None:
        if not self.cfg.checkpoint_enabled:
            return
        if self.health is None:
            self.checkpoints.save(step, self.engine, self._trainer_state(step))
            return
        with self.health.phase("checkpoint save"):
            self.checkpoints.save(step, self.engine, self._trainer_state(step))
        self._note_saved()

    def _save_local(self, step: int) -> None:
        """The node-local tier's save of `step` (collective: the replica goes to the next node)."""
        if self.health is None:
            self.local_tier.save(step, self.engine, self._trainer_state(step), rng_state())
            return
        with self.health.phase("checkpoint save"):
            self.local_tier.save(step, self.engine, self._trainer_state(step), rng_state())

    def _note_saved(self, wait: bool = False) -> None:
        """Name the newest complete checkpoint to the failure summary. checkpoint.async: a save
        completes in the background (poll, no collective); wait=True blocks until it has (a stop
        and the end of the run must not leave a half-written checkpoint behind)."""
        if not self.cfg.checkpoint_enabled:
            return
        if self.checkpoints.async_save:
            if wait and self.health is not None:
                with self.health.phase("checkpoint save"):
                    self.checkpoints.wait()
            elif wait:
                self.checkpoints.wait()
            else:
                self.checkpoints.poll()
        published = self.checkpoints.published
        if self.health is not None and published is not None and published != self._reported_save:
            self.health.saved(*published)
            self._reported_save = published

    def _tracked_step(self, microbatches):
        """One training step under the memory tracker; returns its stats and predicted-vs-measured."""
        # lazy: torch.distributed._tools imports inductor (about 0.5 s per rank), for trainer.track_memory only
        from launcher.observe.memtrack import compare_with_plan, process_peak_rss_bytes, track_step_memory

        result = {}
        measured = track_step_memory(
            getattr(self.engine, "model_parts", []),
            getattr(self.engine, "optimizers", []),
            lambda: result.setdefault("stats", self.engine.train_step(microbatches)),
            warmup_steps=0,
        )
        row = compare_with_plan(measured, self.cfg.predicted_memory or {}, self.cfg.device_type)
        rss = process_peak_rss_bytes()
        if rss is not None:
            row["mem_process_peak_rss"] = rss
        log.info(
            "memory (rank %d): measured total %.1f MiB vs predicted %.1f MiB",
            self.rank, row["mem_total_measured"] / 2**20, row["mem_total_predicted"] / 2**20,
        )
        self.metrics.summary({"memory_measured_vs_predicted": row})
        return result["stats"], row

    def _validate(self, step: int) -> Dict[str, float]:
        """val_loss / val_ppl at every val_every-th step (a long phase for the hang watchdog)."""
        if self.validator is None or not self.cfg.val_every or step % self.cfg.val_every:
            return {}
        if self.health is None:
            return self.validator.run()
        with self.health.phase("validation"):
            return self.validator.run()

    def _evaluate(self, step: int) -> Dict[str, float]:
        """eval/<task>/<metric> at every eval.every-th step (a long phase for the hang watchdog)."""
        if self.downstream is None or not self.downstream.due(step):
            return {}
        if self.health is None:
            return self.downstream.run()
        with self.health.phase("downstream evaluation"):
            return self.downstream.run()

    def fit(self) -> LoopResult:
        cfg = self.cfg
        if self.start_step >= cfg.steps:
            log.info("nothing to do: resumed at step %d of %d", self.start_step, cfg.steps)
            return LoopResult(last_step=self.start_step, stopped_early=False)
        loader = Prefetcher(self.batches, self.start_step + 1, cfg.steps, pin=should_pin(cfg.device_type))
        if self.goodput is not None:
            self.goodput.loop_started()
        try:
            return self._loop(loader)
        finally:
            loader.close()

    def _loop(self, loader: Prefetcher) -> LoopResult:
        cfg = self.cfg
        step = self.start_step
        last_saved = self.start_step
        # Step time is measured over the steps since the last log, ended by reading the step's
        # stats (which waits for the device): the other steps never wait for it. Validation and
        # checkpoint saves inside the window are timed apart and left out.
        window_start, window_steps, set_apart = time.perf_counter(), 0, 0.0
        for step in range(self.start_step + 1, cfg.steps + 1):
            t_step = time.perf_counter()
            eval_s = save_s = 0.0  # this iteration's validation and checkpoint time (goodput)
            microbatches, data_wait_ms = loader.get(step)
            memory_row: Dict[str, Any] = {}
            debug_before_step(self.rank, step, step + getattr(self.batches, "skipped", 0))
            if self.profiler is not None:
                self.profiler.before_step(step)
            if self.stragglers is not None:
                self.stragglers.step_started()
            if cfg.track_memory and step == self.start_step + 2:
                stats, memory_row = self._tracked_step(microbatches)
            else:
                stats = self.engine.train_step(microbatches)
            window_steps += 1
            if self.numerics is not None:  # raises after trainer.max_skipped_steps skips in a row
                self.numerics.observe(step, getattr(stats, "skipped", None))
            if self.stragglers is not None:
                self.stragglers.step_finished()
            if self.profiler is not None:
                self.profiler.after_step(step)
            if self.health is not None:
                self.health.step_done(step)
            t_val = time.perf_counter()
            val_row = self._validate(step)
            val_row.update(self._evaluate(step))
            if val_row:
                eval_s = time.perf_counter() - t_val
                set_apart += eval_s
            logged = step % cfg.log_every == 0 or step == cfg.steps or step == 1 or bool(val_row)
            if logged:
                loss = stats.loss  # waits for the device: every step of the window is done
                if self.goodput is not None:  # the step's compute ends with that wait
                    self.goodput.step_done(time.perf_counter() - t_step, data_wait_ms / 1000.0, eval_s)
                elapsed = max(time.perf_counter() - window_start - set_apart, 1e-9) / window_steps
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": stats.lr,
                    "grad_norm": stats.grad_norm,
                    "tokens_per_s": cfg.tokens_per_step / elapsed,
                    "step_time_s": elapsed,
                    "tokens_seen": step * cfg.tokens_per_step,
                    "data_wait_ms": data_wait_ms,
                }
                if cfg.flops_per_token:
                    per_gpu = record["tokens_per_s"] / cfg.world_size
                    record["tflops_per_gpu"] = achieved_tflops(per_gpu, cfg.flops_per_token)
                    if cfg.peak_tflops_per_gpu:
                        record["mfu"] = mfu(per_gpu, cfg.flops_per_token, cfg.peak_tflops_per_gpu)
                record.update(stats.extra)
                if self.numerics is not None:
                    record.update(self.numerics.metrics())
                if self.spikes is not None:
                    record.update(self.spikes.observe(step, loss))
                record.update(self._data_metrics(step, stats))
                record.update(memory_row)
                record.update(val_row)
                if self.restart_report is not None:  # once: the first logged step after a restart
                    record.update(self.restart_report.metrics())
                if self.stragglers is not None:  # collective: every rank logs at the same steps
                    record.update(self.stragglers.observe(step))
                if self.moe_health is not None:  # collective too
                    record.update(self.moe_health.observe(step))
                if self.score is not None:
                    record.update(self.score.observe(record))
                if self.goodput is not None:
                    record.update(goodput_metrics(self.goodput.record(step)))
                self.metrics.log(with_aux_loss_names(record))
                if self.spikes is not None:  # trainer.on_spike=rewind: ends the attempt (kind "spike")
                    self.spikes.rewind_if_spiked()
                window_start, window_steps, set_apart = time.perf_counter(), 0, 0.0
            elif memory_row:
                self.metrics.log(dict(memory_row, step=step), console=False)
            saved_shared = bool(cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)
            if saved_shared:
                t_save = time.perf_counter()
                self._save(step)
                save_s += time.perf_counter() - t_save
                last_saved = step
            elif self.checkpoints.async_save:
                self._note_saved()
            # A synchronous shared save of this step is already as new as a local one could be.
            if (self.local_tier is not None and cfg.local_interval and step % cfg.local_interval == 0
                    and step < cfg.steps and not (saved_shared and not self.checkpoints.async_save)):
                t_save = time.perf_counter()
                self._save_local(step)
                save_s += time.perf_counter() - t_save
            set_apart += save_s
            if self.goodput is not None:
                if not logged:
                    self.goodput.step_done(time.perf_counter() - t_step - save_s, data_wait_ms / 1000.0, eval_s)
                self.goodput.add("checkpoint", save_s)
                if saved_shared:
                    self.goodput.saved(step)
            debug_hold_after_step(self.rank, step, self.stop.local_request)
            if step < cfg.steps and self.stop.should_stop():
                reason = self.stop.local_request() or "stop requested on another rank"
                if not cfg.checkpoint_enabled:
                    # No checkpoint means no resume: do not ask for a requeue that restarts at 0.
                    raise StopWithoutCheckpoint(
                        f"stop requested at step {step} ({reason}) but checkpoint.enabled=false: the work "
                        f"cannot be saved. Fix: enable checkpoints to survive preemption."
                    )
                log.warning("stopping at step %d (%s): saving a checkpoint", step, reason)
                t_save = time.perf_counter()
                if last_saved != step:
                    self._save(step)
                self._note_saved(wait=True)
                self._goodput_final_save(step, time.perf_counter() - t_save)
                if self.rank == 0:
                    write_stopped(self.run_dir, step, reason)
                self._score()
                return LoopResult(last_step=step, stopped_early=True, stop_reason=reason)
        if self.stragglers is not None and self.rank == 0:
            self.metrics.summary(self.stragglers.summary())
        t_save = time.perf_counter()
        if cfg.save_final and last_saved != step:
            self._save(step)
        self._note_saved(wait=True)
        self._goodput_final_save(step, time.perf_counter() - t_save)
        self._score()
        return LoopResult(last_step=step, stopped_early=False)

    def _goodput_final_save(self, step: int, seconds: float) -> None:
        """The last save (and the wait for an async one) is checkpoint time; the attempt's file
        gets its final record (the executor completes the accounting after the ranks exit)."""
        if self.goodput is None:
            return
        self.goodput.add("checkpoint", seconds)
        if self.cfg.checkpoint_enabled:
            self.goodput.saved(step)
        accounting = self.goodput.record(step)
        log.info("%s", summary_line(accounting))
        if self.score is not None:  # run_summary.json (`train` completes it after the ranks exit)
            self.score.extra["goodput"] = as_summary(accounting)

    def _score(self) -> None:
        """run_summary.json (a collective: every rank gives its peak memory)."""
        if self.score is not None:
            path = self.score.finish()
            if path is not None:
                log.info("measured vs planned: %s", path)
