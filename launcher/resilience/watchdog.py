"""Hang watchdog: a rank that makes no progress for `trainer.hang_timeout_s` ends the job with evidence.

A daemon thread per rank watches the time since the last progress event (a finished step,
or the end of a long phase). Long phases (start-up and the first, compiled steps, resume,
checkpoint saves, validation) run under `phase(name)` with a bound of their own, so they
never trip the step timeout. When the bound passes, every rank (each watches its own clock,
so they fire together) writes into <run_dir>/failure/:

- stacks_rank_<r>.txt: every thread's Python stack (faulthandler);
- fr_trace_rank_<r>.json: the flight recorder's record of recent collectives, where the
  process group keeps one (TORCH_FR_BUFFER_SIZE, for gloo and NCCL alike);
- rank_<r>.json: the rank's last step, phase and last collective sequence number per group.

Rank 0 waits a short grace for the other ranks' reports, names the ranks that did not arrive
(those whose last collective on a group is behind the others'; without a flight recorder,
those whose last step is behind) in failure/summary.json, and every rank exits with
HANG_EXIT_CODE, so torchrun, and SLURM after it, see a failed job.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import threading
import time
from typing import Any, Dict, Iterator, List, Optional

from launcher.resilience.failure import SUMMARY_FILE, FailureBundle, host_name

log = logging.getLogger(__name__)

HANG_EXIT_CODE = 3
# Automatic timeout: this many predicted step times, never less than the floor (the plan's
# step time is a GPU prediction; the floor covers slow first steps, logging and slow nodes).
AUTO_STEP_FACTOR = 20
HANG_FLOOR_S = 300.0
# Long phases (start-up with the first compiled steps, resume with checksums, saves,
# validation) get this bound at least, or a multiple of the step timeout when that is larger.
LONG_PHASE_FLOOR_S = 1800.0
LONG_PHASE_FACTOR = 4
# How long rank 0 waits for the other ranks' reports before it names the silent ones.
REPORT_GRACE_S = 15.0
FR_BUFFER_ENTRIES = "2000"


def flight_recorder_env() -> Dict[str, str]:
    """Variables that make the process groups keep a flight recorder (set before they are created)."""
    return {
        # One recorder for gloo and NCCL. Not the older TORCH_NCCL_TRACE_BUFFER_SIZE: torch 2.13
        # reads this name first and warns on every rank that sets the older one.
        "TORCH_FR_BUFFER_SIZE": FR_BUFFER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }


def resolve_hang_timeout(configured: float, predicted_step_s: float) -> Optional[float]:
    """trainer.hang_timeout_s: > 0 as given, 0 off (None), -1 auto from the plan's step time."""
    if configured > 0:
        return float(configured)
    if configured == 0:
        return None
    return max(HANG_FLOOR_S, AUTO_STEP_FACTOR * max(0.0, float(predicted_step_s or 0.0)))


def long_phase_bound(timeout_s: float) -> float:
    return max(LONG_PHASE_FLOOR_S, LONG_PHASE_FACTOR * timeout_s)


def flight_recorder_dump() -> Optional[Dict[str, Any]]:
    """This process's flight-recorder record as a dict, or None where there is none."""
    try:
        # lazy: the host imports this module (launch/local.py) and stays torch-free
        from torch._C import _distributed_c10d as c10d
    except ImportError:
        return None
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            data = json.loads(dump(includeCollectives=True, onlyActive=False))
        except Exception:  # noqa: BLE001 - no recorder for this backend, or it is disabled
            continue
        if data.get("entries"):
            return data
    return None


def last_collectives(trace: Optional[Dict[str, Any]]) -> Dict[str, int]:
    """The highest sequence number this rank reached per process group ("<pg>/coll", "<pg>/p2p")."""
    out: Dict[str, int] = {}
    for entry in (trace or {}).get("entries", []):
        group = str((entry.get("process_group") or [entry.get("pg_id")])[0])
        if entry.get("is_p2p"):
            key, seq = f"{group}/p2p", int(entry.get("p2p_seq_id", 0))
        else:
            key, seq = f"{group}/coll", int(entry.get("collective_seq_id", 0))
        out[key] = max(out.get(key, 0), seq)
    return out


def ranks_not_arrived(reports: Dict[int, Dict[str, Any]]) -> List[int]:
    """Ranks behind the others: on any group's collective sequence, else on the step count."""
    behind = set()
    groups = {g for r in reports.values() for g in r.get("collectives", {})}
    for group in groups:
        seqs = {rank: r["collectives"][group] for rank, r in reports.items() if group in r.get("collectives", {})}
        top = max(seqs.values())
        behind.update(rank for rank, seq in seqs.items() if seq < top)
    if not behind and reports:
        top_step = max(r.get("last_step", 0) for r in reports.values())
        behind = {rank for rank, r in reports.items() if r.get("last_step", 0) < top_step}
    return sorted(behind)


class HangWatchdog:
    """Watches this rank's progress; on a hang dumps evidence, rank 0 summarises, every rank exits."""

    def __init__(self, bundle: FailureBundle, timeout_s: float, warmup_steps: int = 1,
                 poll_s: Optional[float] = None):
        self.bundle = bundle
        self.timeout_s = float(timeout_s)
        self.long_bound_s = long_phase_bound(self.timeout_s)
        self.poll_s = poll_s if poll_s is not None else min(1.0, self.timeout_s / 10)
        self._warmup_left = max(1, warmup_steps)
        self._last = time.monotonic()
        self._bound = self.long_bound_s  # start-up is a long phase until the first steps are done
        self._phase_stack: List[str] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.bundle.progress.phase = "startup"

    # ------------------------------------------------------------------ progress events
    def start(self) -> "HangWatchdog":
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()
        log.info("hang watchdog: %.0f s per step, %.0f s for long phases", self.timeout_s, self.long_bound_s)
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int) -> None:
        """A step finished: the clock restarts (after the warm-up steps, with the step bound)."""
        self.bundle.progress.last_step = step
        self._last = time.monotonic()
        if self._warmup_left > 0:
            self._warmup_left -= 1
        if not self._phase_stack and self._warmup_left == 0:
            self._bound = self.timeout_s
            self.bundle.progress.phase = "training"

    @contextlib.contextmanager
    def phase(self, name: str, bound_s: Optional[float] = None) -> Iterator[None]:
        """A long phase (save, validation, resume): its own bound; its end counts as progress."""
        outer = (self._bound, self.bundle.progress.phase)
        self._phase_stack.append(name)
        self.bundle.progress.phase = name
        self._bound = max(self.timeout_s, bound_s if bound_s is not None else self.long_bound_s)
        self._last = time.monotonic()
        try:
            yield
        finally:
            self._phase_stack.pop()
            self._bound, self.bundle.progress.phase = outer
            self._last = time.monotonic()

    # ------------------------------------------------------------------ the thread
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self._bound:
                try:
                    self._on_hang(idle)
                finally:
                    os._exit(HANG_EXIT_CODE)

    def _on_hang(self, idle: float) -> None:
        b = self.bundle
        folder = b.folder
        log.error("no progress for %.0f s (bound %.0f s, phase %s, last step %d): dumping stacks and exiting",
                  idle, self._bound, b.progress.phase, b.progress.last_step)
        with open(folder / f"stacks_rank_{b.rank}.txt", "w") as f:
            f.write(f"# rank {b.rank} on {host_name()}, phase {b.progress.phase}, last step {b.progress.last_step}\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        trace = flight_recorder_dump()
        if trace is not None:
            (folder / f"fr_trace_rank_{b.rank}.json").write_text(json.dumps(trace, default=str))
        report = {"rank": b.rank, "host": host_name(), "last_step": b.progress.last_step,
                  "phase": b.progress.phase, "idle_s": round(idle, 1), "collectives": last_collectives(trace)}
        tmp = folder / f".rank_{b.rank}.json.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(folder / f"rank_{b.rank}.json")
        if b.rank == 0:
            self._summarise(idle)
        else:
            # Stay until rank 0 has summarised: our exit makes torchrun stop every rank.
            deadline = time.monotonic() + REPORT_GRACE_S + 15
            while time.monotonic() < deadline and not (folder / SUMMARY_FILE).exists():
                time.sleep(0.2)

    def _summarise(self, idle: float) -> None:
        b = self.bundle
        folder = b.folder
        deadline = time.monotonic() + REPORT_GRACE_S
        reports: Dict[int, Dict[str, Any]] = {}
        while True:
            for r in range(b.world_size):
                if r not in reports and (folder / f"rank_{r}.json").exists():
                    try:
                        reports[r] = json.loads((folder / f"rank_{r}.json").read_text())
                    except ValueError:
                        pass
            if len(reports) == b.world_size or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        silent = sorted(set(range(b.world_size)) - set(reports))
        stuck = ranks_not_arrived(reports)
        summary = b.base_summary("hang")
        summary.update(
            error=f"no progress for {idle:.0f} s (trainer.hang_timeout_s={self.timeout_s:g})",
            ranks_not_arrived=stuck,
            hosts_not_arrived=sorted({reports[r]["host"] for r in stuck}),
            ranks_without_report=silent,
            per_rank={str(r): {k: v for k, v in rep.items() if k != "collectives"} for r, rep in sorted(reports.items())},
        )
        b.write_summary(summary)
