"""Straggler detection: per log step, every rank's busy time, the spread over ranks, the slowest host.

Each rank measures its own speed in a way a slow peer cannot make slow:
- on CPU, the CPU time of its main thread per step (a rank waiting for a slow peer inside a
  collective sleeps, so it is not charged for the peer's slowness);
- on GPU, kernels run asynchronously and a healthy GPU waiting inside NCCL for a slow peer is
  as busy on its stream as the slow one, so neither host wall time (it shows host stalls and
  misses slow GPUs) nor a step's device time can tell the slow GPU apart. Each log step every
  rank times a fixed matmul on its GPU with CUDA events (launcher/resilience/preflight.py's
  probe, a few milliseconds, no collective): that time is the one judged. The step's own device
  time, from CUDA events recorded around every step and read at the log step (when the loss read
  has already waited for the device), is what step_time_*_s report.
On each log step one small all-gather (two floats per rank) collects both; rank 0 logs
step_time_min_s / step_time_median_s / step_time_max_s, slowest_rank and slowest_host (and on GPU
gpu_matmul_min_ms / gpu_matmul_max_ms). A rank over trainer.straggler_factor x the other ranks'
median for trainer.straggler_checks log steps in a row is warned about with its host name, and the
run summary lists the slowest hosts. With `exclude` (trainer.straggler_action) every rank then
raises NodeBlamed (kind "straggler"; every rank sees the same gathered times, so all end
together): the failure bundle names the node and the restart decision excludes it.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from launcher.resilience.failure import NodeBlamed
from launcher.resilience.preflight import straggler_probe_s

log = logging.getLogger(__name__)


def gather_hosts(host: str) -> List[str]:
    """Every rank's host name, in rank order (once, at start)."""
    if not dist.is_initialized():
        return [host]
    hosts: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    return [str(h) for h in hosts]


class StragglerMonitor:
    """Per-log-step straggler check. `factor` and `checks` come from the caller
    (trainer.straggler_factor / trainer.straggler_checks): their defaults live in the schema only."""

    def __init__(self, rank: int, hosts: List[str], factor: float, device: torch.device, *, checks: int,
                 publish: Optional[Callable[[Dict[str, Any]], None]] = None, exclude: bool = False):
        self.rank = rank
        self.hosts = hosts
        self.factor = factor
        self.device = device
        self.publish = publish  # rank 0: the run summary
        self.checks = checks
        self.exclude = exclude  # end the attempt naming the straggler's node (NodeBlamed)
        self._busy = 0.0
        self._steps = 0
        self._t0 = 0.0
        self._start: Any = None
        # What the judged time is: a GPU is judged by its probe matmul (a slow peer cannot slow it).
        self._judged = "for the GPU probe matmuls" if device.type == "cuda" else "per step"
        self._events: List[Any] = []  # (start, end) CUDA events of the steps since the last log step
        self._streak = [0] * len(hosts)
        self._slowest_count = [0] * len(hosts)
        self._warned: Dict[int, Dict[str, Any]] = {}
        self._observed = 0

    def step_started(self) -> None:
        if self.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.thread_time()

    def step_finished(self) -> None:
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start, end))
        else:
            self._busy += time.thread_time() - self._t0
        self._steps += 1

    def _step_seconds(self) -> float:
        """This rank's mean busy time per step since the last log step (device time on GPU)."""
        if self.device.type == "cuda":
            if self._events:
                self._events[-1][1].synchronize()
            self._busy = sum(start.elapsed_time(end) for start, end in self._events) / 1000.0
            self._events = []
        mine = self._busy / max(1, self._steps)
        self._busy, self._steps = 0.0, 0
        return mine

    def observe(self, step: int) -> Dict[str, Any]:
        """On a log step (every rank, collective): the spread of busy time over ranks."""
        mine = self._step_seconds()
        judged = straggler_probe_s(self.device, self.rank) if self.device.type == "cuda" else mine
        t = torch.tensor([mine, judged], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(out, t)
            rows = [x.tolist() for x in out]
        else:
            rows = [t.tolist()]
        step_times, judged_times = [r[0] for r in rows], [r[1] for r in rows]
        metrics = self.judge(step, judged_times, step_times=step_times)
        if self.device.type == "cuda":
            metrics.update(gpu_matmul_min_ms=min(judged_times) * 1e3, gpu_matmul_max_ms=max(judged_times) * 1e3)
        return metrics

    def judge(self, step: int, times: List[float], step_times: Optional[List[float]] = None) -> Dict[str, Any]:
        """Every rank's judged time of one log step (rank order; its busy time per step on CPU, its
        probe matmul's on GPU) -> the metrics; warns, and with `exclude` raises NodeBlamed, when ranks
        have been over the factor for `checks` log steps in a row. `step_times` (default: `times`)
        are what step_time_*_s report."""
        slowest = max(range(len(times)), key=times.__getitem__)
        self._slowest_count[slowest] += 1
        named = []
        for r, value in enumerate(times):
            # Compared with the other ranks' median: with few ranks the straggler itself moves the
            # median of all (with two ranks no rank could ever exceed 2x the median of both).
            others = statistics.median(times[:r] + times[r + 1:]) if len(times) > 1 else value
            # The first log step carries one-off costs (lazy init, allocator warm-up, compile) that
            # differ between ranks: not evidence against a node, which exclusion would take it for.
            over = others > 0 and value > self.factor * others and self._observed > 0
            self._streak[r] = self._streak[r] + 1 if over else 0
            if self._streak[r] == self.checks:
                if self.rank == 0:
                    self._warn(step, r, value, others)
                named.append({"rank": r, "host": self.hosts[r],
                              "why": f"{value:.3f} s {self._judged}, {value / others:.1f}x the other ranks' median "
                                     f"{others:.3f} s, for {self.checks} log steps in a row (trainer.straggler_factor="
                                     f"{self.factor:g})"})
        self._observed += 1
        if named and self.exclude:
            what = "; ".join(f"rank {n['rank']} on {n['host']}: {n['why']}" for n in named)
            raise NodeBlamed("straggler", named, f"straggler at step {step}: {what}. Its node is excluded on a restart "
                                                 f"(cluster.spare_nodes) or from the requeued job; Fix: "
                                                 f"trainer.straggler_action=warn only warns")
        step_times = times if step_times is None else step_times
        return {"step_time_min_s": min(step_times), "step_time_median_s": statistics.median(step_times),
                "step_time_max_s": max(step_times), "slowest_rank": slowest, "slowest_host": self.hosts[slowest]}

    def _warn(self, step: int, r: int, value: float, median: float) -> None:
        log.warning("straggler: rank %d on host %s took %.3f s %s, %.1fx the other ranks' median %.3f s, for %d log steps "
                    "in a row (trainer.straggler_factor=%g)", r, self.hosts[r], value, self._judged, value / median, median,
                    self.checks, self.factor)
        self._warned[r] = {"rank": r, "host": self.hosts[r], "step": step, "ratio": round(value / median, 2)}
        if self.publish is not None:
            self.publish(self.summary())

    def summary(self) -> Dict[str, Any]:
        """Slowest hosts (most log steps as the slowest rank) and the stragglers warned about."""
        order = sorted(range(len(self.hosts)), key=lambda r: -self._slowest_count[r])
        return {"stragglers": {
            "warned": sorted(self._warned.values(), key=lambda w: w["rank"]),
            "slowest_hosts": [{"rank": r, "host": self.hosts[r], "log_steps_slowest": self._slowest_count[r]}
                              for r in order if self._slowest_count[r]],
        }}
