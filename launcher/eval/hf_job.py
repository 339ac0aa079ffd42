"""A per-checkpoint evaluation: lm-eval's own HF backend (HFLM) on the HF export of a checkpoint.

The heavy suites (eval.on_checkpoint) run here, in a process of their own off the training
allocation (launcher/launch/eval_job.py drives it): `lm_eval.simple_evaluate` with
`lm_eval.models.huggingface.HFLM` over the exported folder (weights in checkpoint.export_dtype,
the tokenizer files beside them), the tasks from eval.include_path as in-loop evaluation builds
them, offline, with the same few-shot seed, bootstrap count and maximum length
(trainer.seq_len), so a task run both ways scores the same on the same weights.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence

from launcher.eval.loop import metric_rows
from launcher.eval.tasks import BOOTSTRAP_ITERS, FEWSHOT_SEED, set_offline_env, task_manager


def evaluate_export(folder: str, tasks: Sequence[str], include_path: Sequence[str], limit: int, num_fewshot: int,
                    max_length: int, device: str, gpus: int = 0, batch_size: int = 8) -> Dict[str, Any]:
    """lm-eval's results dict for `tasks` on the HF folder `folder` (offline). With several GPUs
    the model is split over them (HFLM's `parallelize`, accelerate's device map): a model that
    trained sharded need not fit one GPU."""
    set_offline_env()  # before lm-eval / datasets / transformers are imported
    from lm_eval import simple_evaluate  # lazy: lm-eval, the optional extra, after the offline variables
    from lm_eval.models.huggingface import HFLM  # lazy: as above (imports transformers and torch)

    lm = HFLM(pretrained=folder, tokenizer=folder, dtype="auto", device=device, batch_size=batch_size,
              max_length=max_length, parallelize=device == "cuda" and gpus > 1)
    return simple_evaluate(model=lm, tasks=list(tasks), task_manager=task_manager(include_path),
                           num_fewshot=num_fewshot, limit=limit or None,
                           bootstrap_iters=BOOTSTRAP_ITERS, fewshot_random_seed=FEWSHOT_SEED, log_samples=False,
                           verbosity="ERROR")


def task_records(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """One {task, metrics, stderr} per task of lm-eval's results: `acc,none` -> metrics["acc"],
    its `acc_stderr,none` -> stderr["acc"] (names as in-loop evaluation logs them, without eval/<task>/)."""
    rows = metric_rows(results)
    out: Dict[str, Dict[str, Any]] = {}
    for name, value in rows.items():
        _, task, metric = name.split("/", 2)
        rec = out.setdefault(task, {"task": task, "metrics": {}, "stderr": {}})
        if metric.endswith("_stderr") or "_stderr/" in metric:
            rec["stderr"][metric.replace("_stderr", "", 1)] = value
        else:
            rec["metrics"][metric] = value
    return [out[t] for t in sorted(out)]
