"""The routed experts' SwiGLU over tokens grouped by expert: one grouped GEMM per weight, or a loop.

``expert_swiglu(x, w1, w2, w3, counts, sizes)`` computes, for each expert e, the rows of ``x``
that belong to it (``counts[e]`` consecutive rows, expert by expert) through
``w2[e] @ (silu(w1[e] @ row) * (w3[e] @ row))``. Rows after ``sum(counts)`` are padding (the
assignments a capacity limit dropped are kept at the end so that no shape depends on the
routing): their output is zero and no gradient flows through them.

Two implementations, chosen per call by ``grouped_mm_problem`` (the reason for the loop is
logged once per device/dtype/reason):

- grouped: ``torch._grouped_mm`` with the per-expert offsets on the device, three calls per
  layer and no host synchronisation. torch 2.13 runs it on CUDA (bf16, SM >= 8.0) and on the
  CPU (fp32, bf16, fp16; measured equal to the loop, outputs and gradients). Its kernels need
  the row strides (``dim`` and ``hidden``) to be multiples of 16 bytes, and its meta/fake kernel
  accepts bf16 only (so fake tensors of another dtype take the loop).
- loop: one matmul per expert on ``torch.split`` chunks. The chunk sizes are host integers:
  ``sizes`` when the caller already has them (the expert-parallel dispatch does), else one
  ``counts.tolist()`` (one host sync).

Under autocast the grouped path casts its operands to the autocast dtype itself (autocast
has no rule for ``_grouped_mm``), so both paths compute in the same precision.
"""

from __future__ import annotations

import functools
import logging
from typing import List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

log = logging.getLogger(__name__)

# The grouped kernels read rows with 16-byte aligned strides.
_ALIGN_BYTES = 16
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.bfloat16,)
_CUDA_MIN_CAPABILITY = (8, 0)
_logged: Set[Tuple[str, str, str]] = set()

# "auto" picks the grouped GEMM where grouped_mm_problem allows it; "loop" forces the loop
# (tests compare the two; a user never needs it).
IMPLEMENTATIONS = ("auto", "loop")


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or is_fake(t)


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> Tuple[int, int]:
    # Asked once per device, not per MoE layer and step.
    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    device_type = t.device.type
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return t.dtype


def grouped_mm_problem(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> Optional[str]:
    """Why ``torch._grouped_mm`` cannot compute these experts here (None when it can).

    x [N, dim]; w1 [E, hidden, dim]; w2 [E, dim, hidden] (local shards)."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    dtype = _compute_dtype(x)
    if dtype != _compute_dtype(w1):
        return f"tokens ({dtype}) and expert weights ({_compute_dtype(w1)}) differ in dtype"
    fake = _is_fake(x) or _is_fake(w1)
    if fake and dtype != torch.bfloat16:
        return f"torch's meta kernel for _grouped_mm accepts bf16 only, got {dtype}"
    device_type = w1.device.type
    if not fake:
        if device_type == "cuda":
            if dtype not in _CUDA_DTYPES:
                return f"_grouped_mm on CUDA needs bf16, got {dtype}"
            index = w1.device.index if w1.device.index is not None else torch.cuda.current_device()
            if _cuda_capability(index) < _CUDA_MIN_CAPABILITY:
                return "_grouped_mm on CUDA needs compute capability >= 8.0"
        elif device_type == "cpu":
            if dtype not in _CPU_DTYPES:
                return f"_grouped_mm on the CPU supports fp32/bf16/fp16, got {dtype}"
        else:
            return f"_grouped_mm is not known to run on device type '{device_type}'"
    size = torch.empty((), dtype=dtype).element_size()
    dim, hidden = w1.shape[-1], w1.shape[-2]
    if (dim * size) % _ALIGN_BYTES or (hidden * size) % _ALIGN_BYTES:
        return (f"dim={dim} and hidden={hidden} must be multiples of {_ALIGN_BYTES // size} "
                f"for {dtype} (16-byte aligned rows)")
    return None


def _log_once(device_type: str, dtype: torch.dtype, reason: str) -> None:
    key = (device_type, str(dtype), reason)
    if key not in _logged:
        _logged.add(key)
        log.info("MoE experts use a per-expert loop instead of torch._grouped_mm (%s, %s): %s",
                 device_type, dtype, reason)


def _swiglu_loop(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                 sizes: List[int]) -> torch.Tensor:
    n_pad = x.shape[0] - sum(sizes)
    chunks = torch.split(x, list(sizes) + [n_pad], dim=0)
    outs = []
    for e, chunk in enumerate(chunks[:-1]):
        h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
        outs.append(h @ w2[e].t())
    # An expert with no token still runs on an empty chunk: that keeps its weights in the
    # graph, so every rank produces a (zero) gradient for every parameter and FSDP's
    # reduce-scatter sees the same tensors on all ranks.
    if n_pad:
        outs.append(outs[0].new_zeros(n_pad, w2.shape[1]))
    return torch.cat(outs, dim=0)


# torchao's fp8 grouped GEMM (the weight wrapper launcher/parallel/fp8.py puts on the experts)
# needs every expert's row group to be a multiple of 16 rows; torchao 0.18 refuses to pad them
# itself for fp8 (pad_token_groups_for_grouped_mm=True asserts), so the grouped path does.
_FP8_GROUP_ROWS = 16


def _fp8_wrapped(w: torch.Tensor) -> bool:
    # By name: the models floor does not import torchao.
    return type(w).__name__ == "Float8TrainingWeightWrapperTensor"


def _aligned_rows(counts: torch.Tensor, n_rows: int, align: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of the n_rows rows goes when every expert's group is padded to `align` rows.

    Returns (dest [n_rows] row index in the padded buffer, padded counts [E], padded buffer
    rows). The buffer size, n_rows + E*(align-1) rounded up to `align`, is a bound, so no shape depends on the routing
    and nothing syncs with the host; rows after sum(counts) land after the last padded group."""
    n_experts = counts.shape[0]
    padded = (counts + align - 1) // align * align
    ends, pends = torch.cumsum(counts, 0), torch.cumsum(padded, 0)
    rows = torch.arange(n_rows, device=counts.device)
    # Expert of each row (n_experts for the capacity padding after the last group).
    expert = torch.searchsorted(ends, rows, right=True)
    zero = counts.new_zeros(1)
    starts, pstarts = torch.cat([zero, ends]), torch.cat([zero, pends])
    dest = pstarts[expert] + rows - starts[expert]
    # The buffer's row count is a multiple of `align` too: torchao's weight-gradient GEMM
    # (grad_out^T @ x) takes the rows as its leading stride, which fp8 needs 16-byte aligned
    # ("strides should be multiple of 16 bytes" on an H100 otherwise).
    n_buf = -(-(n_rows + n_experts * (align - 1)) // align) * align
    return dest, padded, n_buf


def _swiglu_grouped(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    if _fp8_wrapped(w1):
        dest, padded, n_buf = _aligned_rows(counts, x.shape[0], _FP8_GROUP_ROWS)
        x_buf = x.new_zeros(n_buf, x.shape[1]).index_copy(0, dest, x)
        return _swiglu_grouped_aligned(x_buf, w1, w2, w3, padded)[dest]
    return _swiglu_grouped_aligned(x, w1, w2, w3, counts)


def _swiglu_grouped_aligned(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                            counts: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(x)
    x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    # Rows after offs[-1] (capacity padding) are left unwritten by the kernel: zero them on
    # the way in and out, so neither garbage values nor garbage gradients escape.
    valid = (torch.arange(x.shape[0], device=x.device) < offs[-1]).unsqueeze(-1)
    x = torch.where(valid, x, 0)
    h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
        x, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
    return torch.where(valid, y, 0)


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                  counts: torch.Tensor, sizes: Optional[List[int]] = None,
                  implementation: str = "auto") -> torch.Tensor:
    """The experts' SwiGLU on x [N, dim] grouped by expert (counts [E] rows each, padding after).

    ``sizes``: the same counts as host integers when the caller has them (saves the loop its
    host sync). ``implementation``: "auto" (grouped GEMM where it runs) or "loop"."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    problem = "forced by implementation='loop'" if implementation == "loop" else grouped_mm_problem(x, w1, w2)
    if problem is None:
        return _swiglu_grouped(x, w1, w2, w3, counts)
    if implementation == "auto":
        _log_once(w1.device.type, _compute_dtype(x), problem)
    if sizes is None:
        sizes = counts.tolist()  # the one host sync of this path
    return _swiglu_loop(x, w1, w2, w3, sizes)
