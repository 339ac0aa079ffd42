"""Per-step metrics on rank 0: metrics.jsonl, Weights & Biases, and a console progress display."""

from __future__ import annotations

import json
import logging
import netrc
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.config.schema import WandbConfig

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def wandb_mode(cfg: WandbConfig) -> str:
    """`auto` is online only when an API key is configured (env or ~/.netrc), else offline."""
    if cfg.mode != "auto":
        return cfg.mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    return "offline"


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
        truncate_metrics(self.path, resume_step)
        self._file = open(self.path, "a", buffering=1)
        self._init_wandb(wandb_cfg, config)
        if progress and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, completed=resume_step, info="")

    def _init_wandb(self, cfg: WandbConfig, config: Dict[str, Any]) -> None:
        mode = wandb_mode(cfg)
        if mode == "disabled":
            return
        import wandb

        # A stable id per run dir, so a requeued or resumed job continues the same W&B run.
        id_file = self.run_dir / "wandb_id"
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:16])
        os.environ.setdefault("WANDB_DIR", str(self.run_dir))
        self._wandb = wandb.init(
            project=cfg.project,
            entity=cfg.entity or None,
            name=cfg.name or self.run_dir.name,
            group=cfg.group or None,
            tags=list(cfg.tags) or None,
            mode=mode,
            dir=str(self.run_dir),
            config=config,
            id=id_file.read_text().strip(),
            resume="allow",
        )
        self._wandb.define_metric("trainer/step")
        self._wandb.define_metric("*", step_metric="trainer/step")
        log.info("W&B run %s (mode=%s)", self._wandb.id, mode)

    def log(self, record: Dict[str, Any], console: bool = True) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            # Our own step axis: W&B drops logs at or below its internal step, which would keep the
            # pre-crash values of the steps a resumed run repeats.
            self._wandb.log({("trainer/step" if k == "step" else k): v for k, v in record.items()})
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
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def log_images(self, images: Dict[str, Path]) -> None:
        """PNG files (e.g. the plan's memory and pipeline charts) into W&B."""
        if not self.enabled or self._wandb is None:
            return
        import wandb

        self._wandb.log({key: wandb.Image(str(path)) for key, path in images.items()})

    def close(self) -> None:
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.stop()
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
