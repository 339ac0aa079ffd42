"""Per-step metrics on rank 0: metrics.jsonl, Weights & Biases, and a console progress display."""

from __future__ import annotations

import json
import logging
import netrc
import os
import shlex
import sys
import threading
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional

from launcher.config.schema import WandbConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
# Used when logging.wandb.init_timeout_s is not positive: a reachable W&B server answers within
# seconds, and every second waited here is a second every rank of the job sits idle.
DEFAULT_INIT_TIMEOUT_S = 30.0


# W&B's own environment variable, as `auto` reads it ("dryrun" is W&B's older name for offline).
WANDB_ENV_MODES = {"online": "online", "offline": "offline", "dryrun": "offline", "disabled": "disabled"}


def wandb_mode(cfg: WandbConfig) -> str:
    """`auto` follows W&B's own WANDB_MODE when it is set (online, offline, disabled); else it is
    online only when an API key is configured (env or ~/.netrc), else offline."""
    if cfg.mode != "auto":
        return cfg.mode
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in WANDB_ENV_MODES:
        return WANDB_ENV_MODES[env]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


def init_timeout_s(cfg: WandbConfig) -> float:
    """The wandb.init timeout to use (a non-positive setting means the documented default)."""
    timeout = float(cfg.init_timeout_s)
    if timeout > 0:
        return timeout
    log.warning(
        "logging.wandb.init_timeout_s=%s is not positive; using %.0f s. Fix: set a positive number of seconds.",
        cfg.init_timeout_s, DEFAULT_INIT_TIMEOUT_S,
    )
    return DEFAULT_INIT_TIMEOUT_S


def import_wandb(mode: str) -> Optional[ModuleType]:
    """The wandb module, or None with one warning when it cannot be imported (training goes on)."""
    try:
        import wandb  # lazy: wandb is slow to import (~0.65 s); only W&B runs use it, and a broken install only warns
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken install raising anything else
        log.warning(
            "logging.wandb.mode=%s but the wandb package cannot be imported (%s: %s): training continues "
            "without W&B, metrics go to %s only. Fix: pip install wandb, or set logging.wandb.mode=disabled.",
            mode, type(e).__name__, e, METRICS_FILE,
        )
        return None
    return wandb


def start_wandb_run(wandb: ModuleType, init_args: Dict[str, Any], mode: str, timeout_s: float, run_dir: Path,
                    quiet: bool = True):
    """wandb.init in `mode`; if online cannot start (no network, server down, bad key), offline.

    Compute nodes often have no internet while WANDB_API_KEY is forwarded, so `auto` asks for
    online: wandb's own init timeout bounds the wait, then the run logs offline into the run
    dir (`wandb sync` uploads it later). Returns None, after a warning, if W&B cannot start at all.
    """
    # wandb's own error telemetry (wandb >= 0.2x) is sent to the same server when the process
    # exits; where that server does not answer (a firewalled compute node) the send held rank 0's
    # exit for about 20 s (two 10 s HTTP timeouts, measured with wandb 0.31). It reports to W&B,
    # not to the user, so it is off unless WANDB_ERROR_REPORTING is set explicitly.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    try:
        return wandb.init(mode=mode, settings=wandb.Settings(init_timeout=timeout_s, quiet=quiet), **init_args)
    except Exception as e:  # noqa: BLE001 - wandb raises CommError, UsageError, timeouts, OSError...
        first_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if mode != "online":
        log.warning("W&B could not start (mode=%s; %s): training continues without W&B, metrics go to %s only",
                    mode, first_error, METRICS_FILE)
        return None
    log.warning(
        "W&B could not start online (%s; the wait is bounded by logging.wandb.init_timeout_s=%g): logging to "
        "W&B offline in %s instead; upload later with `wandb sync %s/offline-run-*`",
        first_error, timeout_s, run_dir, shlex.quote(str(run_dir / "wandb")),
    )
    try:
        # The failed online attempt still holds the run id in wandb's service: shut it down
        # first, or the offline run is refused with "run ID ... is in use".
        wandb.teardown()
        return wandb.init(mode="offline", settings=wandb.Settings(quiet=quiet), **init_args)
    except Exception as e:  # noqa: BLE001
        log.warning("W&B could not start offline either (%s: %s): training continues without W&B",
                    type(e).__name__, e)
        return None


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after `last_step` (a resumed run rewrites the steps it repeats)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except ValueError:
            continue  # a torn last line from a crash
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(k + "\n" for k in kept))
    tmp.replace(path)


def open_wandb_run(cfg: WandbConfig, run_dir: Path, config: Dict[str, Any]):
    """The W&B run of this run dir (its id kept in run_dir/wandb_id, so a requeued or resumed job
    continues the same run), or None when W&B is disabled or cannot start."""
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    wandb = import_wandb(mode)
    if wandb is None:
        return None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file = run_dir / "wandb_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:16])
    os.environ.setdefault("WANDB_DIR", str(run_dir))
    init_args = dict(
        project=cfg.project,
        entity=cfg.entity or None,
        name=cfg.name or run_dir.name,
        group=cfg.group or None,
        tags=list(cfg.tags) or None,
        dir=str(run_dir),
        config=config,
        id=id_file.read_text().strip(),
        resume="allow",
    )
    return start_wandb_run(wandb, init_args, mode, init_timeout_s(cfg), run_dir, quiet=cfg.quiet)


class WandbStart:
    """`open_wandb_run` on a background thread, started by rank 0 before the model is built.

    Starting W&B costs seconds (importing wandb, starting its service process) and, online, a
    server round trip that `logging.wandb.init_timeout_s` bounds at 30 s by default. Building the
    model and loading a checkpoint take that long or longer, and neither needs W&B, so the two
    overlap: the MetricsLogger takes the run from here when training is about to start.
    """

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: Dict[str, Any]):
        self._run = None
        self._thread = threading.Thread(target=self._open, args=(cfg, run_dir, config), name="wandb-start",
                                        daemon=True)
        self._thread.start()

    def _open(self, cfg: WandbConfig, run_dir: Path, config: Dict[str, Any]) -> None:
        try:
            self._run = open_wandb_run(cfg, run_dir, config)
        except Exception as e:  # noqa: BLE001 - W&B never stops training
            log.warning("W&B could not start (%s: %s): training continues without W&B", type(e).__name__, e)

    def result(self):
        """The started W&B run (or None), once its start has finished."""
        self._thread.join()
        return self._run


class MetricsLogger:
    """Writes metrics on rank 0 only; other ranks get a no-op logger."""

    def __init__(
        self,
        run_dir: Path,
        *,
        enabled: bool,
        wandb_cfg: WandbConfig,
        config: Dict[str, Any],
        total_steps: int,
        progress: bool,
        resume_step: int = 0,
        wandb_start: Optional[WandbStart] = None,
    ):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self._wandb = None
        self._progress = None
        self._task = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        self._init_wandb(wandb_cfg, config, wandb_start)
        if progress and sys.stdout.isatty():
            # lazy: rich.progress (~30 ms) only when stdout is a terminal (not under SLURM or a pipe)
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=resume_step, info="")

    def _init_wandb(self, cfg: WandbConfig, config: Dict[str, Any], started: Optional["WandbStart"]) -> None:
        self._wandb = started.result() if started is not None else open_wandb_run(cfg, self.run_dir, config)
        if self._wandb is None:
            return
        self._wandb_call("define_metric", lambda run: run.define_metric("trainer/step"))
        self._wandb_call("define_metric", lambda run: run.define_metric("*", step_metric="trainer/step"))
        if self._wandb is not None:
            log.info("W&B run %s (mode=%s)", self._wandb.id, self._wandb.settings.mode)

    def _wandb_call(self, what: str, call: Callable[[Any], Any]) -> None:
        """Run one W&B call; the first failure warns and stops W&B logging, never training."""
        if self._wandb is None:
            return
        try:
            call(self._wandb)
        except Exception as e:  # noqa: BLE001 - any W&B failure (service died, network, usage) is non-fatal
            log.warning(
                "W&B %s failed (%s: %s): W&B logging stops for this run; training and %s continue",
                what, type(e).__name__, e, METRICS_FILE,
            )
            self._wandb = None

    def log(self, record: Dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            # Our own step axis: W&B drops logs at or below its internal step, which would keep the
            # pre-crash values of the steps a resumed run repeats.
            row = {("trainer/step" if k == "step" else k): v for k, v in record.items()}
            self._wandb_call("log", lambda run: run.log(row))
        if self._progress is not None and console:
            self._progress.update(
                self._task, completed=record["step"],
                info=f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s",
            )
        elif console:
            log.info(
                "step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %.0f tok/s  %.3f s/step",
                record["step"], self.total_steps, record["loss"], record["lr"], record["grad_norm"],
                record["tokens_per_s"], record["step_time_s"],
            )

    def summary(self, values: Dict[str, Any]) -> None:
        """Run-level values (predictions, measured peaks) for W&B's summary and summary.json."""
        if not self.enabled:
            return
        path = self.run_dir / "summary.json"
        existing = json.loads(path.read_text()) if path.exists() else {}
        existing.update(values)
        path.write_text(json.dumps(existing, indent=1))
        self._wandb_call("summary update", lambda run: run.summary.update(values))

    def log_images(self, images: Dict[str, Path]) -> None:
        """PNG files (e.g. the plan's memory and pipeline charts) into W&B."""
        if not self.enabled or self._wandb is None:
            return
        import wandb  # lazy: wandb is slow to import (~0.65 s); only a live W&B run gets here

        self._wandb_call("image log", lambda run: run.log({key: wandb.Image(str(path)) for key, path in images.items()}))

    def log_table(self, key: str, columns: List[str], rows: List[List[Any]]) -> None:
        """A table (per-expert token counts, the rehearsal's per-rank comparison) into W&B (rank 0 only)."""
        if not self.enabled or self._wandb is None:
            return
        import wandb  # lazy: wandb is slow to import (~0.65 s); only a live W&B run gets here

        self._wandb_call("table log", lambda run: run.log({key: wandb.Table(columns=columns, data=rows)}))

    def save_file(self, path: Path) -> None:
        """A file of the run dir (e.g. a profiler trace) into W&B's run files (rank 0 only)."""
        if not self.enabled or self._wandb is None:
            return
        self._wandb_call("file save", lambda run: run.save(str(path), base_path=str(self.run_dir), policy="now"))

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        offline = self._wandb is not None and self._wandb.settings.mode == "offline"
        folder = Path(self._wandb.dir).parent if offline else None
        self._wandb_call("finish", lambda run: run.finish())
        self._wandb = None
        if folder is not None:
            log.info("W&B offline run in %s: upload it with `wandb sync %s`", folder, shlex.quote(str(folder)))
