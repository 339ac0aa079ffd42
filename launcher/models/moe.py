"""Mixture-of-experts feed-forward: top-k token-choice router, batched experts, shared experts.

Routing (per forward call, over the call's b*s tokens):
- scores = softmax(router(x)) in fp32; each token picks its top_k experts; with top_k > 1
  the chosen scores are renormalised to sum to 1 (Mixtral style).
- Capacity (``ModelConfig.capacity_factor``): with cf > 0 each expert takes at most
  C = ceil(cf * tokens * top_k / n_experts) assignments; assignments beyond C are dropped
  in token order (earlier positions in the flattened [b*s] order win). A dropped assignment
  contributes zero: the token keeps its residual and its other experts. cf <= 0 is dropless.
- Load balancing: Switch-style aux = coef * n_experts * sum_e f_e * P_e, where f_e is the
  fraction of assignments routed to e and P_e the mean router probability of e. It is not
  returned to the trainer: ``AddAuxLossGrad`` injects d(aux)/d(router) during backward, so
  the trainer's loss is plain cross-entropy and pipeline schedules need no extra output.
  ``aux_loss_scale`` (set by the engine, default 1) weights that gradient so the aux term
  counts once per optimizer step: the engine sets 1 / (micro-batches * data-parallel ranks).
  The latest (unscaled) value is kept in ``last_aux_loss`` for logging.

Load accounting (read and reset by launcher/runtime/moe_health.py at log steps): over the
forwards that record gradients (training; validation runs under no_grad), ``routed_tokens``
[E] counts assignments per expert before any capacity drop, ``dropped_tokens`` the assignments
dropped by capacity (stays 0 when dropless), ``aux_loss_sum`` / ``aux_loss_calls`` the summed
(unscaled) aux loss and the number of forwards. All stay on the device: no host sync.

Experts are stored as batched weights [n_experts, ...] so expert parallelism can shard
them along dim 0. ``GroupedExperts.forward`` takes tokens already grouped by expert plus
per-expert counts, and computes on the local shard when the weights are DTensors: the
expert-parallel wrapper (launcher/parallel/ep.py) moves tokens between ranks around it.
"""

from __future__ import annotations

import math
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.layers import FeedForward


def _local(t: torch.Tensor) -> torch.Tensor:
    # Sharded weights arrive as DTensors; the math runs on this rank's experts only.
    return t.to_local() if hasattr(t, "to_local") else t


class AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``out``; in backward, also sends ``scale`` as the gradient of ``aux``."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float):
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        return grad_out, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs stored as w1/w3 [E, hidden, dim] and w2 [E, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] grouped by (local) expert; counts [local experts] rows per expert."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        sizes: List[int] = counts.tolist()
        outs = []
        for e, chunk in enumerate(torch.split(x, sizes, dim=0)):
            h = F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())
            outs.append(h @ w2[e].t())
        # An expert with no token still runs on an empty chunk: that keeps its weights in
        # the graph, so every rank produces a (zero) gradient for every parameter and
        # FSDP's reduce-scatter sees the same tensors on all ranks.
        return torch.cat(outs, dim=0)


class MoE(nn.Module):
    """Top-k routed experts plus optional always-on shared experts."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int,
                 n_shared_experts: int = 0, capacity_factor: float = 0.0,
                 aux_loss_coef: float = 0.01):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.aux_loss_scale = 1.0
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.shared_experts = (
            FeedForward(dim, hidden * n_shared_experts) if n_shared_experts > 0 else None
        )
        self.last_aux_loss: "torch.Tensor | None" = None
        self.last_dropped_fraction = 0.0
        # Assignments routed to each expert since the runtime last read them (launcher/runtime/moe_health.py).
        self.routed_tokens: "torch.Tensor | None" = None
        self.dropped_tokens: "torch.Tensor | None" = None
        self.aux_loss_sum: "torch.Tensor | None" = None
        self.aux_loss_calls = 0

    def capacity(self, n_tokens: int) -> int:
        """Assignments one expert may take for a call with n_tokens tokens (0 = unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tok = x.shape[0]
        scores = F.softmax(self.router(x).float(), dim=-1)  # [T, E]
        weights, experts = torch.topk(scores, self.top_k, dim=-1)  # [T, k]
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)

        flat_expert = experts.reshape(-1)  # [T*k], token-major
        order = torch.argsort(flat_expert, stable=True)  # group by expert, token order kept
        counts = torch.bincount(flat_expert, minlength=self.n_experts)
        # Training forwards only: validation (no_grad) must not mix held-out tokens into the load.
        recording = torch.is_grad_enabled()
        if recording:
            routed = counts.detach()
            self.routed_tokens = routed if self.routed_tokens is None else self.routed_tokens + routed
        sorted_expert = flat_expert[order]
        cap = self.capacity(n_tok)
        if cap:
            starts = torch.cumsum(counts, 0) - counts
            pos_in_expert = torch.arange(order.numel(), device=x.device) - starts[sorted_expert]
            keep = pos_in_expert < cap
            order = order[keep]
            if recording:
                dropped = (counts - counts.clamp(max=cap)).sum().detach()
                self.dropped_tokens = dropped if self.dropped_tokens is None else self.dropped_tokens + dropped
            counts = counts.clamp(max=cap)
            self.last_dropped_fraction = float(1.0 - keep.float().mean())
        token_idx = order // self.top_k
        y = self.experts(x[token_idx], counts)
        w = weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token_idx, (y.float() * w).to(x.dtype))

        # Switch load-balancing loss over this call's tokens.
        frac = torch.bincount(flat_expert, minlength=self.n_experts).float() / flat_expert.numel()
        aux = self.aux_loss_coef * self.n_experts * (frac * scores.mean(0)).sum()
        self.last_aux_loss = aux.detach()
        if recording:
            self.aux_loss_sum = aux.detach() if self.aux_loss_sum is None else self.aux_loss_sum + aux.detach()
            self.aux_loss_calls += 1
        if self.training and aux.requires_grad:
            out = AddAuxLossGrad.apply(out, aux, self.aux_loss_scale)

        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)
