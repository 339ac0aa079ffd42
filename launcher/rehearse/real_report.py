"""The real-tensor rehearsal's report on the host (no torch): each rank's figures beside the plan's,
their label, and rehearsal_summary.json.

    row["real"] = real_row(rank_report["real"], predicted_time_for_rank(...), predicted_peaks_for_rank(...))
    result["real"] = real_label(device, gpu, hardware)
    summary = real_summary(result, plan, hardware)   # -> rehearsal_summary.json

launcher/rehearse/real.py measures a rank (in its process); launcher/rehearse/driver.py calls these
and renders the table. rehearsal_summary.json has run_summary.json's figures
(launcher/observe/run_summary.py), so bench/planner_accuracy.py reads it like a run's.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from launcher.gpus import hardware_for_gpu
from launcher.observe.run_summary import figure
from launcher.plan.present.plan import Plan

# run_summary.json's figures for the ranks of a real-tensor rehearsal, in its run dir
REHEARSAL_SUMMARY_FILENAME = "rehearsal_summary.json"


def _ratio(measured: Optional[float], planned: Optional[float]) -> Optional[float]:
    return None if measured is None or not planned else measured / planned


def real_row(real: Dict[str, Any], planned_time: Dict[str, float], planned_peaks: Dict[str, int]) -> Dict[str, Any]:
    """A rank's `real` entry: what it measured (launcher/rehearse/real.py) with the plan's compute
    time and peaks for that rank beside it, and measured/planned ratios."""
    time_s = real["time_s"]
    return {
        **real,
        "planned": {"microbatch_s": planned_time["microbatch_s"], "compute_s": planned_time["compute_s"],
                    "optimizer_s": planned_time["optimizer_s"], "peak_allocated": planned_peaks["allocated"],
                    "peak_reserved": planned_peaks["reserved"], "total": planned_peaks["total"]},
        "ratio": {"compute": _ratio(real["compute_s"], planned_time["compute_s"]),
                  "optimizer": _ratio(time_s.get("optimizer"), planned_time["optimizer_s"]),
                  "peak_allocated": _ratio(real["peak_allocated"], planned_peaks["allocated"]),
                  "peak_reserved": _ratio(real["peak_reserved"], planned_peaks["reserved"])},
    }


def real_label(device: str, gpu: str, hardware: str) -> Dict[str, Any]:
    """What the real-tensor figures ran on: the GPU's name and whether it is the plan's `hardware`
    (rehearse.allow_other_gpu=true lets another one run: its figures say so)."""
    matches = device == "cuda" and hardware_for_gpu(gpu) == hardware
    label = (f"measured on {gpu}" + ("" if matches else f", not the plan's hardware={hardware}")
             if device == "cuda" else f"measured on this CPU, not the plan's hardware={hardware}")
    return {"device": device, "gpu": gpu, "hardware": hardware, "gpu_is_hardware": matches, "label": label}


def real_summary(result: Dict[str, Any], plan: Plan, hardware: str) -> Dict[str, Any]:
    """rehearsal_summary.json: run_summary.json's figures (launcher/observe/run_score.py) for a
    real-tensor rehearsal, so bench/planner_accuracy.py --fit reads it like a run's. Tokens/s per
    GPU is on the compute basis (`basis`: the fake process group sends nothing, so no
    communication and no bubble): the step's tokens per GPU over the slowest rehearsed rank's
    compute and optimizer time, against the plan's compute and optimizer time. Peak memory: the
    largest max_memory_reserved (GPU only, as a run's), against the plan's total."""
    rows = [r for r in result["ranks"] if r.get("real")]
    tokens_per_gpu = plan.time["tokens_per_step"] / plan.layout.mesh.world_size
    measured_s = max((r["real"]["compute_s"] + r["real"]["time_s"].get("optimizer", 0.0) for r in rows), default=None)
    planned_s = plan.time["compute_s"] + plan.time["optimizer_s"]
    reserved = [r["real"]["peak_reserved"] for r in rows if r["real"]["peak_reserved"] is not None]
    label = result["real"]
    memory = figure(max(reserved) if reserved else None, plan.memory.get("total"), plan.memory.get("total_range"))
    if reserved:
        memory["by_rank"] = {str(r["rank"]): r["real"]["peak_reserved"] for r in rows}
    return {
        "figures": {
            "tokens_per_s_per_gpu": figure(tokens_per_gpu / measured_s if measured_s else None,
                                           tokens_per_gpu / planned_s if planned_s else None, None),
            "mfu": figure(None, None, None),
            "peak_memory_bytes": memory,
        },
        "source": "rehearsal",
        "basis": "compute",
        "device": label["device"],
        "hardware": hardware,
        "gpu": label["gpu"],
        "gpu_is_hardware": label["gpu_is_hardware"],
        "world_size": plan.layout.mesh.world_size,
        "ranks": [r["rank"] for r in rows],
        "note": (f"real-tensor rehearsal ({label['label']}) on a fake process group: tokens/s per GPU from "
                 f"compute + optimizer time only (no communication, no bubble), against the plan's "
                 f"compute_s + optimizer_s; peak memory is torch.cuda.max_memory_reserved (GPU only)"),
        "environment": rows[0]["real"].get("environment") if rows else None,
    }
