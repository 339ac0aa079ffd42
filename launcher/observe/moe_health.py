"""MoE health: tokens routed to each expert of each MoE layer, per log step; idle experts warned about.

Every MoE layer counts the assignments its router makes (launcher/models/moe.py
`routed_tokens`, on this rank's tokens, before any capacity drop). On each log step every
rank reads and resets its layers' counts into one [n_layers, n_experts] tensor (layers are
keyed by their index in the whole model, so pipeline stages fill different rows) and one
all-reduce sums them. Rank 0 logs `moe/expert_share_min` and `moe/expert_share_max` (the
smallest and largest share of a layer's assignments any expert got) and `moe/idle_experts`;
W&B also gets the full table (layer, expert, tokens). An expert with no tokens for
IDLE_LOGS log steps in a row is warned about. Tensor-parallel ranks see the same tokens and
count them again: shares and idle experts are unaffected by that duplication.
The same all-reduce carries each layer's dropped assignments and aux-loss sum, from which
launcher/observe/moe_load.py computes the `moe/*` load metrics (cv, max/mean, dropped
fraction, aux loss) over the MoE layers of every pipeline stage, and the per-layer ones
(`moe/layer<i>/*`: max/mean, and the spread of a correction bias, read here only on log steps).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from launcher.observe.moe_load import layer_metrics, load_metrics

log = logging.getLogger(__name__)

IDLE_LOGS = 3
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def moe_layers(parts: List[nn.Module]) -> List[Tuple[int, nn.Module]]:
    """(index of the block in the whole model, its MoE module) for this rank's model parts."""
    found = []
    for part in parts:
        for name, module in part.named_modules():
            if hasattr(module, "routed_tokens"):
                match = _LAYER.search(name)
                if match:
                    found.append((int(match.group(1)), module))
    return found


class MoEHealth:
    def __init__(self, parts: List[nn.Module], n_layers: int, n_experts: int, rank: int, device: torch.device,
                 log_table: Optional[Callable[[str, List[str], List[List[Any]]], None]] = None):
        self.layers = moe_layers(parts)
        self.n_layers, self.n_experts = n_layers, n_experts
        self.rank = rank
        self.device = device
        self.log_table = log_table
        self._idle = torch.zeros(n_layers, n_experts, dtype=torch.int64)
        self._moe_rows: Optional[List[int]] = None

    def observe(self, step: int) -> Dict[str, Any]:
        """On a log step (every rank, collective): routed-token statistics since the last log step."""
        # One tensor, one all-reduce: per layer the expert counts, then dropped, aux sum, aux calls,
        # correction-bias spread, ranks holding a correction bias.
        packed = torch.zeros(self.n_layers, self.n_experts + 5, dtype=torch.float64, device=self.device)
        for index, module in self.layers:
            _drain(module, packed[index], self.n_experts)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        packed = packed.cpu()
        counts = packed[:, :self.n_experts]
        load = load_metrics(counts, packed[:, self.n_experts], packed[:, self.n_experts + 1], packed[:, self.n_experts + 2])
        per_layer = layer_metrics(counts, packed[:, self.n_experts + 3], packed[:, self.n_experts + 4])
        rows = [i for i in range(self.n_layers) if counts[i].sum() > 0]
        if not rows:
            return {}
        share = counts[rows] / counts[rows].sum(dim=1, keepdim=True)
        idle = counts == 0
        self._idle = torch.where(idle, self._idle + 1, torch.zeros_like(self._idle))
        for layer in rows:
            for expert in range(self.n_experts):
                if self._idle[layer, expert] == IDLE_LOGS and self.rank == 0:
                    log.warning("MoE layer %d: expert %d received no tokens for %d log steps in a row (step %d); "
                                "check the router and its load balancing (%s)",
                                layer, expert, IDLE_LOGS, step, self._balancing_keys(layer))
        if self.log_table is not None and self.rank == 0:
            data = [[layer, expert, int(counts[layer, expert])] for layer in rows for expert in range(self.n_experts)]
            self.log_table("moe/tokens_per_expert", ["layer", "expert", "tokens"], data)
        return {"moe/expert_share_min": float(share.min()), "moe/expert_share_max": float(share.max()),
                "moe/idle_experts": int(idle[rows].sum()), **load, **per_layer}


    def _balancing_keys(self, layer: int) -> str:
        """The keys that balance this layer's router: a sigmoid router with a correction bias
        (DeepSeek-V3) balances by the bias and the sequence-wise loss, a softmax one by the aux loss."""
        module = dict(self.layers).get(layer)
        if getattr(module, "e_score_correction_bias", None) is not None:
            return "model.bias_update_speed, model.aux_loss_alpha"
        return "model.aux_loss_coef"


def _drain(module: nn.Module, row: torch.Tensor, n_experts: int) -> None:
    """Add one MoE layer's accumulated load into row [counts..., dropped, aux sum, aux calls, bias
    spread, bias holders]; reset it."""
    if module.routed_tokens is not None:
        row[:n_experts] += module.routed_tokens.to(row.device, torch.float64)
        module.routed_tokens = None
    if getattr(module, "dropped_tokens", None) is not None:
        row[n_experts] += module.dropped_tokens.to(row.device, torch.float64)
        module.dropped_tokens = None
    if getattr(module, "aux_loss_sum", None) is not None:
        row[n_experts + 1] += module.aux_loss_sum.to(row.device, torch.float64)
        row[n_experts + 2] += module.aux_loss_calls
        module.aux_loss_sum, module.aux_loss_calls = None, 0
    bias = getattr(module, "e_score_correction_bias", None)
    if bias is not None:
        row[n_experts + 3] += (bias.max() - bias.min()).to(row.device, torch.float64)
        row[n_experts + 4] += 1
