"""Checks run in the launch path, before any rank starts or any job is submitted.

`check_deepspeed_config(spec, plan)`: when DeepSpeed owns the model states, the DeepSpeed
JSON the engine will generate is generated here too and checked with DeepSpeed's own config
classes (`deepspeed.runtime.config.DeepSpeedConfig`), so a config DeepSpeed refuses fails on
the submitting machine with exit code 2, not minutes later on every rank. This imports
torch and deepspeed: it belongs to `action=run` only (`action=plan` / `action=search` import
neither).
"""

from __future__ import annotations

import logging

from launcher.config.errors import ConfigError
from launcher.config.schema import JobConfig
from launcher.engines.deepspeed_config import build_deepspeed_config, data_parallel_size, validate_deepspeed_config
from launcher.plan.decide.optim_groups import has_muon, model_group_assignment, uses_groups
from launcher.plan.present.plan import Plan


def check_deepspeed_config(spec: JobConfig, plan: Plan) -> None:
    """Raise ConfigError (one line, with a fix) when DeepSpeed refuses the generated config."""
    layout = plan.layout
    if not layout.uses_deepspeed:
        return
    # lazy: engines.deepspeed imports torch; only a DeepSpeed run reaches here
    from launcher.engines.deepspeed import prepare_deepspeed_environment

    prepare_deepspeed_environment(spec.trainer.device)
    cfg = build_deepspeed_config(layout, grad_clip=spec.trainer.grad_clip, seed=spec.trainer.seed)
    try:
        validate_deepspeed_config(cfg, data_parallel_size(layout))
    except Exception as err:  # DeepSpeed raises pydantic, assertion and value errors alike
        reason = " ".join(str(err).split())[:400]
        raise ConfigError([
            f"DeepSpeed refused the generated config (ZeRO-{layout.memory.zero_stage}, offload optimizer="
            f"{layout.memory.offload_optimizer}, params={layout.memory.offload_params}): {type(err).__name__}: {reason}. "
            f"Fix: change the keys it names, or backend=native where the native path serves this layout."
        ]) from err


def check_optimizer(spec: JobConfig, plan: Plan) -> None:
    """optim=muon / optim.groups before launch: refused when DeepSpeed owns the model states
    (DeepSpeed 0.19.8's Muon iterates on the Gram matrix by default, has no match_rms_adamw and no
    coefficients to set: it cannot equal torch.optim.Muon), and every group checked against the
    model's canonical parameter names (a pattern that matches nothing, Muon on a non-matrix)."""
    if not uses_groups(spec.optim):
        return
    if has_muon(spec.optim) and plan.layout.owners.sharding_backend == "deepspeed":
        raise ConfigError([
            "optim=muon (or a Muon group in optim.groups) is served by the native engine only; this layout's "
            "model states are owned by DeepSpeed, whose Muon (runtime/zero/muon) does not compute torch.optim.Muon's "
            "update. Fix: backend=native with parallel.zero_stage=2 or 3, or optim=adamw."])
    problems = model_group_assignment(spec.model, spec.optim).problems
    if problems:
        raise ConfigError(list(problems))


def check_hf_support(spec: JobConfig, plan: Plan) -> None:
    """Hugging Face export (checkpoint.export=hf) is served by the native engine only (DeepSpeed
    loads model.init_from, but its export gathers the whole model on rank 0): refuse before launch
    when DeepSpeed owns the model states."""
    if plan.layout.owners.sharding_backend != "deepspeed":
        return
    problems = []
    if spec.checkpoint.export == "hf":
        problems.append("checkpoint.export=hf is not supported yet when DeepSpeed owns the model states. "
                        "Fix: backend=native, or checkpoint.export=safetensors.")
    if spec.eval.job and spec.eval.on_checkpoint:
        problems.append("eval.job=true evaluates an HF export of each checkpoint, and the HF export is not "
                        "supported yet when DeepSpeed owns the model states. Fix: backend=native, or eval.job=false "
                        "(in-loop evaluation, eval.tasks, serves DeepSpeed).")
    if problems:
        raise ConfigError(problems)


def check_eval_tasks(spec: JobConfig) -> None:
    """eval.tasks: lm-eval is installed and every task builds offline and is served by the live
    model (generation is not); eval.on_checkpoint (with eval.job): every
    task builds offline (lm-eval's HF backend serves them all). Checked here before any rank starts."""
    jobs = list(spec.eval.on_checkpoint) if spec.eval.job else []
    if not spec.eval.tasks and not jobs:
        return
    # lazy: launcher.eval imports lm-eval (the optional extra) and torch; action=run with eval.tasks only
    from launcher.eval.tasks import TaskProblem, lm_eval_problem, load_tasks, set_offline_env

    set_offline_env()  # before `datasets` is imported: no download, here as in the ranks
    missing = lm_eval_problem()
    if missing:
        raise ConfigError([missing])
    # lm-eval warns about every default it fills into a YAML: the ranks' logs keep those, the console not
    lm_eval_log = logging.getLogger("lm_eval")
    level = lm_eval_log.level
    lm_eval_log.setLevel(logging.ERROR)
    try:
        if spec.eval.tasks:
            load_tasks(spec.eval.tasks, spec.eval.include_path, spec.eval.num_fewshot)
        if jobs:
            load_tasks(jobs, spec.eval.include_path, spec.eval.num_fewshot, live=False, key="eval.on_checkpoint")
    except TaskProblem as err:
        raise ConfigError([str(err)]) from None
    finally:
        lm_eval_log.setLevel(level)
