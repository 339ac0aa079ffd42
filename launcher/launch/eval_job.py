"""One per-checkpoint evaluation job: export the checkpoint to HF, run lm-eval's HF backend, record.

    python -m launcher.launch.eval_job RUN_DIR STEP

is what both executors run (launcher/launch/eval_submit.py: local, a subprocess after training;
SLURM, the one-node job of slurm/eval.sh.j2). It
1. exports the checkpoint of STEP through `action=export`'s own path (the ranks load it and
   write `checkpoint.export=hf` in `checkpoint.export_dtype`, beside it: `<step>_export/hf`),
   on this node's ranks (cluster.gpus_per_node GPUs; one rank on CPUs) with the run's model and precision but a plain
   data-parallel layout (torch.distributed.checkpoint reshards), its own run dir
   `<run dir>/eval_jobs/step_N/` (config, plan, rank logs);
2. puts the tokenizer files beside the weights (those of eval.tokenizer / the data's manifest /
   model.init_from, when the export did not carry them);
3. runs `lm_eval.simple_evaluate` with `HFLM` on that folder (launcher/eval/hf_job.py), offline;
4. appends one record per task to `<run dir>/eval.jsonl` and logs `eval_job/<task>/<metric>` to
   the run's W&B run against its own step key `eval_job/step` (W&B drops steps below a run's
   current step): after training (local) by resuming the run, while it trains (SLURM, online)
   as a second writer in W&B's shared mode;
5. removes the export it wrote (the checkpoint stays; `action=export` makes one to keep).

Whatever fails (the checkpoint pruned before the job ran, the export, lm-eval) is recorded in
eval.jsonl with the job's log, and the job exits 1: training's exit code, checkpoints and
metrics are never touched.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.checkpoint.folder import checkpoint_root, export_dir_of, step_dir_name, verify_checkpoint
from launcher.config.loader import load_spec, save_spec
from launcher.config.schema import EvalConfig, JobConfig, ParallelConfig
from launcher.data.eval_inputs import eval_tokenizer_folder
from launcher.eval.records import append_records
from launcher.eval.tasks import set_offline_env
from launcher.gpus import visible_gpu_count
from launcher.hf.format import TOKENIZER_FILES
from launcher.job_env import job_facts

log = logging.getLogger("launcher.eval_job")

JOBS_DIR = "eval_jobs"  # <run dir>/eval_jobs/step_N/: each job's own run dir (export config, plan, logs)
WANDB_PREFIX = "eval_job"  # W&B keys eval_job/<task>/<metric>, against eval_job/step


class EvalJobError(RuntimeError):
    """A per-checkpoint evaluation that cannot complete (message says why and what to do)."""


def job_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / JOBS_DIR / step_dir_name(step)


def job_log(run_dir: Path, step: int) -> Path:
    """The log of step's evaluation job (both executors write the job's output there)."""
    return Path(run_dir) / "logs" / f"eval-{step_dir_name(step)}.log"


def export_spec_for(spec: JobConfig, checkpoint: Path) -> JobConfig:
    """The run's job as `action=export` of `checkpoint` to HF on one node's ranks (its GPUs, or one
    rank on CPUs): the model, precision and export dtype of the run; a plain data-parallel layout; no
    in-loop evaluation, no W&B; a local launch inside this (job's) process."""
    device = spec.trainer.device
    if device == "auto":  # as the local launch decides it: the GPUs when there are enough
        device = "cuda" if visible_gpu_count() >= spec.cluster.gpus_per_node else "cpu"
    # On CPUs one rank: more ranks share the same host memory and only add start-up time.
    ranks = 1 if device == "cpu" else spec.cluster.gpus_per_node
    cluster = dataclasses.replace(spec.cluster, name="local", nodes=1, gpus_per_node=ranks, spare_nodes=0,
                                  max_restarts=0)
    return dataclasses.replace(
        spec, action="export", eval=EvalConfig(), parallel=ParallelConfig(), cluster=cluster,
        trainer=dataclasses.replace(spec.trainer, device=device, rehearse=False),
        checkpoint=spec.checkpoint.with_changes(resume=str(checkpoint), export="hf", dir=""),
        logging=dataclasses.replace(spec.logging, wandb=dataclasses.replace(spec.logging.wandb, mode="disabled"),
                                    progress=False))


def export_checkpoint(spec: JobConfig, checkpoint: Path, out_dir: Path) -> Path:
    """Run action=export of `checkpoint` (ranks on this machine); the HF folder written."""
    from launcher.config.export_spec import export_spec  # lazy: the export's launch path, in a job only
    from launcher.launch.local import launch_local  # lazy: as above
    from launcher.plan.decide.resolve import check  # lazy: as above
    from launcher.plan.present.plan import build_plan  # lazy: as above

    set_offline_env()  # before lm-eval, datasets and transformers are imported (below, in a thread)
    exp = export_spec(export_spec_for(spec, checkpoint))
    plan = build_plan(exp, check(exp))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_spec(exp, out_dir)
    plan.save(out_dir)
    # The export's ranks start (seconds: torch in a fresh interpreter) while this process loads
    # lm-eval, transformers and torch for the evaluation that follows (another few seconds).
    warm = threading.Thread(target=_import_lm_eval, name="import-lm-eval", daemon=True)
    warm.start()
    try:
        code = launch_local(exp, plan, out_dir)
    finally:
        warm.join()
    if code != 0:
        raise EvalJobError(f"the export of {checkpoint} failed (exit code {code}); its rank logs: {out_dir / 'logs'}")
    return export_dir_of(checkpoint) / "hf"


def _import_lm_eval() -> None:
    """Import what the evaluation needs (a failure is left for the evaluation itself to report)."""
    try:
        from launcher.eval.hf_job import evaluate_export  # lazy: lm-eval, transformers, torch  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # lazy: as above  # noqa: F401
    except Exception:  # noqa: BLE001 - the evaluation imports them again and reports what fails
        pass


def add_tokenizer(spec: JobConfig, folder: Path) -> None:
    """Copy the evaluation tokenizer's files beside the exported weights when the export has none."""
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return
    source, key = eval_tokenizer_folder(spec)
    if not source:
        raise EvalJobError("the export carries no tokenizer and none is known. Fix: eval.tokenizer=<an HF "
                           "tokenizer folder>.")
    copied = [f for f in TOKENIZER_FILES if (Path(source) / f).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, folder / name)
    if not copied:
        raise EvalJobError(f"{source} (from {key}) holds none of {', '.join(TOKENIZER_FILES)}. Fix: eval.tokenizer="
                           f"<an HF tokenizer folder>.")


def evaluate_checkpoint(spec: JobConfig, run_dir: Path, step: int) -> List[Dict[str, Any]]:
    """Export + HFLM for the checkpoint of `step`: one {task, metrics, stderr} per task."""
    from launcher.eval.hf_job import evaluate_export, task_records  # lazy: lm-eval, torch

    checkpoint = checkpoint_root(spec.checkpoint.dir, run_dir) / step_dir_name(step)
    if not checkpoint.is_dir():
        raise EvalJobError(f"the checkpoint {checkpoint} does not exist (removed by checkpoint.keep="
                           f"{spec.checkpoint.keep} before its evaluation ran?). Fix: raise checkpoint.keep, or "
                           f"eval.job_every so that fewer checkpoints wait for evaluation.")
    # Checked here, in one process, before any rank starts: a damaged checkpoint fails in seconds.
    problem = verify_checkpoint(checkpoint, checksums=spec.checkpoint.verify_checksums)
    if problem:
        raise EvalJobError(f"the checkpoint {checkpoint} cannot be exported: {problem}")
    existed = export_dir_of(checkpoint).exists()
    folder = export_checkpoint(spec, checkpoint, job_dir(run_dir, step))
    try:
        add_tokenizer(spec, folder)
        gpus = visible_gpu_count() if spec.trainer.device != "cpu" else 0
        e = spec.eval
        results = evaluate_export(str(folder), e.on_checkpoint, e.include_path, e.limit, e.num_fewshot,
                                  max_length=spec.trainer.seq_len, device="cuda" if gpus else "cpu", gpus=gpus)
        return task_records(results)
    finally:
        if not existed:  # ours: the checkpoint stays, action=export makes an export to keep
            shutil.rmtree(export_dir_of(checkpoint), ignore_errors=True)


def log_to_wandb(spec: JobConfig, run_dir: Path, step: int, records: List[Dict[str, Any]], live: bool) -> None:
    """eval_job/<task>/<metric> at eval_job/step=`step` in the run's W&B run (never raises).

    `live`: training may still be writing the run (SLURM). Online, this job is then a second
    writer in W&B's shared mode (x_primary=False); after training (local), or offline, it resumes
    the run (resume="allow"), the one writer of that moment."""
    from launcher.runtime.metrics import import_wandb, wandb_mode  # lazy: the W&B helpers of the rank loop

    cfg = spec.logging.wandb
    mode = wandb_mode(cfg)
    id_file = Path(run_dir) / "wandb_id"
    rows = {f"{WANDB_PREFIX}/{r['task']}/{m}": v for r in records if r.get("status") == "ok"
            for m, v in r["metrics"].items()}
    if mode == "disabled" or not id_file.exists() or not rows:
        return
    wandb = import_wandb(mode)
    if wandb is None:
        return
    try:
        shared = live and mode == "online"
        settings = (wandb.Settings(mode="shared", x_primary=False, x_label=f"eval-{step_dir_name(step)}", quiet=True)
                    if shared else wandb.Settings(quiet=True))
        run = wandb.init(project=cfg.project, entity=cfg.entity or None, id=id_file.read_text().strip(),
                         resume=None if shared else "allow", mode=None if shared else mode,
                         dir=str(job_dir(run_dir, step)), settings=settings)
        run.define_metric(f"{WANDB_PREFIX}/step")
        run.define_metric(f"{WANDB_PREFIX}/*", step_metric=f"{WANDB_PREFIX}/step")
        run.log({f"{WANDB_PREFIX}/step": step, **rows})
        run.finish()
    except Exception as err:  # noqa: BLE001 - W&B is a mirror of eval.jsonl, which holds the results
        log.warning("W&B logging of the evaluation of step %d failed (%s: %s); eval.jsonl has the results",
                    step, type(err).__name__, err)


def run_eval_job(run_dir: Path, step: int) -> int:
    """The job: evaluate the checkpoint of `step`, append its records to eval.jsonl; 0 or 1."""
    started = time.perf_counter()
    run_dir = Path(run_dir).resolve()
    spec = load_spec(run_dir)
    facts = job_facts()
    job_id = facts.job_id or f"local-{os.getpid()}"
    base = {"step": step, "job_id": job_id, "log": str(job_log(run_dir, step))}
    try:
        records = [dict(base, status="ok", **r) for r in evaluate_checkpoint(spec, run_dir, step)]
        code = 0
    except Exception as err:  # noqa: BLE001 - any failure is recorded; training is not this process
        traceback.print_exc()
        reason = " ".join(str(err).split())[:500] or type(err).__name__
        records = [dict(base, task=t, status="failed", metrics={}, stderr={}, error=f"{type(err).__name__}: {reason}")
                   for t in spec.eval.on_checkpoint]
        code = 1
    seconds = time.perf_counter() - started
    for r in records:
        r["seconds"] = seconds
    append_records(run_dir, records)
    log_to_wandb(spec, run_dir, step, records, live=facts.executor != "local")
    print(f"evaluation of step {step}: {'done' if code == 0 else 'FAILED'} in {seconds:.1f} s -> "
          f"{run_dir / 'eval.jsonl'}", flush=True)
    return code


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.eval_job", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("step", type=int)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_eval_job(args.run_dir, args.step)


if __name__ == "__main__":
    exit_code = main()
    # The records are appended and W&B is closed: leave without the interpreter's teardown of
    # torch and lm-eval (about a second of CPU per job; launcher/runtime/entry.py says more).
    from launcher.runtime.dist import exit_after_shutdown  # lazy: the host imports this module torch-free

    logging.shutdown()
    exit_after_shutdown(exit_code)
