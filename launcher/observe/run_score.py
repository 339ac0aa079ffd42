"""Every run scored against its plan: measured tokens/s, MFU and peak memory next to the prediction.

At each log step the trainer adds `plan/tokens_per_s_ratio` (measured / predicted),
`plan/tokens_per_s_in_band` (1 when the measurement fell inside the plan's range, 0 otherwise)
and, where an MFU is measured (CUDA), `plan/mfu_ratio` to metrics.jsonl and W&B. At the end rank 0
writes <run_dir>/run_summary.json:

    {"figures": {"tokens_per_s_per_gpu": {"measured", "predicted", "ratio", "in_band", "range"},
                 "mfu": {...}, "peak_memory_bytes": {... per rank: "by_rank"}},
     "device": "cuda", "hardware": "h100_sxm", "band": {...}, "log_steps": 9, "note": "...",
     "environment": {"torch", "cuda", "nccl", "driver", "gpu", "gpu_count", "python"}}

`environment` (also in the W&B run's config) says what the run ran on, so a figure can be traced to
the torch, CUDA and NCCL build and the GPU that produced it.

`ratio` is measured / predicted. The measured tokens/s and MFU are medians over the logged
windows after the first (step 1 carries start-up and compilation). Peak memory is the caching
allocator's peak reserved bytes on each rank (torch.cuda.max_memory_reserved, as the plan's
memory band is of the allocator's share plus hardware.reserved_gb), on CUDA only: a CPU run's RSS
says nothing about a GPU plan. `bench/planner_accuracy.py --runs DIR...` reads these files into
the accuracy table, so a cluster's own runs calibrate the bands (docs/planner.md).
"""

from __future__ import annotations

import json
import platform
import re
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from launcher.observe.run_summary import RUN_SUMMARY_FILE, figure

NVIDIA_DRIVER_VERSION = Path("/proc/driver/nvidia/version")


def _driver_version() -> Optional[str]:
    """The NVIDIA kernel driver's version (e.g. 580.159.04), read from the driver's /proc file."""
    try:
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", NVIDIA_DRIVER_VERSION.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def environment() -> Dict[str, Any]:
    """The software and devices this rank runs on: torch, CUDA, NCCL, driver, GPU name and count."""
    env: Dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": None, "driver": None,
                           "gpu": None, "gpu_count": 0, "python": platform.python_version()}
    if torch.cuda.is_available():
        env["gpu_count"] = torch.cuda.device_count()
        env["gpu"] = torch.cuda.get_device_name()
        env["driver"] = _driver_version()
        try:
            env["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):  # a build without NCCL
            pass
    return env


class RunScore:
    """Measured vs planned for one run (each rank holds one; rank 0 writes the file)."""

    def __init__(self, run_dir: Path, plan_time: Dict[str, Any], plan_memory: Dict[str, Any], world_size: int,
                 device_type: str, hardware: str, rank: int):
        self.run_dir = Path(run_dir)
        self.time = plan_time or {}
        self.memory = plan_memory or {}
        self.world_size = world_size
        self.device_type = device_type
        self.hardware = hardware
        self.rank = rank
        self.tokens_per_s: List[float] = []
        self.mfu: List[float] = []
        self._first_step: Optional[int] = None
        self.extra: Dict[str, Any] = {}  # more sections for run_summary.json (the trainer's "goodput")

    def _predicted_tokens_per_gpu(self) -> Optional[float]:
        return self.time.get("tokens_per_s_per_gpu")

    def _tokens_band(self) -> Optional[List[float]]:
        band = self.time.get("tokens_per_s_range")
        return None if not band else [band[0] / self.world_size, band[1] / self.world_size]

    def observe(self, record: Dict[str, Any]) -> Dict[str, float]:
        """The plan/* metrics for one logged step (and remember it for the summary)."""
        measured = record["tokens_per_s"] / self.world_size
        if self._first_step is None:
            self._first_step = record["step"]
        elif record["step"] != self._first_step:
            self.tokens_per_s.append(measured)
            if "mfu" in record:
                self.mfu.append(record["mfu"])
        out: Dict[str, float] = {}
        tokens = figure(measured, self._predicted_tokens_per_gpu(), self._tokens_band())
        if tokens["ratio"] is not None:
            out["plan/tokens_per_s_ratio"] = tokens["ratio"]
            out["plan/tokens_per_s_in_band"] = float(bool(tokens["in_band"]))
        if "mfu" in record and self.time.get("mfu"):
            out["plan/mfu_ratio"] = record["mfu"] / self.time["mfu"]
        return out

    def summary(self, peaks_by_rank: Optional[List[Optional[int]]]) -> Dict[str, Any]:
        """run_summary.json's content (peaks_by_rank: each rank's peak reserved bytes, or None)."""
        tokens = statistics.median(self.tokens_per_s) if self.tokens_per_s else None
        mfu_measured = statistics.median(self.mfu) if self.mfu else None
        mfu_band = None
        if self.time.get("mfu") and self.time.get("tokens_per_s_range") and self.time.get("tokens_per_s"):
            scale = self.time["mfu"] / self.time["tokens_per_s"]  # MFU is proportional to tokens/s
            mfu_band = [x * scale for x in self.time["tokens_per_s_range"]]
        peaks = [p for p in (peaks_by_rank or []) if p is not None]
        memory = figure(max(peaks) if peaks else None, self.memory.get("total"), self.memory.get("total_range"))
        if peaks:
            memory["by_rank"] = peaks_by_rank
        note = ("medians over the logged windows after the first; peak memory is "
                "torch.cuda.max_memory_reserved on the most loaded rank")
        if self.device_type != "cuda":
            note = (f"this run ran on {self.device_type}, the plan is for hardware={self.hardware}: the ratios say how "
                    f"far this machine is from that GPU, not how good the plan is; no MFU or GPU memory is measured")
        return {
            "figures": {
                "tokens_per_s_per_gpu": figure(tokens, self._predicted_tokens_per_gpu(), self._tokens_band()),
                "mfu": figure(mfu_measured, self.time.get("mfu"), mfu_band),
                "peak_memory_bytes": memory,
            },
            "device": self.device_type,
            "hardware": self.hardware,
            "world_size": self.world_size,
            "band": self.time.get("band"),
            "log_steps": len(self.tokens_per_s),
            "note": note,
            "environment": environment(),
            **self.extra,
        }

    def finish(self) -> Optional[Path]:
        """Gather each rank's peak memory (a collective: every rank calls it) and, on rank 0,
        write run_summary.json atomically."""
        peaks = gather_peaks(self.device_type)
        if self.rank != 0:
            return None
        path = self.run_dir / RUN_SUMMARY_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.summary(peaks), indent=1))
        tmp.replace(path)
        return path


def gather_peaks(device_type: str) -> List[Optional[int]]:
    """Every rank's peak reserved CUDA bytes (None per rank off CUDA), in rank order."""
    mine = int(torch.cuda.max_memory_reserved()) if device_type == "cuda" else None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out
