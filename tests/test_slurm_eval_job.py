"""A per-checkpoint evaluation job on the development SLURM cluster (eval.job=true, cluster=slurm).

The training job's batch script submits a one-node job (slurm/eval.sh.j2) for the checkpoint of
the last step; that job exports it to HF (fp32) through action=export's path, scores the local
multiple-choice task with lm-eval's HF backend and writes eval.jsonl at the checkpoint's step:
the same acc as in-loop evaluation of the same weights at that step.
"""

from __future__ import annotations

import json
import time

import pytest

from conftest import read_metrics, run_train
from slurm_cluster import slurm_cluster  # noqa: F401  (fixture)
from test_eval_loop import SEQ, WORDS, eval_inputs  # noqa: F401  (fixture)

pytestmark = pytest.mark.slurm

JOB_TIMEOUT_S = 420


def test_a_checkpoint_evaluation_job_writes_eval_jsonl_at_the_checkpoints_step(slurm_cluster, eval_inputs, tmp_path):
    model, tasks = eval_inputs
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(WORDS[(i * 5) % len(WORDS)] for i in range(3000)))
    run = tmp_path / "run"
    proc = run_train(["model=hf", f"model.init_from={model}", "data=text", f"data.path={corpus}", "trainer.steps=2",
                      f"trainer.seq_len={SEQ}", "trainer.global_batch_size=2", "trainer.micro_batch_size=1",
                      "precision=fp32", "trainer.device=cpu", "cluster=slurm", "cluster.name=slurm",
                      "cluster.gpus_per_node=1", "cluster.exclusive=false", "cluster.rdzv_port=0",
                      "eval.tasks=[tiny_mc]", "eval.every=2", f"eval.include_path=[{tasks}]",
                      "eval.on_checkpoint=[tiny_mc]", "eval.job=true", "checkpoint.export_dtype=fp32",
                      "logging.progress=false", "plan.plots=false", "logging.wandb.mode=disabled"], run, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train_job = json.loads((run / "slurm_job.json").read_text())["job_id"]
    info = slurm_cluster.wait(train_job, timeout=JOB_TIMEOUT_S)
    out = (run / "logs" / f"slurm-{train_job}.out").read_text()
    assert info.state == "COMPLETED", out[-3000:]
    submitted = (run / "eval_jobs" / "submitted.txt").read_text().split()
    assert submitted[0] == "2", submitted  # the last step's checkpoint, once
    eval_job = submitted[1]
    assert f"submitted evaluation job {eval_job} for the checkpoint of step 2" in out, out[-3000:]
    done = slurm_cluster.wait(eval_job, timeout=JOB_TIMEOUT_S)
    log = run / "logs" / "eval-step_00000002.log"
    assert done.state == "COMPLETED", log.read_text()[-3000:] if log.exists() else done
    deadline = time.monotonic() + 30  # the record is written before the job ends; a shared FS may lag
    while not (run / "eval.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["task"], r["status"], r["job_id"]) for r in records] == [(2, "tiny_mc", "ok", eval_job)]
    in_loop = {r["step"]: r for r in read_metrics(run)}[2]
    assert records[0]["metrics"]["acc"] == in_loop["eval/tiny_mc/acc"], (records, in_loop)
    assert records[0]["metrics"]["acc_norm"] == in_loop["eval/tiny_mc/acc_norm"]
