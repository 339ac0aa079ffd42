"""Mixture-of-experts feed-forward: top-k token-choice router, batched experts, shared experts.

Routing (per forward call, over the call's b*s tokens):
- scores = softmax(router(x)) in fp32; each token picks its top_k experts; with top_k > 1 and
  ``norm_topk_prob`` (model.norm_topk_prob, default true) the chosen scores are renormalised to
  sum to 1 (Mixtral, Qwen3-MoE as released); without it they stay softmax probabilities.
- Capacity (``ModelConfig.capacity_factor``): with cf > 0 each expert takes at most
  C = ceil(cf * tokens * top_k / n_experts) assignments; assignments beyond C are dropped
  in token order (earlier positions in the flattened [b*s] order win). A dropped assignment
  contributes zero: the token keeps its residual and its other experts. cf <= 0 is dropless.
  Dropped assignments are not removed but moved after the kept ones (padding rows the experts
  give zero output), so no shape depends on the routing and routing makes no host sync.
- ``routing``: "topk" (above) or "balanced": assignment i of the token-major [T*k] list goes to
  expert i mod E (``balanced_assignment``), with the router's scores as gates. Its per-expert
  counts are known on the host without reading a value; tools that run on tensors without
  values (the rehearsal's fake step) set it. Training always routes "topk".
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
expert-parallel wrapper (launcher/parallel/ep.py) moves tokens between ranks around it. The
computation (torch._grouped_mm, or a per-expert loop where it cannot run) is chosen in
launcher/models/grouped_mm.py.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.grouped_mm import expert_swiglu
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


def balanced_assignment(n_tokens: int, top_k: int, n_experts: int, device) -> torch.Tensor:
    """[n_tokens, top_k] experts where assignment i (token-major) goes to expert i % n_experts:
    every expert gets n_tokens*top_k/n_experts assignments (the load the planner assumes) and a
    token's top_k experts are distinct. Its counts are known without looking at any value, for
    code that has shapes but no values (fake tensors)."""
    flat = torch.arange(n_tokens * top_k, device=device) % n_experts
    return flat.view(n_tokens, top_k)


def balanced_counts(n_assignments: int, n_experts: int) -> List[int]:
    """Per-expert assignments of ``balanced_assignment`` (host ints)."""
    base, extra = divmod(n_assignments, n_experts)
    return [base + (1 if e < extra else 0) for e in range(n_experts)]


class GroupedExperts(nn.Module):
    """n_experts SwiGLU MLPs stored as w1/w3 [E, hidden, dim] and w2 [E, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        # "auto": torch._grouped_mm where it runs, else a per-expert loop (launcher/models/grouped_mm.py).
        self.implementation = "auto"

    def forward(self, x: torch.Tensor, counts: torch.Tensor,
                sizes: Optional[List[int]] = None) -> torch.Tensor:
        """x [N, dim] grouped by (local) expert; counts [local experts] rows per expert; rows
        after sum(counts) are padding (zero output). ``sizes``: counts as host ints, if known."""
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        return expert_swiglu(x, w1, w2, w3, counts, sizes, self.implementation)


class MoE(nn.Module):
    """Top-k routed experts plus optional always-on shared experts."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int,
                 n_shared_experts: int = 0, capacity_factor: float = 0.0,
                 aux_loss_coef: float = 0.01, norm_topk_prob: bool = True):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_scale = 1.0
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.shared_experts = (
            FeedForward(dim, hidden * n_shared_experts) if n_shared_experts > 0 else None
        )
        self.last_aux_loss: "torch.Tensor | None" = None
        # Assignment order: "topk" (the router decides) or "balanced" (see balanced_assignment).
        self.routing = "topk"
        self._last_dropped: "torch.Tensor | None" = None
        # Assignments routed to each expert since the runtime last read them (launcher/runtime/moe_health.py).
        self.routed_tokens: "torch.Tensor | None" = None
        self.dropped_tokens: "torch.Tensor | None" = None
        self.aux_loss_sum: "torch.Tensor | None" = None
        self.aux_loss_calls = 0

    @property
    def last_dropped_fraction(self) -> float:
        """Share of the last forward's assignments dropped by capacity (reading it syncs)."""
        return 0.0 if self._last_dropped is None else float(self._last_dropped)

    def capacity(self, n_tokens: int) -> int:
        """Assignments one expert may take for a call with n_tokens tokens (0 = unlimited)."""
        if self.capacity_factor <= 0:
            return 0
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # No host synchronisation here: every shape below follows from x's shape alone (the
        # expert-parallel dispatch makes the layer's one sync, or the experts' loop fallback).
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n_tok = x.shape[0]
        scores = F.softmax(self.router(x).float(), dim=-1)  # [T, E]
        sizes: Optional[List[int]] = None  # per-expert counts as host ints, when known without a sync
        if self.routing == "balanced":
            experts = balanced_assignment(n_tok, self.top_k, self.n_experts, x.device)
            weights = scores.gather(1, experts)
            sizes = balanced_counts(n_tok * self.top_k, self.n_experts)
        else:
            weights, experts = torch.topk(scores, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)

        flat_expert = experts.reshape(-1)  # [T*k], token-major
        n_assign = flat_expert.numel()
        order = torch.argsort(flat_expert, stable=True)  # group by expert, token order kept
        # scatter_add, not bincount: bincount sizes its output from the data (a sync on CUDA).
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat_expert, torch.ones_like(flat_expert))
        routed = counts.detach()
        # Training forwards only: validation (no_grad) must not mix held-out tokens into the load.
        recording = torch.is_grad_enabled()
        if recording:
            self.routed_tokens = routed if self.routed_tokens is None else self.routed_tokens + routed
        cap = self.capacity(n_tok)
        kept_rows: Optional[torch.Tensor] = None
        if cap:
            sorted_expert = flat_expert[order]
            starts = torch.cumsum(counts, 0) - counts
            pos_in_expert = torch.arange(n_assign, device=x.device) - starts[sorted_expert]
            dropped_row = (pos_in_expert >= cap).to(torch.int8)
            # Dropped assignments move to the end (kept ones stay grouped by expert, in token
            # order): shapes stay fixed, the experts treat the tail as padding (zero output).
            order = order[torch.argsort(dropped_row, stable=True)]
            counts = counts.clamp(max=cap)
            if sizes is not None:
                sizes = [min(s, cap) for s in sizes]
            kept_rows = torch.arange(n_assign, device=x.device) < counts.sum()
            dropped = (routed - counts).sum()
            if recording:
                self.dropped_tokens = dropped if self.dropped_tokens is None else self.dropped_tokens + dropped
            self._last_dropped = dropped.float() / n_assign
        token_idx = order // self.top_k
        y = self.experts(x[token_idx], counts, sizes)
        w = weights.reshape(-1)[order].unsqueeze(-1)
        if kept_rows is not None:
            w = torch.where(kept_rows.unsqueeze(-1), w, 0)
        out = torch.zeros_like(x).index_add_(0, token_idx, (y.float() * w).to(x.dtype))

        # Switch load-balancing loss over this call's tokens (assignments before any drop).
        frac = routed.float() / n_assign
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


def moe_layers_of(module: nn.Module) -> List[MoE]:
    """The MoE layers inside `module`: a whole Transformer, one pipeline stage, or any wrapper."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def latest_aux_loss(module: nn.Module) -> torch.Tensor:
    """Sum over `module`'s MoE layers of the last forward's load-balancing loss, a 0-dim fp64
    tensor on the layers' device (0 without any): summed there, so logging it costs no host sync
    until it is read."""
    vals = [m.last_aux_loss for m in moe_layers_of(module) if m.last_aux_loss is not None]
    if not vals:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack([v.reshape(()).to(torch.float64) for v in vals]).sum()


def set_aux_loss_scale(module: nn.Module, scale: float) -> None:
    """Weight of the load-balancing gradient in every MoE layer of `module` (see AddAuxLossGrad)."""
    for m in moe_layers_of(module):
        m.aux_loss_scale = scale
