"""DeepSeek-V3's multi-token prediction (MTP), one module per depth (model.mtp_layers of them).

Depth k (1..D) at position i predicts token t_{i+k+1}:

    x_i   = eh_proj([enorm(Emb(t_{i+k})); hnorm(h_i^{k-1})])     embedding FIRST, as the released
                                                                    eh_proj, megatron-core 0.16.1's
                                                                    multi_token_prediction.py and
                                                                    vLLM order it (the paper writes
                                                                    the other order)
    h_i^k = head_norm(block(x_i))                                   one decoder block of the model's
                                                                    kind (MLA + MoE for DeepSeek-V3)
    logits = output(h_i^k)                                          the main model's output layer

h^0 is the main model's final-normed hidden state (what its output layer reads), and the next
depth reads h^k after head_norm (HF's `shared_head.norm`), as megatron-core's layers pass it on.
The embedding and the output layer are the main model's (HF's layer-61 `embed_tokens` and
`shared_head.head` are copies of them). Depth k's target at i is the main labels shifted left by
k: positions whose shift leaves the sequence or, with document ids, the document, are ignored.
Both shifts are taken on whole rows (`mtp_targets`): under context parallelism the engine takes
them before it cuts the row into its head-tail slices, so t_{i+k} and the target of a position
whose next tokens live on another CP rank are those one rank would use.

Tensor parallelism (launcher/parallel/tp.py): each depth's block gets its family's block plan;
enorm, hnorm, eh_proj and head_norm are per-token maps, replicated over TP (under SP each rank maps
its own slice of the sequence, their weights' gradients summed over TP, as the main norms').

The loss: lambda / D * sum_k (sum of depth k's token losses) / (the step's token count), the
count the main loss divides by (launcher/engines/native.py sets `mtp_loss_scale` to
lambda / D / count each step). Its gradient is injected into the backward through the main logits
(launcher/models/moe.py AddAuxLossGrad, as megatron-core's MTPLossAutoScaler does), so an engine's
loss and backward stay as they are; `last_mtp_loss` keeps the micro-batch's unweighted sum over
depths / D for logging (`mtp/loss`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from launcher.models.layers import RMSNorm

IGNORE_INDEX = -100  # the label the engines' losses ignore (launcher/engines/base.py)


class MTPDepth(nn.Module):
    """One multi-token-prediction depth: enorm, hnorm, eh_proj, a decoder block, head_norm."""

    def __init__(self, cfg, block: nn.Module):
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.head_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        """h^k from h^{k-1} (`hidden`) and Emb(t_{i+k}) (`embedded`), both [b, s, dim]."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        x = self.block(x, rope) if mask is None else self.block(x, rope, mask=mask)
        return self.head_norm(x)


def shifted_labels(labels: torch.Tensor, depth: int, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Depth `depth`'s targets: labels[:, i + depth] at position i, IGNORE_INDEX where i + depth
    leaves the sequence or (with `document_ids`) the document of position i."""
    out = torch.full_like(labels, IGNORE_INDEX)
    s = labels.shape[1]
    if depth >= s:
        return out
    shifted = labels[:, depth:]
    if document_ids is not None:
        same = document_ids[:, depth:] == document_ids[:, :s - depth]
        shifted = torch.where(same, shifted, torch.full_like(shifted, IGNORE_INDEX))
    out[:, :s - depth] = shifted
    return out


def shifted_tokens(tokens: torch.Tensor, depth: int) -> torch.Tensor:
    """t_{i+depth} at position i (the wrapped-around tail only feeds positions whose targets are ignored)."""
    return torch.roll(tokens, shifts=-depth, dims=1)


def mtp_targets(tokens: torch.Tensor, labels: torch.Tensor, depths: int,
                document_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each [b, s, depths]: column k-1 holds depth k's input token t_{i+k}
    (shifted_tokens) and its target (shifted_labels), from whole rows `tokens`, `labels` [b, s]
    (the main labels) and their document ids. The model reads these columns; a caller that splits
    the sequence afterwards (context parallelism) slices them with the tokens."""
    shifted = [shifted_tokens(tokens, k) for k in range(1, depths + 1)]
    targets = [shifted_labels(labels, k, document_ids) for k in range(1, depths + 1)]
    return torch.stack(shifted, dim=-1), torch.stack(targets, dim=-1)


def mtp_loss_sum(model: nn.Module, embed: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor,
                 targets: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
    """Sum over the depths of `model.mtp` of their token cross-entropies (fp32): `hidden` is h^0,
    `tokens` and `targets` mtp_targets' [b, s, D] columns, `embed` the shared embedding (a
    pipeline's last stage: its copy) and `model.output` the head. Under loss parallelism (TP) the
    sum is a replicated DTensor, as the main loss is."""
    total = None
    for k, depth in enumerate(model.mtp.values()):
        hidden = depth(hidden, embed(tokens[..., k]), rope, mask)
        logits = model.output(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets[..., k].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        total = loss if total is None else total + loss
    return total


def mtp_blocks(model: nn.Module) -> List[nn.Module]:
    """The decoder blocks of the model's multi-token-prediction depths (empty without any): the
    parallelisms that treat each block (expert parallelism, FSDP units) apply to these as well."""
    mtp = getattr(model, "mtp", None)
    return [depth.block for depth in mtp.values()] if mtp is not None else []
