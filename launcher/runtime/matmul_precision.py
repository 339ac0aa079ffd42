"""TF32 tensor cores for fp32 runs on CUDA (``precision.tf32``).

PyTorch leaves ``torch.backends.cuda.matmul.allow_tf32`` off by default, so an fp32 run's matmuls
would use the plain FP32 rate (67 TFLOP/s dense on an H100 SXM) instead of TF32 tensor cores
(495): the planner costs fp32 runs at ``hardware.tf32_tflops``, and this makes the runtime match.
TF32 keeps fp32's range with a 10-bit mantissa in the multiply (accumulation stays fp32);
``precision.tf32=false`` keeps full fp32 multiplies for numerics comparisons.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def apply_matmul_precision(precision: str, tf32: bool, device_type: str) -> bool:
    """Set the TF32 switches for an fp32 run on CUDA; return whether TF32 is on.

    Other precisions and devices are left as they are (bf16/fp8 runs do their block matmuls
    in low precision already; CPUs have no TF32)."""
    if precision != "fp32" or device_type != "cuda":
        return False
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    if tf32:
        log.info("precision=fp32 on cuda: matmuls and convolutions use TF32 tensor cores "
                 "(precision.tf32=true; set precision.tf32=false for full fp32 multiplies)")
    else:
        log.info("precision=fp32 on cuda with precision.tf32=false: full fp32 matmuls (the plan's "
                 "time assumes TF32 and is optimistic)")
    return tf32
