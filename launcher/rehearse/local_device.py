"""What `rehearse.tensors=real` checks of this machine before any rank is built. No torch here.

    device = local_device(spec.rehearse.device)          # {"device", "gpu", "memory_bytes", ...}
    problems = local_device_problems(spec, plan, ranks, device)

The host side of `train` imports no torch (tests/test_host_side.py): the GPU's name and memory
come from a subprocess of this interpreter (the one the rank processes are forked from), and
only after the torch-free count of visible GPUs (launcher/launch/local.py) found one. The
problems are the issue's exit-2 cases, each with a Fix: `rehearse.device=cuda` without a
visible GPU; a local GPU that is not the plan's `hardware` entry (unless
`rehearse.allow_other_gpu=true`: the figures are then labelled with the GPU they ran on); a
chosen rank that needs more memory than the local device has (the plan's peak for that rank,
the CUDA reserve included on a GPU; this host's physical memory for `rehearse.device=cpu`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

from launcher.config.schema import JobConfig
from launcher.gpus import hardware_for_gpu, visible_gpu_count
from launcher.plan.estimate.memory import GiB
from launcher.plan.present.plan import Plan
from launcher.rehearse.ranks import predicted_peaks_for_rank

# Run in a subprocess: the first visible GPU's name and memory (the rank processes use cuda:0).
_GPU_PROBE = (
    "import json, torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "p = torch.cuda.get_device_properties(0) if n else None\n"
    "print(json.dumps({'count': n, 'name': p.name if p else None, 'memory_bytes': p.total_memory if p else None}))\n"
)
PROBE_TIMEOUT_S = 120


def _probe_gpu() -> Dict[str, Any]:
    """{count, name, memory_bytes} of the first GPU this interpreter's torch sees (the rank
    processes are forked from a server of this interpreter), or {"error": why} when the probe fails."""
    try:
        proc = subprocess.run([sys.executable, "-c", _GPU_PROBE], capture_output=True, text=True,
                              timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def host_memory_bytes() -> Optional[int]:
    """This host's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def local_device(device: str) -> Dict[str, Any]:
    """What `device` is on this machine: {"device", "gpu" (the CUDA name, or "cpu"),
    "memory_bytes", "visible" (GPUs the driver shows; cuda only), "error" (why a GPU could not be
    probed, else absent)}. No GPU is probed when none is visible."""
    if device != "cuda":
        return {"device": device, "gpu": "cpu", "memory_bytes": host_memory_bytes()}
    visible = visible_gpu_count()
    out: Dict[str, Any] = {"device": device, "gpu": None, "memory_bytes": None, "visible": visible}
    if visible:
        got = _probe_gpu()
        if "error" in got or not got.get("count"):
            out["error"] = got.get("error") or "torch sees no CUDA device"
        else:
            out.update(gpu=got["name"], memory_bytes=int(got["memory_bytes"]))
    return out


def rank_need_bytes(plan: Plan, rank: int, device: str) -> int:
    """The plan's memory for `rank` (its pipeline rank's peak): the CUDA reserve included on a
    GPU, left out on the CPU (no CUDA context there)."""
    peaks = predicted_peaks_for_rank(plan.layout, plan.memory, rank)
    return peaks["total"] if device == "cuda" else peaks["reserved"]


def local_device_problems(spec: JobConfig, plan: Plan, ranks: Sequence[int], device: Dict[str, Any]) -> List[str]:
    """The exit-2 problems of rehearsing `ranks` with real tensors on `device` (local_device's
    answer), each with a Fix; [] when the rehearsal can start."""
    r = spec.rehearse
    if r.device == "cuda" and not device.get("visible"):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = " (CUDA_VISIBLE_DEVICES=" + visible + ")" if visible is not None else ""
        return [f"rehearse.device=cuda: this machine has no visible GPU{seen}. Fix: run on a machine with a GPU, "
                f"or rehearse.device=cpu (real tensors on the CPU) or rehearse.tensors=fake (any model size)."]
    if r.device == "cuda" and device.get("error"):
        return [f"rehearse.device=cuda: {device['visible']} GPU(s) are visible but torch cannot use them "
                f"({device['error']}). Fix: check the CUDA build of torch and the driver (`python -c \"import torch; "
                f"print(torch.cuda.is_available())\"`), or rehearse.device=cpu."]
    problems: List[str] = []
    if plan.layout.owners.sharding_backend == "deepspeed":
        problems.append("rehearse.tensors=real: DeepSpeed layouts have no real-tensor rehearsal (DeepSpeed's forward "
                        "does not run on a fake process group). Fix: rehearse.tensors=fake (DeepSpeed's partitions), "
                        "or backend.sharding=native.")
    name = device.get("gpu") or "cpu"
    if r.device == "cuda" and not r.allow_other_gpu:
        entry = hardware_for_gpu(name)
        if entry != spec.hardware.name:
            fix = (f"hardware={entry} (plan for this GPU), or " if entry else "")
            problems.append(
                f"rehearse.device=cuda: the local GPU is {name}"
                + (f" (hardware={entry})" if entry else " (no conf/hardware entry describes it)")
                + f" but the plan is for hardware={spec.hardware.name}, so its times would not test that plan. "
                f"Fix: {fix}rehearse.allow_other_gpu=true (the figures are then labelled with {name}).")
    capacity = device.get("memory_bytes")
    if capacity:
        where = f"the local GPU ({name})" if r.device == "cuda" else "this host's memory"
        for rank in ranks:
            need = rank_need_bytes(plan, rank, r.device)
            if need > capacity:
                pp = plan.layout.mesh.coordinates(rank)["pp"]
                problems.append(
                    f"rehearse.tensors=real: rank {rank} (pipeline rank {pp}) needs {need / GiB:.1f} GiB by the plan"
                    + (" (its peak with the CUDA reserve)" if r.device == "cuda" else "")
                    + f" but {where} has {capacity / GiB:.1f} GiB. Fix: rehearse.ranks= ranks that fit, a layout that "
                    f"holds less per rank (`train ... action=search`), a device with more memory, or "
                    f"rehearse.tensors=fake (any size).")
    return problems
