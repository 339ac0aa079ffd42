"""Submitting the per-checkpoint evaluation jobs (eval.job) through the executor's own way.

Which checkpoints are due is decided once (launcher/plan/decide/eval_jobs.py); here they are run:
- local (`run_local_eval_jobs`): after training ends, one subprocess per due checkpoint that
  exists and has no record yet (`python -m launcher.launch.eval_job RUN_DIR STEP`), its output in
  `logs/eval-step_N.log`; a due checkpoint already removed by checkpoint.keep is recorded as
  skipped. Their outcome never changes training's exit code.
- SLURM (`python -m launcher.launch.eval_submit watch|scan RUN_DIR`): the training job's batch
  script runs `watch` in the background while the ranks train and `scan` once when it exits;
  each submits a one-node job rendered from slurm/eval.sh.j2 for every due checkpoint not yet
  submitted (`eval_jobs/submitted.txt`, so requeues and restarts submit each step once).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.checkpoint.folder import checkpoint_root, step_dir_name, step_folders, step_of
from launcher.config.loader import load_spec
from launcher.config.schema import JobConfig
from launcher.config.slurm_keys import sanitize_job_name
from launcher.eval.records import append_records, recorded_steps
from launcher.launch.slurm import (_jinja_env, _uses_gpus, container_args, escape_sbatch_pattern, ranks_python, run_sbatch,
                                   write_executable)
from launcher.paths import slurm_dir
from launcher.plan.decide.eval_jobs import eval_job_due, eval_jobs_on

TEMPLATE = "eval.sh.j2"
SUBMITTED = "submitted.txt"  # <run dir>/eval_jobs/submitted.txt: one step per line
WATCH_INTERVAL_S = 30.0  # how often the SLURM watcher looks for new checkpoints


def saved_due_steps(spec: JobConfig, run_dir: Path) -> List[int]:
    """Due checkpoints that are on disk, oldest first."""
    root = checkpoint_root(spec.checkpoint.dir, run_dir)
    return sorted(s for s in (step_of(p) for p in step_folders(root)) if s is not None and eval_job_due(spec, s))


def eval_argv(run_dir: Path, step: int, python: str = sys.executable) -> List[str]:
    return [python, "-m", "launcher.launch.eval_job", str(run_dir), str(step)]


# ----------------------------------------------------------------------------------------------
# local: after training


def run_local_eval_jobs(spec: JobConfig, run_dir: Path) -> None:
    """Run every due checkpoint's evaluation job here, one after the other (never raises)."""
    if not eval_jobs_on(spec):
        return
    run_dir = Path(run_dir).resolve()
    done = recorded_steps(run_dir)
    saved = saved_due_steps(spec, run_dir)
    newest = max(saved, default=0)
    # Due steps up to the newest saved one whose checkpoint is gone: pruned before this ran.
    gone = [s for s in range(1, newest) if eval_job_due(spec, s) and s not in saved and s not in done]
    if gone:
        append_records(run_dir, [
            {"step": s, "task": t, "status": "skipped", "metrics": {}, "stderr": {}, "seconds": 0.0, "job_id": None,
             "log": None, "error": f"the checkpoint of step {s} was removed (checkpoint.keep={spec.checkpoint.keep}) "
                                   f"before the evaluation jobs ran after training. Fix: checkpoint.keep>="
                                   f"{len(gone) + len(saved)}, or a larger eval.job_every."}
            for s in gone for t in spec.eval.on_checkpoint])
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for step in (s for s in saved if s not in done):
        log_path = logs / f"eval-{step_dir_name(step)}.log"
        print(f"evaluation job for step {step}: {' '.join(eval_argv(run_dir, step)[1:])} (log: {log_path})", flush=True)
        with open(log_path, "a") as out:
            # its own session: a Ctrl-C of `train` reaches it through the terminal anyway, and a
            # failure in it stays in it
            code = subprocess.call(eval_argv(run_dir, step), stdout=out, stderr=subprocess.STDOUT, cwd=os.getcwd())
        if step not in recorded_steps(run_dir):  # died before it could record (killed, import error)
            append_records(run_dir, [
                {"step": step, "task": t, "status": "failed", "metrics": {}, "stderr": {}, "seconds": 0.0,
                 "job_id": None, "log": str(log_path), "error": f"the evaluation job exited with {code} before "
                                                               f"recording a result"} for t in spec.eval.on_checkpoint])
        print(f"evaluation job for step {step}: {'done' if code == 0 else f'FAILED (exit {code}), see {log_path}'}",
              flush=True)


# ----------------------------------------------------------------------------------------------
# SLURM: a one-node job per checkpoint, submitted while training runs


def eval_sbatch_options(spec: JobConfig, run_dir: Path, step: int, cwd: Path) -> List[Dict[str, Optional[str]]]:
    """#SBATCH options of one evaluation job: one node, one task, the training nodes' GPUs."""
    c = spec.cluster
    logs = escape_sbatch_pattern(str(run_dir / "logs"))
    name = sanitize_job_name(f"{c.job_name or spec.run.name or 'train'}-eval-{step}", "eval")
    opts: List[tuple] = [("job-name", name), ("nodes", 1), ("ntasks", 1)]
    if _uses_gpus(spec):
        opts.append(("gpus-per-node", c.gpus_per_node))
    if c.cpus_per_task > 0:
        opts.append(("cpus-per-task", c.cpus_per_task))
    for key in ("partition", "account", "qos", "time", "constraint", "mem"):
        if getattr(c, key):
            opts.append((key, getattr(c, key)))
    if c.exclusive:
        opts.append(("exclusive", None))
    opts += [("chdir", str(cwd)), ("output", f"{logs}/eval-{step_dir_name(step)}.log"),
             ("error", f"{logs}/eval-{step_dir_name(step)}.log"), ("open-mode", "append"), ("export", "ALL"),
             ("no-requeue", None)]
    return [{"name": k, "value": None if v is None else str(v)} for k, v in opts]


def render_eval_script(spec: JobConfig, run_dir: Path, step: int, cwd: Path) -> str:
    """slurm/eval.sh.j2 for the checkpoint of `step`."""
    c = spec.cluster
    script = run_dir / "eval_jobs" / f"{step_dir_name(step)}.sbatch"
    context: Dict[str, Any] = {
        "template_path": str(slurm_dir() / TEMPLATE),
        "script_path": str(script),
        "step": step,
        "sbatch_options": eval_sbatch_options(spec, run_dir, step, cwd),
        "sbatch_args": [str(a) for a in c.sbatch_args],
        "env": {str(k): str(v) for k, v in c.env.items()},
        "setup": [str(s) for s in c.setup],
        "srun_argv": ["srun", "--nodes=1", "--ntasks=1", *container_args(c, cwd, run_dir)],
        "eval_argv": eval_argv(run_dir, step, ranks_python(c)),
    }
    return _jinja_env(slurm_dir()).get_template(TEMPLATE).render(**context)


def submitted_steps(run_dir: Path) -> set:
    path = Path(run_dir) / "eval_jobs" / SUBMITTED
    if not path.exists():
        return set()
    return {int(line.split()[0]) for line in path.read_text().splitlines() if line.strip()}


def submit_due(run_dir: Path, cwd: Optional[Path] = None) -> List[str]:
    """Submit a job for every due, saved checkpoint not yet submitted; the job ids. A submission
    that fails is recorded in eval.jsonl (training goes on)."""
    run_dir = Path(run_dir).resolve()
    spec = load_spec(run_dir)
    if not eval_jobs_on(spec):
        return []
    cwd = Path(cwd or os.getcwd()).resolve()
    jobs_dir = run_dir / "eval_jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    ids = []
    sent = submitted_steps(run_dir) | recorded_steps(run_dir)
    for step in (s for s in saved_due_steps(spec, run_dir) if s not in sent):
        script = write_executable(jobs_dir / f"{step_dir_name(step)}.sbatch", render_eval_script(spec, run_dir, step, cwd))
        try:
            job_id = run_sbatch(script, cwd)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as err:
            append_records(run_dir, [{"step": step, "task": t, "status": "failed", "metrics": {}, "stderr": {},
                                      "seconds": 0.0, "job_id": None, "log": str(script),
                                      "error": f"submitting the evaluation job failed: {err}"}
                                     for t in spec.eval.on_checkpoint])
            continue
        with open(jobs_dir / SUBMITTED, "a") as f:
            f.write(f"{step} {job_id}\n")
        print(f"launcher: submitted evaluation job {job_id} for the checkpoint of step {step}", flush=True)
        ids.append(job_id)
    return ids


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.eval_submit")
    parser.add_argument("mode", choices=("watch", "scan"))
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--interval", type=float, default=WATCH_INTERVAL_S)
    args = parser.parse_args(argv)
    if args.mode == "scan":
        submit_due(args.run_dir)
        return 0
    while True:  # until the batch script stops it (then it runs `scan` once more)
        try:
            submit_due(args.run_dir)
        except Exception as err:  # noqa: BLE001 - the watcher must outlive a bad scan; training never waits on it
            print(f"launcher: evaluation job watcher: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
