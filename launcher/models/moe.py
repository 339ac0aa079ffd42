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

Load accounting (read and reset by launcher/observe/moe_health.py at log steps): over the
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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial

from launcher.models.fp32_buffers import register_fp32_buffer
from launcher.models.grouped_mm import expert_swiglu
from launcher.models.layers import FeedForward


def _local(t: torch.Tensor) -> torch.Tensor:
    # Sharded weights arrive as DTensors; the math runs on this rank's experts only. Where a weight
    # is replicated over ranks that compute different tokens (experts folded over TP without FSDP:
    # launcher/parallel/ep.py), its local gradient is that rank's part: Partial, summed over them.
    if not hasattr(t, "to_local"):
        return t
    if any(p.is_replicate() for p in t.placements):
        return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])
    return t.to_local()


class _SumOverTokenGroup(torch.autograd.Function):
    """Sum a statistic over the ranks holding slices of the same sequences (``MoE.token_group``).

    Backward is the identity: every rank computes the same loss from the summed statistic and
    injects its gradient into its own slice only, so each slice's gradient is counted once (an
    all-reduce in backward would count it once per rank)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group):
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


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
                 aux_loss_coef: float = 0.01, norm_topk_prob: bool = True, *,
                 score_func: str = "softmax", routed_scaling_factor: float = 1.0, n_group: int = 1,
                 topk_group: int = 1, correction_bias: bool = False, aux_loss: str = "switch"):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func={score_func!r} is not one of softmax, sigmoid")
        if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide n_experts={n_experts} and topk_group={topk_group} "
                             f"lie in [1, n_group]")
        if n_group > 1 and n_experts // n_group < 2:
            raise ValueError(f"group-limited routing scores a group by its two best experts: n_experts / n_group "
                             f"= {n_experts // n_group} must be at least 2")
        if n_group > 1 and top_k > topk_group * (n_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the experts of topk_group={topk_group} groups")
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coef = aux_loss_coef
        self.norm_topk_prob = norm_topk_prob
        self.score_func = score_func
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.n_group, self.topk_group = int(n_group), int(topk_group)
        # "switch": coef * E * sum_e f_e P_e over the call's tokens; "sequence": DeepSeek-V3's
        # sequence-wise balance loss (per sequence, scores normalised over the experts).
        self.aux_loss_kind = aux_loss
        # DeepSeek-V3's aux-loss-free balancing: added to the scores to choose experts only (never
        # to the weights), moved after each optimizer step by update_correction_bias. A persistent
        # buffer: checkpointed with the model, never seen by the optimizer.
        if correction_bias:
            # float32 under every engine: bf16 rounds a 1e-3 step away once |bias| >= 0.5.
            register_fp32_buffer(self, "e_score_correction_bias", torch.zeros(n_experts))
        else:
            self.e_score_correction_bias = None
        # Assignments per expert since the last bias update (training forwards; [E] int64).
        self.step_load: "torch.Tensor | None" = None
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
        # Assignments routed to each expert since the runtime last read them (launcher/observe/moe_health.py).
        self.routed_tokens: "torch.Tensor | None" = None
        self.dropped_tokens: "torch.Tensor | None" = None
        self.aux_loss_sum: "torch.Tensor | None" = None
        self.aux_loss_calls = 0
        # The process group of the ranks that hold other slices of this call's sequences (experts
        # folded over TP, context parallelism: launcher/parallel/ep.py sets it), or None. The
        # load-balancing losses sum their statistics over it, so they are those of whole sequences.
        self.token_group = None

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
        logits = self.router(x).float()
        scores = logits.sigmoid() if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)  # [T, E]
        sizes: Optional[List[int]] = None  # per-expert counts as host ints, when known without a sync
        if self.routing == "balanced":
            experts = balanced_assignment(n_tok, self.top_k, self.n_experts, x.device)
            sizes = balanced_counts(n_tok * self.top_k, self.n_experts)
        else:
            experts = self.choose_experts(scores)  # [T, k]
        weights = scores.gather(1, experts)
        if self.score_func == "sigmoid":
            if self.norm_topk_prob:  # transformers' DeepseekV3TopkRouter (1e-20 included)
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * self.routed_scaling_factor
        elif self.norm_topk_prob and self.top_k > 1:
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
            if self.e_score_correction_bias is not None:
                self.step_load = routed if self.step_load is None else self.step_load + routed
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

        if self.aux_loss_kind == "sequence":
            aux = self._sequence_aux_loss(scores, experts, shape)
        else:
            aux = self._switch_aux_loss(scores, routed)
        self.last_aux_loss = aux.detach()
        if recording:
            self.aux_loss_sum = aux.detach() if self.aux_loss_sum is None else self.aux_loss_sum + aux.detach()
            self.aux_loss_calls += 1
        if self.training and aux.requires_grad:
            out = AddAuxLossGrad.apply(out, aux, self.aux_loss_scale)

        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.reshape(shape)

    def choose_experts(self, scores: torch.Tensor) -> torch.Tensor:
        """[T, top_k] experts of each token: the top_k of scores (+ e_score_correction_bias, for the
        choice only), within the topk_group groups whose two best biased scores sum highest when
        n_group > 1 (transformers' DeepseekV3TopkRouter, step for step)."""
        if self.e_score_correction_bias is None and self.n_group == 1:
            return torch.topk(scores, self.top_k, dim=-1)[1]  # Mixtral / Qwen3-MoE: best first, as always
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            n_tok = choice.shape[0]
            grouped = choice.view(n_tok, self.n_group, self.n_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(n_tok, self.n_experts)
            choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        return torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]

    def _group_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over ``token_group`` (unchanged without one): see _SumOverTokenGroup."""
        if self.token_group is None:
            return t
        return _SumOverTokenGroup.apply(t, self.token_group)

    def _switch_aux_loss(self, scores: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """Switch load-balancing loss over this call's tokens (assignments before any drop), those of
        the whole sequences where ``token_group`` holds their other slices: one all-reduce of
        [routed counts, score sums, tokens]."""
        n_tok = scores.new_full((1,), scores.shape[0])
        stats = self._group_sum(torch.cat([routed.float(), scores.sum(0), n_tok]))
        tokens = stats[-1]
        frac = stats[:self.n_experts] / (tokens * self.top_k)
        mean_p = stats[self.n_experts:2 * self.n_experts] / tokens
        return self.aux_loss_coef * self.n_experts * (frac * mean_p).sum()

    def _sequence_aux_loss(self, scores: torch.Tensor, experts: torch.Tensor, shape) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, alpha * mean over sequences of sum_e f_e P_e:
        f_e = E / (top_k * T) * (tokens of the sequence choosing e), P_e = mean over its tokens of the
        scores normalised over all experts. A flat input counts as one sequence. Where
        ``token_group`` holds the sequences' other slices, the per-sequence sums are summed over it
        (one all-reduce of [sequences, 2E + 1]) so T, f and P are the whole sequence's."""
        seqs = shape[0] if len(shape) == 3 else 1
        s = scores.view(seqs, -1, self.n_experts)
        tokens = s.shape[1]
        chosen = torch.zeros(seqs * tokens, self.n_experts, device=scores.device, dtype=scores.dtype)
        chosen.scatter_(1, experts, 1.0)
        count = chosen.view(seqs, tokens, self.n_experts).sum(1)
        p_sum = (s / (s.sum(-1, keepdim=True) + 1e-20)).sum(1)
        stats = self._group_sum(torch.cat([count, p_sum, s.new_full((seqs, 1), tokens)], dim=-1))
        total = stats[:, -1:]
        f = stats[:, :self.n_experts] * (self.n_experts / self.top_k) / total
        p = stats[:, self.n_experts:2 * self.n_experts] / total
        return self.aux_loss_coef * (f.detach() * p).sum(-1).mean()


@torch.no_grad()
def update_correction_bias(parts, speed: float, n_layers: int, n_experts: int, reduce=None, device=None) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), after an optimizer step: in every MoE layer of the
    model `parts` (a model, or this rank's pipeline stages) with an e_score_correction_bias,
    bias_e += speed * sign(mean load - load_e) over the assignments since the last update
    (step_load), then step_load is cleared. Outside autograd and the optimizer (the bias is a
    buffer).

    The loads go in one [n_layers, n_experts] float tensor (row = the block's index in the whole model,
    zero for blocks elsewhere), so every rank passes the same shape to `reduce`: None, or a
    function summing it in place over all ranks (every pipeline stage, data-, context- and
    expert-parallel rank), after which every replica of a router moves its bias alike. Tensor-
    parallel ranks route their own slices of the tokens (experts folded over TP), so the sum is the
    global load."""
    parts = parts if isinstance(parts, (list, tuple)) else [parts]
    layers = {}
    for part in parts:
        for block in part.modules():  # decoder blocks (any wrapper or stage module around them)
            m = getattr(block, "moe", None) if hasattr(block, "layer_id") else None
            if isinstance(m, MoE) and m.e_score_correction_bias is not None:
                layers[int(block.layer_id)] = m
    if not layers and reduce is None:
        return
    if device is None:  # `device`: where `reduce` runs (a stage without MoE layers has no bias to ask)
        device = next(iter(layers.values())).e_score_correction_bias.device if layers else torch.device("cpu")
    loads = torch.zeros(n_layers, n_experts, dtype=torch.float32, device=device)
    for i, m in layers.items():
        if m.step_load is not None:
            loads[i, :m.n_experts] = m.step_load.to(device, torch.float32)
    if reduce is not None:
        reduce(loads)
    for i, m in layers.items():
        load = loads[i, :m.n_experts].to(m.e_score_correction_bias.device)
        m.e_score_correction_bias.add_(speed * torch.sign(load.mean() - load))
        m.step_load = None


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
