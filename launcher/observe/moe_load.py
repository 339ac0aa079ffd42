"""Expert load metrics (`moe/*`) from per-layer routed-token counts, dropped counts and aux losses.

Pure math on tensors already summed over ranks (launcher/observe/moe_health.py does the one
all-reduce). Definitions, for the MoE layers that routed tokens in the window:

- `moe/tokens_per_expert_cv`: per layer, std / mean of the assignments per expert (population
  std, so a perfectly balanced layer gives 0), then the mean over layers;
- `moe/tokens_per_expert_max_over_mean`: per layer, the busiest expert's assignments over the
  mean (1 = balanced, at most n_experts / top_k), then the mean over layers;
- `moe/dropped_frac`: assignments dropped by the capacity limit over all assignments, summed
  over layers (0 by construction for a dropless model, `model.capacity_factor <= 0`);
- `moe/aux_loss` (also `moe/aux_loss_per_layer`): per layer, the mean over its forwards of the
  load-balancing loss the model adds (coef * n_experts * sum_e f_e P_e, unscaled), then the mean
  over layers. The engines' `moe_aux_loss` (also `moe/aux_loss_total`) is that loss summed over
  the layers, for the step's last micro-batch: about n_layers times this one.

All four are ratios or means, so counting the same tokens on several ranks (tensor-parallel
ranks, recomputed forwards under activation checkpointing) does not change them.

Per layer (`layer_metrics`, keyed by the block's index in the whole model):

- `moe/layer<i>/tokens_per_expert_max_over_mean`: layer i's busiest expert over the mean (the
  per-layer value that `moe/tokens_per_expert_max_over_mean` averages);
- `moe/layer<i>/bias_spread`: max - min of layer i's e_score_correction_bias (DeepSeek-V3's
  aux-loss-free balancing; only layers whose router has one), and `moe/bias_spread`, the mean
  over those layers. 0 until the bias moves; it grows while the router keeps favouring experts.
"""

from __future__ import annotations

from typing import Dict

import torch

KEYS = ("moe/tokens_per_expert_cv", "moe/tokens_per_expert_max_over_mean", "moe/dropped_frac", "moe/aux_loss")

# The two aux-loss figures of a metrics row under names that say what each is; the older names
# stay beside them, unchanged, for the tools that read them (docs/observability.md, "Metrics").
# moe_aux_loss (the engines', StepStats.extra): the load-balancing loss summed over the MoE
# layers, i.e. the whole aux term the step's last micro-batch added to its loss;
# moe/aux_loss (load_metrics): the same loss per layer, the mean over layers and the window's forwards.
AUX_LOSS_NAMES = {"moe_aux_loss": "moe/aux_loss_total", "moe/aux_loss": "moe/aux_loss_per_layer"}


def with_aux_loss_names(row: Dict[str, object]) -> Dict[str, object]:
    """`row` with the descriptive name of each aux-loss figure it has added (AUX_LOSS_NAMES)."""
    for old, new in AUX_LOSS_NAMES.items():
        if old in row:
            row[new] = row[old]
    return row


def load_metrics(counts: torch.Tensor, dropped: torch.Tensor, aux_sum: torch.Tensor,
                 aux_calls: torch.Tensor) -> Dict[str, float]:
    """The four `moe/*` values from counts [layers, experts], dropped [layers], aux_sum [layers],
    aux_calls [layers] (float64, summed over ranks); {} when no layer routed a token."""
    counts = counts.to(torch.float64)
    routed = counts.sum(dim=1)
    rows = routed > 0
    if not bool(rows.any()):
        return {}
    c = counts[rows]
    mean = c.mean(dim=1)
    cv = c.std(dim=1, unbiased=False) / mean
    max_over_mean = c.max(dim=1).values / mean
    dropped_frac = float(dropped.to(torch.float64)[rows].sum() / routed[rows].sum())
    called = aux_calls > 0
    aux = float((aux_sum[called].to(torch.float64) / aux_calls[called].to(torch.float64)).mean()) if bool(called.any()) else 0.0
    return {
        "moe/tokens_per_expert_cv": float(cv.mean()),
        "moe/tokens_per_expert_max_over_mean": float(max_over_mean.mean()),
        "moe/dropped_frac": dropped_frac,
        "moe/aux_loss": aux,
    }


def layer_metrics(counts: torch.Tensor, bias_spread: torch.Tensor, bias_holders: torch.Tensor) -> Dict[str, float]:
    """Per-layer `moe/layer<i>/*` values and `moe/bias_spread` from counts [layers, experts],
    bias_spread [layers] (max - min of the layer's correction bias, summed over the ranks that hold
    the layer) and bias_holders [layers] (how many ranks added a spread; 0: no correction bias)."""
    counts = counts.to(torch.float64)
    out: Dict[str, float] = {}
    for i in range(counts.shape[0]):
        if counts[i].sum() > 0:
            out[f"moe/layer{i}/tokens_per_expert_max_over_mean"] = float(counts[i].max() / counts[i].mean())
    held = bias_holders > 0
    # Every holder of a layer (data-, tensor-parallel replicas) keeps the same bias: the mean over them.
    spread = bias_spread.to(torch.float64)[held] / bias_holders.to(torch.float64)[held]
    for i, value in zip(held.nonzero().flatten().tolist(), spread.tolist()):
        out[f"moe/layer{i}/bias_spread"] = value
    if spread.numel():
        out["moe/bias_spread"] = float(spread.mean())
    return out
