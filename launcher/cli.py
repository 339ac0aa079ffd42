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
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Tuple

import hydra
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from launcher.config.errors import ConfigError, print_problems
from launcher.config.executors import cluster_key_problems
from launcher.config.loader import compose_spec, save_spec, to_spec, user_overrides
from launcher.config.schema import JobConfig
from launcher.config.store import available_recipes, register_configs
from launcher.config.validate import validate as validate_config
from launcher.paths import config_dir
from launcher.plan.present.plan import build_plan
from launcher.plan.present.report import render_plan, render_search
from launcher.plan.decide.resolve import check, resolve_all

if TYPE_CHECKING:  # pragma: no cover
    from launcher.plan.layout import Layout

log = logging.getLogger("launcher")

EXIT_INVALID_CONFIG = 2


def _fail_config(problems: List[str]) -> None:
    print_problems("Invalid configuration", problems)
    sys.exit(EXIT_INVALID_CONFIG)


def _composition_problem(err: Exception) -> str:
    text = str(err).strip().splitlines()
    msg = " ".join(line.strip() for line in text if line.strip())
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        msg += f" ({str(cause).strip().splitlines()[0]})"
    if "recipe" in msg and "not found" in msg.lower():
        msg += f". Available recipes: {', '.join(available_recipes())}"
    return msg + ". Fix: check the key name and type against conf/ (`train --cfg job` prints the composed config)."


def _precheck(argv: List[str]) -> None:
    """Compose and validate before Hydra runs (and before torch is imported).

    A bad key, type or value exits 2 with one clean line per problem, no traceback, and
    nothing written: Hydra creates the run dir and its .hydra/*.yaml only after this. With
    -m/--multirun every point of the sweep is checked before any job runs or is submitted.
    """
    if any(a in ("-h", "--help", "--hydra-help", "--info", "-c", "--cfg", "-i") for a in argv):
        return
    overrides = user_overrides(argv)
    if not any(a in ("-m", "--multirun") for a in argv):
        _fail_if_problems(_point_problems(overrides))
        return
    try:
        points = sweep_points(overrides)
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        _fail_config([_composition_problem(err)])
        return
    problems: List[str] = []
    for num, (label, point) in enumerate(points):
        problems.extend(f"sweep job #{num} ({label}): {p}" for p in _point_problems(point))
    _fail_if_problems(problems)


def _fail_if_problems(problems: List[str]) -> None:
    if problems:
        _fail_config(problems)


def _point_problems(overrides: List[str]) -> List[str]:
    """Every problem of the job these overrides compose (composition errors included)."""
    try:
        spec = compose_spec(overrides)
    except ConfigError as err:
        return err.problems
    except (HydraException, OmegaConfBaseException, ValueError) as err:
        return [_composition_problem(err)]
    if spec.action == "prepare":
        return _prepare_problems(spec)
    layout, problems = resolve_all(spec)
    if layout is not None:
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


def _resolve_local_device(spec: JobConfig) -> JobConfig:
    """For local runs, decide `trainer.device=auto` here (the ranks run on this machine)."""
    if spec.cluster.name != "local" or spec.trainer.device != "auto":
        return spec
    # lazy: the launch side (launch/, jinja2, data.prepare: ~0.1 s) only when a job starts; action=plan skips it
    from launcher.launch.local import visible_gpu_count

    gpus = visible_gpu_count()
    device = "cuda" if gpus >= spec.cluster.gpus_per_node else "cpu"
    if 0 < gpus < spec.cluster.gpus_per_node:
        log.warning(
            "cluster.gpus_per_node=%d but this machine has %d GPU(s): running on CPU. Set "
            "cluster.gpus_per_node=%d to use the GPUs, or trainer.device=cpu to silence this.",
            spec.cluster.gpus_per_node, gpus, gpus,
        )
    return dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, device=device))


# (spec, Layout) of the jobs the pre-check resolved: Hydra composes the same job again, and its
# Layout is reused rather than derived a second time (the backend rules run once per launch).
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
    from launcher.launch.preflight import check_deepspeed_config, check_hf_support

    try:
        check_hf_support(spec, plan)
        check_deepspeed_config(spec, plan)
    except ConfigError as err:
        _fail_config(err.problems)


def _run(spec: JobConfig, run_dir: Path) -> int:
    spec = _resolve_local_device(spec)
    plan = build_plan(spec, _resolved(spec))
    _check_before_launch(spec, plan)
    for warning in plan.warnings:
        log.warning("%s", warning)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    plan.save(run_dir)
    if spec.trainer.rehearse:
        _rehearse_before_launch(spec, plan, run_dir)
    # lazy: the launch side (launch/, jinja2, data.prepare: ~0.1 s) only when a job starts; action=plan skips it
    from launcher.launch.executor import executor_for

    return executor_for(spec.cluster.name).launch(spec, plan, run_dir)


def _plan(spec: JobConfig, run_dir: Path) -> int:
    plan = build_plan(spec, _resolved(spec))
    print(render_plan(plan, spec, spec.plan.format), flush=True)
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
    from launcher.rehearse.driver import rehearsal_problems, rehearse, render_rehearsal

    plan = build_plan(spec, _resolved(spec))
    run_dir.mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    plan.save(run_dir)
    try:
        result = rehearse(spec, plan, run_dir)
    except ConfigError as err:
        _fail_config(err.problems)
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
    from launcher.rehearse.driver import fit_problems, rehearsal_problems, rehearse, render_rehearsal

    try:
        result = rehearse(spec, plan, run_dir)
    except ConfigError as err:
        _fail_config(err.problems)
    log.info("rehearsal before launch:\n%s", render_rehearsal(result))
    problems = rehearsal_problems(result, plan.layout) + fit_problems(result, plan.memory, spec.hardware.name)
    if problems:
        _fail_config(problems)


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")
def hydra_main(cfg: DictConfig) -> None:
    try:
        spec = to_spec(cfg)
    except ConfigError as err:
        _fail_config(err.problems)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if spec.action in ("run", "export"):  # export: the ranks load checkpoint.resume and export it
        code = _run(spec, run_dir)
        print(f"run directory: {run_dir}")
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
    _precheck(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
