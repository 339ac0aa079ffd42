"""Which saved checkpoints get a per-checkpoint evaluation job (eval.job, eval.job_every).

The one rule, read by `action=plan`'s line and by both submitters (launcher/launch/eval_submit.py):
a checkpoint at step s is due when s is a multiple of checkpoint.interval x eval.job_every (the
k-th periodic save), and the run's last step (trainer.steps, the final save) always is. A save
at another step (a stop or a requeue's save) is not evaluated.
"""

from __future__ import annotations

from typing import List

from launcher.config.schema import JobConfig


def eval_jobs_on(spec: JobConfig) -> bool:
    """Per-checkpoint evaluation jobs are asked for (eval.job with eval.on_checkpoint tasks)."""
    return bool(spec.eval.job and spec.eval.on_checkpoint and spec.checkpoint.enabled)


def eval_job_period(spec: JobConfig) -> int:
    """Steps between evaluated checkpoints (0: only the last step's)."""
    return max(0, spec.checkpoint.interval) * max(1, spec.eval.job_every)


def eval_job_due(spec: JobConfig, step: int) -> bool:
    """Whether the checkpoint saved at `step` gets an evaluation job."""
    if not eval_jobs_on(spec) or step <= 0:
        return False
    period = eval_job_period(spec)
    return step == spec.trainer.steps or (period > 0 and step % period == 0)


def eval_job_steps(spec: JobConfig) -> List[int]:
    """The steps whose checkpoints a run to trainer.steps evaluates, in order."""
    if not eval_jobs_on(spec):
        return []
    return [s for s in range(1, spec.trainer.steps + 1) if eval_job_due(spec, s)]


def eval_jobs_line(spec: JobConfig, executor: str) -> str:
    """action=plan's one line on the jobs ('' when off). They run off the training allocation:
    the plan does not cost them."""
    steps = eval_job_steps(spec)
    if not steps:
        return ""
    how = ("a one-node SLURM job (slurm/eval.sh.j2) per checkpoint, submitted as it is saved" if executor == "slurm"
           else "a subprocess per checkpoint on this machine after training ends")
    shown = ", ".join(str(s) for s in steps[:6]) + (f", ... ({len(steps)} in all)" if len(steps) > 6 else "")
    line = (f"Evaluation jobs (eval.job): {', '.join(spec.eval.on_checkpoint)} on the HF export "
            f"({spec.checkpoint.export_dtype}) of the checkpoints of steps {shown}: {how}; results in eval.jsonl "
            f"(not in the step time or budget: they run off the training allocation)")
    saved = saved_steps(spec)
    kept = saved[-max(1, spec.checkpoint.keep):]
    lost = [s for s in steps if s in saved and s not in kept]
    if executor != "slurm" and lost:
        needed = len(saved) - saved.index(lost[0])  # from the first due checkpoint to the end
        line += (f"\n  ! checkpoint.keep={spec.checkpoint.keep} leaves only the newest checkpoints when training ends: "
                 f"{len(lost)} due checkpoint(s) (steps {', '.join(map(str, lost[:4]))}{', ...' if len(lost) > 4 else ''}) will be "
                 f"recorded as skipped. Fix: checkpoint.keep={needed} or more, or a larger eval.job_every")
    return line


def saved_steps(spec: JobConfig) -> List[int]:
    """The steps a run to trainer.steps saves checkpoints at (the periodic saves and the final one)."""
    interval, last = spec.checkpoint.interval, spec.trainer.steps
    return sorted({*(range(interval, last + 1, interval) if interval > 0 else ()),
                   *((last,) if spec.checkpoint.save_final else ())})
