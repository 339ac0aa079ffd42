"""Llama-style decoder (dense or MoE), defined once from ``ModelConfig``: the model of the llama,
mixtral and qwen3 families (Qwen3 adds per-head QK-norm and a free head size).

Module names follow torchtitan so checkpoints read naturally and load across layouts:
``tok_embeddings``, ``layers`` (a ModuleDict keyed "0".."L-1": pipeline stages delete
entries but keep the others' names), ``norm``, ``output``. Every block has
``attention_norm``, ``attention``, ``ffn_norm`` and either ``feed_forward`` (dense) or
``moe``. The model knows nothing about parallelism; launcher/parallel/ rewrites it.

A pipeline stage holds a subset of these modules (missing ones are None): the first stage
takes tokens, later ones take the previous stage's hidden state.

Packed documents: ``forward(tokens, positions=None, document_ids=None)``. ``positions`` [b, s]
gives each token's RoPE position (restarting at each document with data.reset_positions);
``document_ids`` [b, s] keeps attention inside each document (block-causal). Both are
full-sequence tensors of the micro-batch; any stage (or part) takes them, so a pipeline stage
rebuilds the mask for its own layers. The mask is built once per forward and shared by every
layer. ``attention_kernel`` picks how a mask is applied: "auto" (FlexAttention on CUDA, SDPA with
a boolean mask elsewhere), "sdpa" or "flex".
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from launcher.models.fp32_buffers import register_fp32_buffer
from launcher.models.init import init_model_weights
from launcher.models.layers import (Attention, FeedForward, KeyIndex, RMSNorm, attention_mask,
                                    document_attention_mask, model_rope_table, rope_at_positions)
from launcher.models.moe import AddAuxLossGrad, MoE, latest_aux_loss, set_aux_loss_scale
from launcher.models.mtp import MTPDepth, mtp_loss_sum, mtp_targets
from launcher.models.shape import block_is_moe, head_dim_of, mtp_layers_of


class TransformerBlock(nn.Module):
    def __init__(self, cfg, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, head_dim_of(cfg),
                                   bool(getattr(cfg, "qk_norm", False)), cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = block_is_moe(cfg, layer_id)
        if self.is_moe:
            self.moe = MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.n_experts, cfg.top_k,
                           cfg.n_shared_experts, cfg.capacity_factor, cfg.aux_loss_coef,
                           norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)))
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        if mask is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:  # a keyword: TP's input hooks on `attention` lay out its positional inputs only
            h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


def _attention_dtype(h: torch.Tensor) -> torch.dtype:
    """The dtype the attention will compute in: autocast's where it is on (q, k, v come out of
    autocast linears), else the hidden state's (e.g. bf16 under FSDP's mixed precision)."""
    device = h.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return h.dtype


class Transformer(nn.Module):
    """Decoder-only LM: forward(tokens int64 [b, s]) -> logits [b, s, vocab].

    A family whose blocks differ (DeepSeek-V3's MLA) subclasses it with its own ``block_class``."""

    block_class = TransformerBlock

    def check_shape(self, cfg) -> None:
        if not getattr(cfg, "head_dim", 0) and cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads} "
                             f"(set model.head_dim for heads of another size)")

    def __init__(self, cfg):
        super().__init__()
        self.check_shape(cfg)
        self.cfg = cfg
        self.tok_embeddings: Optional[nn.Embedding] = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.block_class(cfg, i) for i in range(cfg.n_layers)})
        self.norm: Optional[RMSNorm] = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: Optional[nn.Linear] = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Multi-token prediction (launcher/models/mtp.py): its blocks are numbered after the main ones,
        # as HF names them (DeepSeek-V3's model.layers.61).
        depths = mtp_layers_of(cfg)
        self.mtp: Optional[nn.ModuleDict] = nn.ModuleDict(
            {str(k): MTPDepth(cfg, self.block_class(cfg, cfg.n_layers + k)) for k in range(depths)}) if depths else None
        # lambda / D / the step's token count, set by the engine each step (a float or a 0-dim tensor).
        self.mtp_loss_scale = 1.0
        self.last_mtp_loss: Optional[torch.Tensor] = None  # the last forward's sum over depths / D
        # The engine's per-step sum of last_mtp_loss over this module's forwards (None: not kept).
        self.mtp_loss_acc: Optional[torch.Tensor] = None
        # A pipeline's last stage holds the MTP without the embedding: its copy of stage 0's table,
        # kept equal by summing their gradients (launcher/parallel/pp.py, launcher/engines/native.py).
        self.mtp_embeddings: Optional[nn.Embedding] = None
        # Non-persistent: recomputed by init_weights, never checkpointed. Context parallelism
        # shards this buffer along the sequence together with the tokens.
        register_fp32_buffer(self, "rope", model_rope_table(cfg), persistent=False)
        self.attention_kernel = "auto"  # how a document mask is applied (document_attention_mask)

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, keys: Optional["KeyIndex"] = None,
                mtp_labels: Optional[torch.Tensor] = None, mtp_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits. ``keys``: where the attention's keys lie when they are not these tokens (context
        parallelism's gathered K/V); the mask is then built from it. With `mtp_labels` (training)
        and model.mtp_layers > 0 the multi-token-prediction loss is computed too and its gradient
        rides on the logits' (launcher/models/mtp.py). `mtp_labels`: the main labels [b, s] (the
        depths' shifts are taken here, from these rows and `document_ids`), or mtp_targets'
        [b, s, D] targets with `mtp_tokens` its [b, s, D] tokens (what the engines pass: taken on
        whole rows, before context parallelism splits them). `mtp_tokens` [b, s]: the token ids,
        for a pipeline stage whose input is a hidden state."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope if positions is None else rope_at_positions(self.rope, positions)
        mask = None
        if keys is not None:
            mask = attention_mask(keys.query_index, keys.key_index, document_ids, keys.key_document_ids,
                                  self.attention_kernel, dtype=_attention_dtype(h))
            for block in self.layers.values():
                h = block(h, rope, mask=mask)
        elif document_ids is None:
            for block in self.layers.values():
                h = block(h, rope)
        else:
            mask = document_attention_mask(document_ids, self.attention_kernel, dtype=_attention_dtype(h))
            for block in self.layers.values():
                h = block(h, rope, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        logits = self.output(h)
        if mtp_labels is not None and self.mtp is not None:
            embed = self.tok_embeddings if self.tok_embeddings is not None else self.mtp_embeddings
            ids = mtp_tokens if mtp_tokens is not None else tokens
            if mtp_labels.dim() == 2:  # the main labels of whole rows: shift them here
                ids, mtp_labels = mtp_targets(ids, mtp_labels, len(self.mtp), document_ids)
            total = mtp_loss_sum(self, embed, ids, h, mtp_labels, rope, mask)
            if hasattr(total, "to_local"):  # loss parallelism: replicated over TP, as the main loss
                total = total.to_local()
            self.last_mtp_loss = total.detach() / len(self.mtp)
            if self.mtp_loss_acc is not None:
                self.mtp_loss_acc += self.last_mtp_loss
            if total.requires_grad:
                logits = AddAuxLossGrad.apply(logits, total * self.mtp_loss_scale, 1.0)
        return logits

    def to_empty(self, *, device, recurse: bool = True):
        """Materialise (see nn.Module.to_empty), keeping tied embeddings tied."""
        super().to_empty(device=device, recurse=recurse)
        # to_empty allocates one new tensor per module, which silently unties the output.
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight
        return self

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        """Deterministic, layout-independent initialisation (see launcher.models.init)."""
        init_model_weights(self, seed, buffer_device)

    def moe_layers(self):
        blocks = list(self.layers.values()) + ([d.block for d in self.mtp.values()] if self.mtp is not None else [])
        return [b.moe for b in blocks if getattr(b, "is_moe", False)]

    def latest_aux_loss(self) -> torch.Tensor:
        """Sum over this module's MoE layers of the last forward's load-balancing loss."""
        return latest_aux_loss(self)

    def set_aux_loss_scale(self, scale: float) -> None:
        set_aux_loss_scale(self, scale)
