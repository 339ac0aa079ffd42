"""Goodput: where a run's wall time went, from its first launch to now, across in-job restarts,
requeues and reruns of the same run directory.

Rank 0 of each attempt (one start of the ranks) keeps a `GoodputClock` and rewrites
<run_dir>/goodput/attempt_<start ms>.json at every log step. `account` combines every attempt's
file into one accounting whose parts add up to the wall time:

- productive: the compute of steps the run kept;
- compile_warmup: the first step of each attempt (the first two with trainer.compile=true), where
  kernels compile and caches warm;
- checkpoint: time spent saving (the part of an async save that blocks the loop, and the final wait);
- data_wait: the loop waiting for the next batch;
- eval: validation (trainer.val_every) and in-loop evaluation;
- startup: from the launch (`train`, or the SLURM job's start) to the first step: composing,
  planning, starting the ranks, building the model, loading the checkpoint;
- restart: from an attempt's last record to the next attempt's start within one launch (the
  failure, its detection and teardown, the restart decision; steps after the last record);
- recomputed: the compute of steps an attempt did and the next one trained again (they were
  after the checkpoint it resumed from, or past a loss spike it rewound);
- between_jobs: from one launch's last record to the next launch (a requeued job's queue wait, or
  the time before someone reran the command);
- other: the rest (logging, the loop's own overhead, the end of the run), so the parts add up.

Torch-free: `train` reads the files after the ranks exit and prints the final line
(`summary_line`). SLURM's sacct does not work on the dev cluster, and the ranks' own clocks see
every attempt, so the launch time comes from the executor (LAUNCHER_LAUNCH_TIME, set by `train`
and by the batch script) rather than from the scheduler.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

GOODPUT_DIR = "goodput"
LAUNCH_TIME_ENV = "LAUNCHER_LAUNCH_TIME"  # unix time the executor started this launch
RANK_BUCKETS = ("productive", "compile_warmup", "checkpoint", "data_wait", "eval", "startup")
BUCKETS = (*RANK_BUCKETS, "recomputed", "restart", "between_jobs", "other")


def launch_time(env: Optional[Dict[str, str]] = None) -> Optional[float]:
    """The executor's launch time for this process's job, or None when it did not say."""
    value = (env if env is not None else os.environ).get(LAUNCH_TIME_ENV, "")
    try:
        return float(value) if value else None
    except ValueError:
        return None


@dataclass
class Attempt:
    """One start of the ranks, as its rank 0 recorded it."""

    process_start: float  # unix time rank 0's process started
    time: float  # unix time of the last record
    launch_time: Optional[float]  # the executor's launch time (same for the attempts of one launch)
    new_launch: bool  # the first attempt of a launch (not an in-job restart)
    resumed_step: int
    last_step: int
    buckets: Dict[str, float]
    productive_at_save: Dict[int, float] = field(default_factory=dict)  # step -> productive seconds then

    def to_json(self) -> Dict[str, Any]:
        return {"process_start": self.process_start, "time": self.time, "launch_time": self.launch_time,
                "new_launch": self.new_launch, "resumed_step": self.resumed_step, "last_step": self.last_step,
                "buckets": self.buckets, "productive_at_save": {str(k): v for k, v in self.productive_at_save.items()}}

    @classmethod
    def from_json(cls, data: Dict[str, Any]) -> "Attempt":
        return cls(float(data["process_start"]), float(data["time"]), data.get("launch_time"),
                   bool(data.get("new_launch", True)), int(data.get("resumed_step", 0)), int(data.get("last_step", 0)),
                   {k: float(v) for k, v in data.get("buckets", {}).items()},
                   {int(k): float(v) for k, v in data.get("productive_at_save", {}).items()})

    def productive_after(self, step: int) -> float:
        """This attempt's productive seconds spent on steps after `step` (trained again by a later
        attempt that resumed at `step`)."""
        if step <= self.resumed_step:
            return self.buckets.get("productive", 0.0)
        saved = [s for s in self.productive_at_save if s <= step]
        at = self.productive_at_save[max(saved)] if saved else 0.0
        return max(0.0, self.buckets.get("productive", 0.0) - at)


def read_attempts(run_dir: Path) -> List[Attempt]:
    """Every attempt's record, in start order (unreadable files are skipped)."""
    folder = Path(run_dir) / GOODPUT_DIR
    out = []
    for path in sorted(folder.glob("attempt_*.json")) if folder.is_dir() else []:
        try:
            out.append(Attempt.from_json(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(out, key=lambda a: a.process_start)


def account(attempts: List[Attempt], now: float) -> Dict[str, float]:
    """Seconds per bucket (BUCKETS) plus "wall", from the first launch to `now`."""
    out = {b: 0.0 for b in BUCKETS}
    if not attempts:
        return {**out, "wall": 0.0}
    first = attempts[0]
    start = min(first.launch_time or first.process_start, first.process_start)
    for i, attempt in enumerate(attempts):
        for bucket in RANK_BUCKETS:
            out[bucket] += attempt.buckets.get(bucket, 0.0)
        launched = attempt.launch_time if attempt.new_launch and attempt.launch_time is not None else None
        if launched is not None:  # the executor's own start-up before the ranks ran
            out["startup"] += max(0.0, attempt.process_start - launched)
        if i == 0:
            continue
        before = attempts[i - 1]
        recomputed = min(before.productive_after(attempt.resumed_step), out["productive"])
        out["productive"] -= recomputed
        out["recomputed"] += recomputed
        if attempt.new_launch:  # a requeued job, or the command run again
            out["between_jobs"] += max(0.0, (launched if launched is not None else attempt.process_start) - before.time)
        else:  # an in-job restart
            out["restart"] += max(0.0, attempt.process_start - before.time)
    wall = max(0.0, now - start)
    out["other"] = wall - sum(out[b] for b in BUCKETS if b != "other")
    out["wall"] = wall
    return out


def metrics(accounting: Dict[str, float]) -> Dict[str, float]:
    """goodput/<bucket>_s and goodput/<bucket>_frac, goodput/wall_s and goodput/goodput (productive / wall)."""
    wall = accounting.get("wall", 0.0)
    out = {"goodput/wall_s": round(wall, 3),
           "goodput/goodput": round(accounting["productive"] / wall, 4) if wall > 0 else 0.0}
    for bucket in BUCKETS:
        out[f"goodput/{bucket}_s"] = round(accounting[bucket], 3)
        out[f"goodput/{bucket}_frac"] = round(accounting[bucket] / wall, 4) if wall > 0 else 0.0
    return out


def summary_line(accounting: Dict[str, float]) -> str:
    """One line: the productive share, then every other non-zero part, largest first."""
    wall = accounting.get("wall", 0.0)
    if wall <= 0:
        return "goodput: nothing measured"
    parts = sorted(((accounting[b], b) for b in BUCKETS if b != "productive" and accounting[b] >= 0.005 * wall),
                   reverse=True)
    rest = ", ".join(f"{b.replace('_', ' ')} {100 * s / wall:.0f}% ({s:.1f} s)" for s, b in parts)
    return (f"goodput: {100 * accounting['productive'] / wall:.0f}% productive ({accounting['productive']:.1f} s of "
            f"{wall:.1f} s wall){'; ' + rest if rest else ''}")


class GoodputClock:
    """Rank 0's clock for its attempt: the trainer reports each step's parts; `record` rewrites the
    attempt's file and returns the run's goodput/* metrics (earlier attempts read once, at start)."""

    def __init__(self, run_dir: Path, process_start: float, resumed_step: int, warmup_steps: int,
                 new_launch: bool, launch: Optional[float]):
        self.run_dir = Path(run_dir)
        self.earlier = read_attempts(run_dir)
        self.warmup_steps = warmup_steps
        self.steps_done = 0
        self.attempt = Attempt(process_start, process_start, launch, new_launch, resumed_step, resumed_step,
                               {b: 0.0 for b in RANK_BUCKETS})
        self.path = self.run_dir / GOODPUT_DIR / f"attempt_{int(process_start * 1000):016d}.json"

    def loop_started(self, now: Optional[float] = None) -> None:
        """The first step begins: everything since the process started was start-up."""
        now = time.time() if now is None else now
        self.attempt.buckets["startup"] += max(0.0, now - self.attempt.process_start)

    def step_done(self, seconds: float, data_wait_s: float, eval_s: float) -> None:
        """One step: its wall seconds up to its compute's end, and the parts of them that were
        not compute (its checkpoint save comes after: `add`)."""
        b = self.attempt.buckets
        compute = max(0.0, seconds - data_wait_s - eval_s)
        b["compile_warmup" if self.steps_done < self.warmup_steps else "productive"] += compute
        b["data_wait"] += data_wait_s
        b["eval"] += eval_s
        self.steps_done += 1

    def add(self, bucket: str, seconds: float) -> None:
        """Time outside the steps (the final save and its wait)."""
        self.attempt.buckets[bucket] += max(0.0, seconds)

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was written: a later attempt resuming there keeps the compute so far."""
        self.attempt.productive_at_save[step] = self.attempt.buckets["productive"]

    def record(self, step: int, now: Optional[float] = None) -> Dict[str, float]:
        """Rewrite this attempt's file (atomically) and return the whole run's accounting."""
        now = time.time() if now is None else now
        self.attempt.time = now
        self.attempt.last_step = step
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.attempt.to_json()))
        tmp.replace(self.path)
        return account([*self.earlier, self.attempt], now)


def as_summary(accounting: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """run_summary.json's "goodput": seconds (every bucket and the wall) and fractions of the wall."""
    wall = accounting.get("wall", 0.0)
    return {"seconds": {b: round(accounting[b], 3) for b in (*BUCKETS, "wall")},
            "fractions": {b: round(accounting[b] / wall, 4) if wall else 0.0 for b in BUCKETS}}


def finish_run(run_dir: Path, now: Optional[float] = None) -> Optional[str]:
    """The executor, after the ranks' last exit: the accounting up to `now` goes into
    run_summary.json ("goodput": seconds and fractions per bucket); returns the line to print
    (None when no attempt recorded anything)."""
    attempts = read_attempts(run_dir)
    if not attempts:
        return None
    accounting = account(attempts, time.time() if now is None else now)
    path = Path(run_dir) / "run_summary.json"
    try:
        summary = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        summary = {}
    summary["goodput"] = as_summary(accounting)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    tmp.replace(path)
    return summary_line(accounting)


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m launcher.observe.goodput RUN_DIR`: the run's accounting up to its last record
    (a finished run's wall does not grow while nothing runs) into run_summary.json, and its line
    printed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m launcher.observe.goodput RUN_DIR", file=sys.stderr)
        return 2
    attempts = read_attempts(Path(args[0]))
    line = finish_run(Path(args[0]), attempts[-1].time) if attempts else None
    print(f"launcher: {line}" if line else "launcher: goodput: no attempt recorded its time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
