"""Straggler detection: per log step, every rank's busy time, the spread over ranks, the slowest host.

Each rank measures its busy time per step: the CPU time of its main thread on CPU (a rank
waiting for a slow peer inside a collective sleeps, so it is not charged for the peer's
slowness), the wall time on GPU (where kernels run asynchronously; there it mostly shows
host-side stalls). On each log step one small all-gather (one float per rank) collects the
mean since the last log step; rank 0 logs step_time_min_s / step_time_median_s /
step_time_max_s, slowest_rank and slowest_host. A rank over trainer.straggler_factor x the
other ranks' median for trainer.straggler_checks log steps in a row is warned about with its host
name, and the run summary lists the slowest hosts. With `exclude` (trainer.straggler_action) every
rank then raises NodeBlamed (kind "straggler"; every rank sees the same gathered times, so all
end together): the failure bundle names the node and the restart decision excludes it.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from launcher.resilience.failure import NodeBlamed

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
        self._streak = [0] * len(hosts)
        self._slowest_count = [0] * len(hosts)
        self._warned: Dict[int, Dict[str, Any]] = {}
        self._observed = 0

    def _clock(self) -> float:
        return time.perf_counter() if self.device.type == "cuda" else time.thread_time()

    def step_started(self) -> None:
        self._t0 = self._clock()

    def step_finished(self) -> None:
        self._busy += self._clock() - self._t0
        self._steps += 1

    def observe(self, step: int) -> Dict[str, Any]:
        """On a log step (every rank, collective): the spread of busy time over ranks."""
        mine = self._busy / max(1, self._steps)
        self._busy, self._steps = 0.0, 0
        t = torch.tensor([mine], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(out, t)
            times = [float(x) for x in out]
        else:
            times = [mine]
        return self.judge(step, times)

    def judge(self, step: int, times: List[float]) -> Dict[str, Any]:
        """Every rank's busy time of one log step (rank order) -> the metrics; warns, and with
        `exclude` raises NodeBlamed, when ranks have been over the factor for `checks` log steps in a row."""
        median = statistics.median(times)
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
                              "why": f"{value:.3f} s per step, {value / others:.1f}x the other ranks' median "
                                     f"{others:.3f} s, for {self.checks} log steps in a row (trainer.straggler_factor="
                                     f"{self.factor:g})"})
        self._observed += 1
        if named and self.exclude:
            what = "; ".join(f"rank {n['rank']} on {n['host']}: {n['why']}" for n in named)
            raise NodeBlamed("straggler", named, f"straggler at step {step}: {what}. Its node is excluded on a restart "
                                                 f"(cluster.spare_nodes) or from the requeued job; Fix: "
                                                 f"trainer.straggler_action=warn only warns")
        return {"step_time_min_s": min(times), "step_time_median_s": median, "step_time_max_s": max(times),
                "slowest_rank": slowest, "slowest_host": self.hosts[slowest]}

    def _warn(self, step: int, r: int, value: float, median: float) -> None:
        log.warning("straggler: rank %d on host %s took %.3f s per step, %.1fx the other ranks' median %.3f s, for %d log steps "
                    "in a row (trainer.straggler_factor=%g)", r, self.hosts[r], value, value / median, median,
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
