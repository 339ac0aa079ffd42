"""The `train` command: compose -> validate -> plan -> (print | launch locally | submit to SLURM).

    train +recipe=llama70b parallel.tp=8
    train +recipe=llama70b cluster=slurm cluster.nodes=16
    train +recipe=llama405b action=plan cluster.nodes=64 plan.format=json
    train action=prepare prepare.input=/raw/web prepare.output=/data/web prepare.tokenizer=/models/llama3
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Tuple

import hydra
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from launcher.config.composition_errors import composition_problem
from launcher.config.errors import ConfigError, print_problems
from launcher.config.executors import cluster_key_problems
from launcher.config.hydra_run import ComposedRun, is_plain_run, job_config
from launcher.config.loader import compose_spec, save_spec, to_spec, token_budget_problems, user_overrides
from launcher.config.overrides import override_problems
from launcher.config.schema import JobConfig
from launcher.config.slurm_keys import sbatch_problems
from launcher.config.store import register_configs
from launcher.config.validate import validate as validate_config
from launcher.gpus import visible_gpu_count
from launcher.paths import config_dir
from launcher.plan.present.plan import build_plan
from launcher.plan.decide.optim_groups import model_group_assignment, render_groups, uses_groups
from launcher.plan.present.report import render_plan, render_search
from launcher.plan.decide.resolve import check, resolve_all

if TYPE_CHECKING:  # pragma: no cover
    from launcher.plan.layout import Layout

log = logging.getLogger("launcher")

EXIT_INVALID_CONFIG = 2


def _fail_config(problems: List[str]) -> None:
    print_problems("Invalid configuration", problems)
    sys.exit(EXIT_INVALID_CONFIG)


def _compose_check_and_run(argv: List[str]) -> None:
    """A plain run (`train KEY=VALUE...`): compose once, check, then run in Hydra's run dir.

    A mistyped key or option, or an invalid config, exits 2 with one line per problem and no
    traceback before Hydra writes anything (the run dir and .hydra/*.yaml come after) and before
    torch is imported; the config checked is the config the job runs.
    """
    _fail_if_problems(override_problems(user_overrides(argv)))
    app = ComposedRun(_job, config_path=str(config_dir()), config_name="train")
    try:
        try:
            cfg = app.compose(argv)
            spec = to_spec(job_config(cfg))
        except ConfigError as err:
            _fail_config(err.problems)
        except (HydraException, OmegaConfBaseException, ValueError) as err:  # ValueError: as compose_spec's callers
            _fail_config([composition_problem(err)])
        _fail_if_problems(_spec_problems(spec) + token_budget_problems(user_overrides(argv), spec))
        app.run(cfg, lambda _job_cfg: _dispatch(spec))
    finally:
        app.close()


def _precheck(argv: List[str]) -> None:
    """Compose and validate before Hydra's own main runs (and before torch is imported), for the
    command lines that go through it: `-m` sweeps and other flags.

    A bad key, type or value exits 2 with one clean line per problem, no traceback, and
    nothing written: Hydra creates the run dir and its .hydra/*.yaml only after this. With
    -m/--multirun every point of the sweep is checked before any job runs or is submitted.
    """
    if any(a in ("-h", "--help", "--hydra-help") for a in argv):
        return
    if any(a in ("--info", "-c", "--cfg", "-i") for a in argv):  # shows the config: a typo is still named
        _fail_if_problems(override_problems(user_overrides(argv)))
        return
    overrides = user_overrides(argv)
    if not any(a in ("-m", "--multirun") for a in argv):
        _fail_if_problems(_point_problems(overrides))
        return
    _fail_if_problems(override_problems(overrides))  # a typo shared by every job: said once
    try:
        points = sweep_points(overrides)
        _SWEPT_KEYS[:] = swept_keys(overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        _fail_config([composition_problem(err)])
        return
    per_job = [(num, label, _point_problems(point)) for num, (label, point) in enumerate(points)]
    # A problem every job has (e.g. no sbatch on PATH for a recipe that submits) is said once.
    shared = [p for p in per_job[0][2] if all(p in job for _, _, job in per_job[1:])] if len(per_job) > 1 else []
    problems: List[str] = [f"every sweep job: {p}" for p in shared]
    for num, label, job in per_job:
        problems.extend(f"sweep job #{num} ({label}): {p}" for p in job if p not in shared)
    _fail_if_problems(problems)


def _fail_if_problems(problems: List[str]) -> None:
    if problems:
        _fail_config(problems)


def _point_problems(overrides: List[str]) -> List[str]:
    """Every problem of the job these overrides compose (composition errors included)."""
    problems = override_problems(overrides)
    if problems:
        return problems
    try:
        spec = compose_spec(overrides)
    except ConfigError as err:
        return err.problems
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        return [composition_problem(err)]
    return _spec_problems(spec) + token_budget_problems(overrides, spec)


def _spec_problems(spec: JobConfig) -> List[str]:
    """Every problem of a composed job; its Layout, when it has one, is kept for the launch."""
    if spec.action == "prepare":
        return _prepare_problems(spec) + sbatch_problems(spec.cluster, spec.action)
    layout, problems = resolve_all(spec)
    problems += sbatch_problems(spec.cluster, spec.action)
    if layout is not None and not problems:
        _PRECHECKED.append((spec, layout))
    return problems


def sweep_points(overrides: List[str]) -> List[Tuple[str, List[str]]]:
    """The jobs of a `-m` sweep as Hydra's basic sweeper makes them: the cartesian product of
    each override's values, in command-line order. Each job is (label, overrides), the label
    naming the swept values. glob() sweeps over config groups are expanded like Hydra does.
    """
    register_configs()
    axes: List[List[Tuple[str, bool]]] = []
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        for override in parser.parse_overrides(overrides):
            key = override.get_key_element()
            if override.is_sweep_override():
                axes.append([(f"{key}={v}", True) for v in override.sweep_string_iterator()])
            else:
                axes.append([(f"{key}={override.get_value_element_as_str()}", False)])
    points = []
    for combo in itertools.product(*axes):
        label = " ".join(text for text, swept in combo if swept) or "no swept keys"
        points.append((label, [text for text, _ in combo]))
    return points


# The keys the `-m` command sweeps, found by the pre-check before Hydra's main runs the jobs: a job's
# run name counts its swept values, so no two jobs of a sweep share a checkpoint folder.
_SWEPT_KEYS: List[str] = []


def swept_keys(overrides: List[str]) -> List[str]:
    """The keys a `-m` command sweeps (`optim.lr=1e-4,3e-4` -> optim.lr), without +/~."""
    register_configs()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(overrides)
    return [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]


def _resolve_local_device(spec: JobConfig) -> JobConfig:
    """For local runs, decide `trainer.device=auto` here (the ranks run on this machine), and refuse
    `trainer.device=cuda` without enough visible GPUs before any rank starts."""
    if spec.cluster.name != "local" or spec.trainer.device == "cpu":
        return spec
    gpus = visible_gpu_count()
    if spec.trainer.device == "cuda":
        if gpus < spec.cluster.gpus_per_node:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            seen = f"{gpus} visible GPU(s)" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            fix = (f"cluster.gpus_per_node={gpus}" if gpus else "trainer.device=cpu or trainer.device=auto")
            _fail_config([f"trainer.device=cuda: cluster.gpus_per_node={spec.cluster.gpus_per_node} local ranks need "
                          f"as many GPUs, and this machine has {seen}. Fix: {fix}, or run on a GPU machine."])
        return spec
    device = "cuda" if gpus >= spec.cluster.gpus_per_node else "cpu"
    if 0 < gpus < spec.cluster.gpus_per_node:
        log.warning(
            "cluster.gpus_per_node=%d but this machine has %d GPU(s): running on CPU. Set "
            "cluster.gpus_per_node=%d to use the GPUs, or trainer.device=cpu to silence this.",
            spec.cluster.gpus_per_node, gpus, gpus,
        )
    return dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, device=device))


# (spec, Layout) of the jobs the checks resolved: the launch reuses the Layout rather than derive
# it a second time (the backend rules run once per launch); a sweep's jobs are matched by spec.
_PRECHECKED: List[Tuple[JobConfig, "Layout"]] = []


def _same_job(checked: JobConfig, spec: JobConfig) -> bool:
    """Equal up to trainer.device, which a local run decides after the pre-check (the Layout
    does not depend on it; the device rules are re-run on the final spec)."""
    aligned = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, device=checked.trainer.device))
    return aligned == checked


def _resolved(spec: JobConfig) -> "Layout":
    """The spec's Layout (every rule checked and every decision derived once); exit 2 otherwise."""
    for checked, layout in _PRECHECKED:
        if _same_job(checked, spec):
            problems = validate_config(spec)  # the config-level rules, on the final device
            if problems:
                _fail_config(problems)
            return layout
    try:
        return check(spec)
    except ConfigError as err:
        _fail_config(err.problems)


def _check_before_launch(spec: JobConfig, plan) -> None:
    """Checks that need the run-time libraries (DeepSpeed's own config classes); exit 2 on failure."""
    # lazy: action=run only (preflight + deepspeed_config: ~7 ms); action=plan skips it
    from launcher.launch.preflight import check_deepspeed_config, check_eval_tasks, check_hf_support, check_optimizer

    try:
        check_hf_support(spec, plan)
        check_optimizer(spec, plan)
        check_deepspeed_config(spec, plan)
        check_eval_tasks(spec)
    except ConfigError as err:
        _fail_config(err.problems)


def _choose_run(spec: JobConfig, run_dir: Path) -> JobConfig:
    """action=run with checkpoints: name the run, put its checkpoints in the run's stable folder,
    say on the console whether it resumes (and why not), and record its identity there."""
    # lazy: the launch side only when a job starts; action=plan skips it
    from launcher.checkpoint.folder import checkpoint_dir_holder
    from launcher.checkpoint.run_folder import choose_run, write_identity  # lazy: as above

    hydra_cfg = HydraConfig.get()
    given = any(o.split("=", 1)[0].lstrip("+~") in ("hydra.run.dir", "hydra.sweep.dir") for o in hydra_cfg.overrides.hydra)
    swept: Dict[str, str] = {}
    if hydra_cfg.mode == RunMode.MULTIRUN:
        swept = {k: v for k, _, v in (o.lstrip("+~").partition("=") for o in hydra_cfg.overrides.task) if k in _SWEPT_KEYS}
    base = hydra_cfg.runtime.choices.get("recipe") or spec.model.name
    choice = choose_run(spec, run_dir, base, given, swept)
    (log.warning if choice.warn else log.info)("%s", choice.message)
    root = Path(choice.spec.checkpoint.dir)
    # A dry run submits nothing; a folder another job holds is refused by the executor next, and
    # that job's record stays: only a command that will train here writes it.
    if not spec.cluster.dry_run and checkpoint_dir_holder(root) is None:
        from launcher.launch.local import resume_command  # lazy: the launch side, as below

        write_identity(root, choice, resume_command())
    return choice.spec


def _run(spec: JobConfig, run_dir: Path) -> int:
    spec = _resolve_local_device(spec)
    plan = build_plan(spec, _resolved(spec))
    _check_before_launch(spec, plan)
    for warning in plan.warnings:
        log.warning("%s", warning)
    if spec.action == "run" and spec.checkpoint.enabled:
        spec = _choose_run(spec, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    plan.save(run_dir)
    if spec.trainer.rehearse:
        _rehearse_before_launch(spec, plan, run_dir)
    # lazy: the launch side (launch/, jinja2, data.prepare: ~0.1 s) only when a job starts; action=plan skips it
    from launcher.launch.executor import executor_for

    return executor_for(spec.cluster.name).launch(spec, plan, run_dir)


def _print_optimizer_groups(spec: JobConfig) -> None:
    """optim=muon / optim.groups: which parameters each group got (counts and bytes); exit 2 on a
    group that matches nothing or puts a non-matrix under Muon."""
    assignment = model_group_assignment(spec.model, spec.optim)
    if assignment.problems:
        _fail_config(list(assignment.problems))
    print(render_groups(assignment), flush=True)


def _plan(spec: JobConfig, run_dir: Path) -> int:
    plan = build_plan(spec, _resolved(spec))
    print(render_plan(plan, spec, spec.plan.format), flush=True)
    if uses_groups(spec.optim) and spec.plan.format != "json":
        _print_optimizer_groups(spec)
    # JSON is for tools: keep it instant (matplotlib alone costs about a second).
    if spec.plan.plots and spec.plan.format != "json":
        from launcher.plan.present.plots import save_plan_plots  # lazy: only when plots are drawn (~6 ms)

        run_dir.mkdir(parents=True, exist_ok=True)
        plan.save(run_dir)
        save_plan_plots(plan, spec, run_dir)
    return 0


def _search(spec: JobConfig) -> int:
    from launcher.plan.present.search import search_layouts  # lazy: action=search only; action=plan's imports stay as they were

    _resolved(spec)
    candidates = search_layouts(spec)
    print(render_search(candidates, spec, spec.plan.format, spec.plan.top_k))
    return 0


def _prepare_problems(spec: JobConfig) -> List[str]:
    """action=prepare needs only prepare.* and the executor's cluster.* keys: no model, layout or data.* rules."""
    # lazy: action=prepare only (data.prepare: ~0.08 s); action=plan skips it
    from launcher.data.prepare import prepare_problems

    return prepare_problems(spec.prepare) + cluster_key_problems(spec.cluster, spec.action)


def _prepare(spec: JobConfig, run_dir: Path) -> int:
    """action=prepare: tokenize prepare.input into prepare.output, here or as a job (the executor's choice)."""
    # lazy: the launch side (launch/, jinja2, data.prepare: ~0.1 s) only when a job starts; action=plan skips it
    from launcher.launch.executor import executor_for

    return executor_for(spec.cluster.name).prepare(spec, run_dir)


def _rehearse(spec: JobConfig, run_dir: Path) -> int:
    """Plan, then build the chosen ranks on a fake process group (launcher/rehearse/driver.py);
    exit 2 with one line per rank that cannot be built."""
    # lazy: action=rehearse / trainer.rehearse only; action=plan skips it
    from launcher.rehearse.driver import rehearsal_problems, rehearse, render_rehearsal, stop_rank_server

    plan = build_plan(spec, _resolved(spec))
    run_dir.mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    plan.save(run_dir)
    try:
        result = rehearse(spec, plan, run_dir)
    except ConfigError as err:
        _fail_config(err.problems)
    finally:
        stop_rank_server()
    if spec.plan.format == "json":
        print(json.dumps(result, indent=1), flush=True)
    else:
        print(render_rehearsal(result), flush=True)
        print(f"rehearsal: {run_dir / 'rehearsal.json'}", flush=True)
    problems = rehearsal_problems(result, plan.layout)
    if problems:
        _fail_config(problems)
    return 0


def _rehearse_before_launch(spec: JobConfig, plan, run_dir: Path) -> None:
    """trainer.rehearse=true: rehearse first (rehearsal.json, which rank 0 logs to W&B); exit 2
    before anything is launched when a rank cannot be built or does not fit."""
    # lazy: action=rehearse / trainer.rehearse only; action=plan skips it
    from launcher.rehearse.driver import fit_problems, rehearsal_problems, rehearse, render_rehearsal, stop_rank_server

    try:
        result = rehearse(spec, plan, run_dir)
    except ConfigError as err:
        _fail_config(err.problems)
    finally:
        stop_rank_server()  # the launch that follows needs the memory its torch holds
    log.info("rehearsal before launch:\n%s", render_rehearsal(result))
    problems = rehearsal_problems(result, plan.layout) + fit_problems(result, plan.memory, spec.hardware.name)
    if problems:
        _fail_config(problems)


def _export_dir(spec: JobConfig) -> Path:
    """Where action=export wrote: beside the checkpoint (launcher/runtime/export_action.py)."""
    from launcher.checkpoint.folder import export_dir_of  # lazy: action=export only (torch-free)

    return export_dir_of(Path(spec.checkpoint.resume).resolve())


def _job(cfg: DictConfig) -> None:
    """Hydra's task function: one job of a run or of a sweep, in its run dir."""
    try:
        spec = to_spec(cfg)
    except ConfigError as err:
        _fail_config(err.problems)
    _dispatch(spec)


hydra_main = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")(_job)


def _dispatch(spec: JobConfig) -> None:
    """Do the job's action in Hydra's run dir; exit with its code when that is not 0."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if spec.action in ("run", "export"):  # export: the ranks load checkpoint.resume and export it
        code = _run(spec, run_dir)
        print(f"run directory: {run_dir}")
        if spec.action == "export" and not code:
            print(f"exported {spec.checkpoint.resume} ({spec.checkpoint.export}) to {_export_dir(spec)}")
    elif spec.action == "rehearse":
        code = _rehearse(spec, run_dir)
    elif spec.action == "prepare":
        code = _prepare(spec, run_dir)
    else:
        code = _plan(spec, run_dir) if spec.action == "plan" else _search(spec)
    if code:
        sys.exit(code)


def main() -> None:
    """Console entry point of `train`."""
    register_configs()
    argv = sys.argv[1:]
    if is_plain_run(argv):
        _compose_check_and_run(argv)
        return
    _precheck(argv)
    hydra_main()


if __name__ == "__main__":
    main()
