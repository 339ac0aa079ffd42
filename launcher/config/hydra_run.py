"""A plain `train KEY=VALUE...` run as `@hydra.main` runs it, with the config composed once.

`@hydra.main` composes the config twice for one run (Hydra's `get_mode`, then `run`), and the CLI
needs it a third time, before Hydra writes anything, to refuse a bad config with exit 2. Here the
CLI composes once, exactly as Hydra's `run` would (same task name, search path, overrides and
`hydra.mode=RUN`), checks that config, and hands it to Hydra's own `run_job`: the run dir, its
`.hydra/{config,hydra,overrides}.yaml`, the job log file and `hydra.run.dir=` behave as before.

Only the plain run goes this way. `--help`, `--cfg`, `--info`, `-m` and any other flag still go
through `@hydra.main` (launcher/cli.py decides). This leans on Hydra's internal `Hydra`,
`Callbacks` and helpers of `_run_hydra` (hydra-core 1.3, pinned): tests/test_compose_once.py holds
the run dir to what `@hydra.main` writes.
"""

from __future__ import annotations

import copy
from typing import Callable, List, Sequence

from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import (
    create_automatic_config_search_path,
    detect_calling_file_or_module_from_task_function,
    detect_task_name,
    run_and_report,
)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.utils import configure_log, run_job
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, open_dict, read_write

# What `_run_app` adds when no config sets hydra.mode (ours do not; a command that sets it goes
# through @hydra.main).
RUN_MODE_OVERRIDE = "hydra.mode=RUN"


def is_plain_run(argv: Sequence[str]) -> bool:
    """True for a command line of overrides only (no flag, no hydra.mode): one job, run now."""
    return not any(a.startswith("-") or a.lstrip("+~").startswith("hydra.mode") for a in argv)


class ComposedRun:
    """Hydra set up as `@hydra.main(config_path, config_name)` of `task_function` would set it up."""

    def __init__(self, task_function: Callable[[DictConfig], None], config_path: str, config_name: str):
        calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
        search_path = create_automatic_config_search_path(calling_file, calling_module, config_path)
        self.task_name = detect_task_name(calling_file, calling_module)
        self.config_name = config_name
        self.hydra = Hydra.create_main_hydra2(task_name=self.task_name, config_search_path=search_path)

    def compose(self, overrides: Sequence[str]) -> DictConfig:
        """The job's config with its `hydra` node, as Hydra's `run` composes it; Hydra's own
        exceptions for an override or option it cannot apply. Configures no logging."""
        overrides: List[str] = [*overrides, RUN_MODE_OVERRIDE]
        return self.hydra.compose_config(config_name=self.config_name, overrides=overrides,
                                         run_mode=RunMode.RUN, with_log_configuration=False)

    def run(self, cfg: DictConfig, task_function: Callable[[DictConfig], None]) -> None:
        """Run `task_function` as Hydra's `run` does after composing: logging configured, the run
        dir and .hydra/ written, callbacks called, an exception reported as Hydra reports it."""

        def run_composed() -> None:
            configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
            callbacks = Callbacks(cfg)
            callbacks.on_run_start(config=cfg, config_name=self.config_name)
            ret = run_job(hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
                          task_function=task_function, config=cfg, job_dir_key="hydra.run.dir",
                          job_subdir_key=None, configure_logging=True)
            callbacks.on_run_end(config=cfg, config_name=self.config_name, job_return=ret)
            _ = ret.return_value  # raises the task's exception, as Hydra's run does

        run_and_report(run_composed)

    def close(self) -> None:
        """Forget Hydra's global state, as `@hydra.main` does when it returns."""
        GlobalHydra.instance().clear()


def job_config(cfg: DictConfig) -> DictConfig:
    """A copy of the composed config without its `hydra` node: what the task function receives."""
    job = copy.deepcopy(cfg)  # deep: to_spec fills model keys from HF configs; Hydra saves the composed ones
    with read_write(job), open_dict(job):
        del job["hydra"]
    return job
