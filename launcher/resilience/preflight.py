"""Pre-flight health check: before the first step (so after every in-job restart too), every rank
runs a short probe; a node that computes wrongly or slowly, or moves data slowly, is named before
it wastes the allocation.

The probe (well under a second on CPU):
- compute: a fixed matmul of small integers (exact in fp32 and TF32), repeated, on the rank's
  device; its result is checked against the product in float64 on the CPU, and the best of a
  few timings kept. On CPU the matmuls run on one thread timed by its CPU time (ranks sharing
  cores are not charged for each other), on GPU wall time around a synchronize (the device computes).
- all-reduce: the bus bandwidth (nccl-tests' 2(n-1)/n x bytes / time) of all-reduces over the
  world on the default group (gloo on CPU, NCCL on GPU), best of a few timings from a barrier.

Every rank gathers every rank's numbers and reaches the same verdict (`verdict`): a rank whose
result is wrong, whose compute time is over trainer.health_factor x the other ranks' median, or
whose bandwidth is under the other ranks' median / trainer.health_factor, names its node. The
ranks then all raise NodeBlamed (kind "health"): the failure bundle names the node and the
restart decision excludes it (launcher/resilience/node_exclusion.py). Rank 0 logs one line per
probe and appends a "health" event with every rank's numbers to resilience.jsonl.

A slow link slows the whole ring of an all-reduce, so every rank sees the same bandwidth: the
bandwidth names a node only where its ranks' own numbers stand out (the numbers are logged either way).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from launcher.resilience import debug_hooks
from launcher.resilience.failure import NodeBlamed
from launcher.resilience.restarts import append_event

log = logging.getLogger(__name__)

# The probe matmul's size and repeats per timing: milliseconds of work, enough for the clock to resolve.
MATMUL_N = {"cpu": 256, "cuda": 2048}
MATMUL_REPEATS = {"cpu": 8, "cuda": 20}
TIMINGS = 3  # best of: one-off noise (a page fault, a context switch) is not a sick node
ALLREDUCE_BYTES = {"cpu": 2 << 20, "cuda": 64 << 20}
# All-reduces per timing: the ranks leave the barrier a little apart, and that skew, counted once
# per timing, must stay small beside the transfers (one all-reduce alone can look 2x slow on one rank).
ALLREDUCE_ITERS = 5
# Below this difference from the others' median a compute time is noise (cache, CPU frequency,
# thread-pool spinning on shared cores), whatever the ratio: a few ms of work cannot judge finer.
MIN_COMPUTE_GAP_S = {"cpu": 0.02, "cuda": 0.001}
CHECKED_ROWS = 8  # rows compared exactly with the float64 product (all of it would cost seconds at n=2048)


def _operands(n: int):
    """Two fixed integer matrices (values -3..3 and -2..2): their product (entries under 2^24 up to
    n = 2^20) is exact in fp32 and with TF32 inputs."""
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    return ((i * 7 + j * 3) % 7 - 3).double(), ((i * 5 + j * 11) % 5 - 2).double()


def probe(device, rank: int) -> Dict[str, Any]:
    """This rank's numbers: compute_s, compute_ok, max_abs_error, allreduce_gbps (collective: every rank)."""
    kind = device.type
    n = MATMUL_N.get(kind, MATMUL_N["cpu"])
    a64, b64 = _operands(n)
    a, b = a64.float().to(device), b64.float().to(device)
    # CPU: one thread, timed by its own CPU time. Not the process's CPU time: idle OpenMP workers
    # spin, and on loaded cores their spinning made a healthy rank's probe look 50x slow.
    clock = time.perf_counter if kind == "cuda" else time.thread_time
    threads = torch.get_num_threads()
    if kind != "cuda":
        torch.set_num_threads(1)
    try:
        best, out = _timed_matmuls(a, b, kind, rank, clock)
    finally:
        torch.set_num_threads(threads)
    result = out.double().cpu()
    if debug_hooks.probe_fails(rank):
        result[0, 0] += 1.0
    # The first rows exactly, and every entry through the total: sum(A @ B) = colsums(A) . rowsums(B).
    error = max(float((result[:CHECKED_ROWS] - a64[:CHECKED_ROWS] @ b64).abs().max()),
                abs(float(result.sum()) - float(a64.sum(0) @ b64.sum(1))))
    numbers = {"rank": rank, "matmul_n": n, "compute_s": round(best, 6), "compute_ok": error == 0.0, "max_abs_error": error,
               "device": torch.cuda.get_device_name(device) if kind == "cuda" else "cpu"}
    numbers["allreduce_gbps"] = _allreduce_gbps(device) if dist.is_initialized() and dist.get_world_size() > 1 else None
    return numbers


def _timed_matmuls(a, b, kind: str, rank: int, clock):
    """(best time of TIMINGS, the last product): MATMUL_REPEATS products of a and b per timing."""
    best, out = float("inf"), None
    for _ in range(TIMINGS):
        if kind == "cuda":
            torch.cuda.synchronize(a.device)
        t0 = clock()
        for _ in range(MATMUL_REPEATS.get(kind, MATMUL_REPEATS["cpu"]) * debug_hooks.probe_slowdown(rank)):
            out = a @ b
        if kind == "cuda":
            torch.cuda.synchronize(a.device)
        best = min(best, clock() - t0)
    return best, out


def straggler_probe_s(device, rank: int) -> float:
    """The probe's MATMUL_REPEATS matmuls once on this rank's GPU, timed by CUDA events (seconds).
    No collective and no host clock: what a rank's GPU alone takes, which the straggler check
    judges every log step (launcher/resilience/stragglers.py). The operands are made on the device
    (the values do not matter to the time; the pre-flight probe checks them); the 3 x 16 MiB come
    from the allocator's cache after the first log step. LAUNCHER_DEBUG_PROBE=R:slow repeats them."""
    n = MATMUL_N["cuda"]
    a = torch.ones(n, n, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(MATMUL_REPEATS["cuda"] * debug_hooks.probe_slowdown(rank)):
        out = torch.mm(a, a)
    end.record()
    end.synchronize()
    del out
    return start.elapsed_time(end) / 1000.0


def _allreduce_gbps(device) -> float:
    """Bus bandwidth of an all-reduce over the world, GB/s (best of TIMINGS, after a warm-up)."""
    n = dist.get_world_size()
    tensor = torch.ones(ALLREDUCE_BYTES.get(device.type, ALLREDUCE_BYTES["cpu"]) // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    best = float("inf")
    for _ in range(TIMINGS):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(ALLREDUCE_ITERS):
            dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - t0) / ALLREDUCE_ITERS)
    return round(2 * (n - 1) / n * tensor.numel() * 4 / best / 1e9, 4)


def _median_of_others(values: List[float], r: int) -> Optional[float]:
    others = values[:r] + values[r + 1:]
    return statistics.median(others) if others else None


def verdict(results: List[Dict[str, Any]], factor: float) -> List[Dict[str, Any]]:
    """The ranks the probe names, each {rank, host, why} (empty: all healthy). Torch-free.

    Each rank is compared with the median of the OTHER ranks (with two ranks the slow one would
    otherwise move the median of both halfway to itself).
    """
    bad = []
    times = [float(r["compute_s"]) for r in results]
    gap = MIN_COMPUTE_GAP_S["cpu" if all(r.get("device", "cpu") == "cpu" for r in results) else "cuda"]
    bandwidths = [r.get("allreduce_gbps") for r in results]
    for i, r in enumerate(results):
        why = []
        if not r["compute_ok"]:
            why.append(f"wrong matmul result (max abs error {r.get('max_abs_error')})")
        others = _median_of_others(times, i)
        if others is not None and times[i] > factor * others and times[i] - others > gap:
            why.append(f"compute {times[i]:.4f} s is {times[i] / max(others, 1e-12):.1f}x the other ranks' median "
                       f"{others:.4f} s")
        if all(b is not None for b in bandwidths):
            others_bw = _median_of_others([float(b) for b in bandwidths], i)
            if others_bw is not None and float(bandwidths[i]) * factor < others_bw:
                why.append(f"all-reduce {bandwidths[i]:.3f} GB/s is under 1/{factor:g} of the other ranks' "
                           f"median {others_bw:.3f} GB/s")
        if why:
            bad.append({"rank": r["rank"], "host": r.get("host"), "why": "; ".join(why)})
    return bad


def numbers_line(results: List[Dict[str, Any]]) -> str:
    """One log line: every rank's numbers, grouped by node."""
    parts = []
    for r in results:
        bw = f", all-reduce {r['allreduce_gbps']:.3f} GB/s" if r.get("allreduce_gbps") is not None else ""
        ok = "ok" if r["compute_ok"] else f"WRONG (error {r.get('max_abs_error')})"
        parts.append(f"{r.get('host')}/rank {r['rank']}: matmul {r['compute_s'] * 1e3:.2f} ms {ok}{bw}")
    return "; ".join(parts)


def run_preflight(device, rank: int, world_size: int, host: str, factor: float, run_dir: Path,
                  restart: int = 0) -> List[Dict[str, Any]]:
    """Probe, gather, judge (every rank); rank 0 logs the numbers and appends the "health" event.

    Raises NodeBlamed (kind "health") on every rank when a rank is named; returns every rank's numbers otherwise.
    """
    started = time.perf_counter()
    mine = dict(probe(device, rank), host=host)
    if dist.is_initialized() and world_size > 1:
        results: List[Any] = [None] * world_size
        dist.all_gather_object(results, mine)
    else:
        results = [mine]
    bad = verdict(results, factor)
    if rank == 0:
        line = numbers_line(results)
        (log.error if bad else log.info)("health check (%.2f s, trainer.health_factor=%g): %s", time.perf_counter() - started,
                                         factor, line)
        append_event(run_dir, {"event": "health", "node": host, "rank": rank, "ok": not bad,
                               "factor": factor, "ranks": results, "named": bad,
                               "restart": restart})
    if bad:
        what = "; ".join(f"rank {b['rank']} on {b['host']}: {b['why']}" for b in bad)
        raise NodeBlamed("health", bad, f"health check failed before the first step: {what}. Fix: the node is "
                                        f"excluded on a restart (cluster.spare_nodes) or from the requeued job; "
                                        f"trainer.health_check=off skips the check")
    return results
