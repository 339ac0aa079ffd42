"""The local GPUs, without importing torch: how many are visible, and which conf/hardware entry
describes a GPU by the name CUDA gives it.

    visible_gpu_count()                        # the driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES
    hardware_for_gpu("NVIDIA H100 80GB HBM3")  # -> "h100_sxm"

The host side of `train` imports no torch (tests/test_host_side.py), so a local run's
`trainer.device` (launcher/cli.py) and the real-tensor rehearsal's device checks
(launcher/rehearse/local_device.py) count GPUs from the driver's files. The name table is the
one place that maps a GPU to its `hardware` entry: the rehearsal refuses a GPU that is not the
plan's, and the GPU benchmarks (bench/gpu_throughput.py, bench/gpu_acceptance.py) pick theirs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU while NVIDIA's driver is loaded
DEV = Path("/dev")  # /dev/nvidia0, /dev/nvidia1, ...: what a container or VM without the /proc folder has


def visible_gpu_count(gpus_dir: Path = NVIDIA_GPUS, dev_dir: Path = DEV) -> int:
    """The NVIDIA GPUs the ranks would see, without importing torch (the host side stays light):
    the driver's GPU folders (else its /dev/nvidiaN device files), narrowed by
    CUDA_VISIBLE_DEVICES when it is set."""
    try:
        present = sum(1 for _ in Path(gpus_dir).iterdir())
    except OSError:  # no /proc folder: count the device files
        present = sum(1 for p in Path(dev_dir).glob("nvidia[0-9]*") if p.name[len("nvidia"):].isdigit())
    if present == 0:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    # CUDA stops at the first invalid entry ("-1" hides every GPU).
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return min(count, present)


# A fragment of torch.cuda.get_device_name() -> the conf/hardware entry; the first match wins
# (H200 before H100: neither name contains the other, but keep the more specific first).
GPU_HARDWARE = (("H200", "h200"), ("H100", "h100_sxm"), ("B200", "b200"), ("A100", "a100_80gb"))


def hardware_for_gpu(gpu_name: str) -> Optional[str]:
    """The conf/hardware entry of a GPU by its CUDA name, or None when no entry describes it."""
    return next((hw for fragment, hw in GPU_HARDWARE if fragment in gpu_name), None)
