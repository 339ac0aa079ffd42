"""`<run dir>/eval.jsonl`: the per-checkpoint evaluation jobs' results, one record per (step, task).

A record: {"step", "task", "status" ("ok" | "failed" | "skipped"), "metrics" {metric: value},
"stderr" {metric: value}, "seconds" (the job's wall time: export and evaluation), "job_id", "log"
(the job's log file), "export" (the HF folder evaluated), "error" (failed or skipped: why)}.
Several jobs may finish at once (SLURM): each appends its lines under an exclusive lock.
Torch- and lm-eval-free: the submitters read it to know which steps are done.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List

EVAL_FILE = "eval.jsonl"


def append_records(run_dir: Path, records: Iterable[Dict[str, Any]]) -> None:
    """Append `records` to run_dir/eval.jsonl, whole lines under an exclusive lock."""
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    if not text:
        return
    with open(Path(run_dir) / EVAL_FILE, "a", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(text)
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_records(run_dir: Path) -> List[Dict[str, Any]]:
    """eval.jsonl's records (a torn last line is skipped)."""
    path = Path(run_dir) / EVAL_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def recorded_steps(run_dir: Path) -> set:
    """The checkpoint steps eval.jsonl holds a record of (evaluated, failed or skipped)."""
    return {r["step"] for r in read_records(run_dir) if isinstance(r.get("step"), int)}
