"""The run's lm-eval tasks: built once per run, offline, and checked against what the live model serves.

Offline by construction: the ranks (and the launch pre-check) set the Hugging Face offline
variables before lm-eval or `datasets` is imported, so a task whose data is not on this machine
fails while it is built, naming the task, and never tries a download.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

# The few-shot examples of every task are drawn with this seed (lm-eval's own default), so the
# prompts are the same at every evaluation and in every run.
FEWSHOT_SEED = 1234
# Resamples for the stderr of corpus-level metrics (bits_per_byte, word_perplexity): lm-eval's
# default of 100000 costs seconds per task at every evaluation; means (acc) have an exact stderr.
BOOTSTRAP_ITERS = 1000
# Set in the ranks and the launch pre-check before lm-eval and `datasets` are imported:
# no download, no download-count request, and lm-eval's bootstrap without a process pool (a
# fork of a rank that holds process groups).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "DISABLE_MULTIPROC": "1"}

INSTALL_FIX = "Fix: pip install 'launcher[eval]' (lm-eval 0.4.13), or eval.tasks=[] to train without evaluation."


class TaskProblem(ValueError):
    """A task that cannot be evaluated in the loop (message with a Fix)."""


def set_offline_env() -> None:
    """The Hugging Face offline variables (and no bootstrap process pool) for this process."""
    os.environ.update(OFFLINE_ENV)


def lm_eval_problem() -> Optional[str]:
    """None when lm-eval can be imported, else the problem line (with its Fix)."""
    try:
        # lazy: the optional extra, asked for only when eval.tasks is set
        import lm_eval  # noqa: F401
    except ImportError as err:
        return (f"evaluation (eval.tasks, eval.on_checkpoint) needs lm-eval (lm-evaluation-harness), which is not "
                f"installed ({err}). {INSTALL_FIX}")
    return None


def task_manager(include_path: Sequence[str]):
    """lm-eval's TaskManager over eval.include_path only (when given), else its built-in registry."""
    from lm_eval.tasks import TaskManager  # lazy: the optional extra

    paths = [str(p) for p in include_path]
    return TaskManager(include_path=paths or None, include_defaults=not paths)


def served_problems(name: str, task: Any) -> List[str]:
    """What of `task` the live model cannot serve: generation (every log-likelihood metric is
    served, is_greedy's `acc` and `exact_match` included)."""
    if task.get_config("output_type") == "generate_until":
        return [f"eval.tasks: task {name} generates text (output_type generate_until), which in-loop evaluation "
                f"does not build. Fix: drop it from eval.tasks; run it with lm-eval on an HF export of a checkpoint."]
    return []


def load_tasks(tasks: Sequence[str], include_path: Sequence[str], num_fewshot: int, live: bool = True,
               key: str = "eval.tasks") -> Dict[str, Any]:
    """lm-eval's loaded task dict for `tasks` (datasets read once, here), few-shot set with
    FEWSHOT_SEED. Raises TaskProblem naming the task (and `key`, the config key that names it)
    when one cannot be built, or, with `live` (the in-loop model), served; lm-eval's own HF
    backend (the per-checkpoint jobs, live=False) serves every output type."""
    manager = task_manager(include_path)
    problems: List[str] = []
    known = set(manager.all_tasks)  # tasks, groups and tags
    unknown = [t for t in tasks if t not in known]
    if unknown:
        where = f"eval.include_path={list(include_path)}" if include_path else "lm-eval's registry"
        raise TaskProblem(f"{key}: no task named {', '.join(unknown)} in {where}. Fix: check the names "
                          f"(a YAML's `task:`), or add the folder holding its YAML to eval.include_path.")
    loaded = None
    for name in tasks:
        try:
            one = manager.load([name])
        except Exception as err:  # datasets/lm-eval raise many kinds: name the task and its data
            reason = " ".join(str(err).split())[:300] or type(err).__name__
            raise TaskProblem(
                f"{key}: task {name} could not be built offline ({type(err).__name__}: {reason}). Fix: make its "
                f"dataset available on this machine (cache it on a node with network access: docs/evaluation.md), "
                f"or point its YAML at local files (dataset_path: json, dataset_kwargs.data_files).") from None
        loaded = one if loaded is None else _merge(loaded, one)
    for task_name, task in loaded["tasks"].items():
        if live:
            problems.extend(served_problems(task_name, task))
        if task.get_config("num_fewshot") != 0 or num_fewshot == 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    if problems:
        raise TaskProblem("; ".join(problems))
    return loaded


def _merge(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Two TaskManager.load results as one (their tasks, groups and group maps together)."""
    out = dict(a)
    for key, value in b.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out.setdefault(key, value)
    return out
