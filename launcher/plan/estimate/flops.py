"""Training FLOPs per token and MFU: the one place these formulas live.

Pure Python (no torch): the planner, the runtime's MFU metric and bench/ all import it.

    flops per token = 6 * N_matmul + 12 * L * h * s

- 6 * N_matmul: forward 2 FLOPs per weight per token (multiply + add), backward twice that
  (gradient w.r.t. the input and w.r.t. the weight). N_matmul counts the parameters a token
  multiplies with: the active parameters (for MoE: top-k routed + shared experts + router),
  without the input embedding table, since a lookup is not a matmul. With tied embeddings
  the table is also the output projection, so it is counted once.
- 12 * L * h * s: attention scores QK^T and the weighted sum with V, each 2 * s * h per token
  per layer forward, times 3 for forward + backward (s = sequence length; h = heads x head size,
  the model dim for Llama; with different q.k and v widths, as in MLA, their mean: the widths
  come from the family's attention layout, launcher/models/<family>/params.py attention_layout).
  The full s x s product is counted, as in the PaLM / Megatron MFU convention, even though
  a causal kernel skips about half of it: MFU numbers stay comparable with published ones.

Recomputation (activation checkpointing) is not counted: MFU measures useful model FLOPs,
so recomputing costs MFU instead of inflating it (that would be HFU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.plan.estimate.params import attention_width, model_shape


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter the model holds
    active: int  # parameters one token touches (MoE: top-k routed + shared experts)
    embedding: int  # the input embedding table (vocab x dim)
    matmul_active: int  # active parameters used in matmuls: `active` minus the embedding lookup


def param_counts(model: Any) -> ParamCounts:
    """Parameter counts from a model shape (a ModelConfig or anything with its fields).

    The per-component breakdown is launcher.plan.estimate.params.model_shape (one parameter model for
    the planner and for FLOPs); this adds the matmul count FLOPs need.
    """
    shape = model_shape(model)
    # Tied: the one table is used as the output matmul, so it stays in the matmul count;
    # untied: the input table is only looked up.
    lookup_only = 0 if shape.tie_embeddings else shape.embedding
    return ParamCounts(
        total=shape.total,
        active=shape.active,
        embedding=shape.embedding,
        matmul_active=shape.active - lookup_only,
    )


def attention_flops_per_token(n_layers: int, width: float, seq_len: int) -> float:
    """12 * L * h * s: attention-score FLOPs per token, forward + backward; `width` is h, the
    mean of the q.k width and the v width (launcher.plan.estimate.params.attention_width)."""
    return 12.0 * n_layers * width * seq_len


def training_flops_per_token(model: Any, seq_len: int) -> float:
    """Model FLOPs to train on one token (forward + backward), see the module docstring."""
    n = param_counts(model).matmul_active
    shape = model_shape(model)
    # Each multi-token-prediction depth runs one more block's attention (its matmuls are in `n`).
    return 6.0 * n + attention_flops_per_token(int(model.n_layers) + shape.mtp_depths, attention_width(shape), seq_len)


def achieved_tflops(tokens_per_s: float, flops_per_token: float) -> float:
    """Useful model TFLOP/s (per device when tokens_per_s is per device)."""
    return tokens_per_s * flops_per_token / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s / dense peak FLOP/s (same device count)."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops must be > 0 to compute MFU, got {peak_tflops}")
    return achieved_tflops(tokens_per_s, flops_per_token) / peak_tflops


def peak_tflops(hw: Any, precision: str) -> float:
    """Dense peak TFLOP/s of a GPU type (HardwareConfig) for the precision in use: MFU's denominator."""
    if precision == "fp32":
        return float(hw.tf32_tflops)  # fp32 matmuls run on the TF32 tensor cores
    return float(hw.fp8_tflops if precision == "fp8" else hw.bf16_tflops)
