"""DeepSeek-V3's decoder: launcher/models/transformer.py's Transformer with MLA blocks.

Multi-head latent attention (per block, names as ours; transformers' in brackets):
- queries: wq_a [q_a_proj] dim -> q_lora_rank, q_norm [q_a_layernorm] (RMSNorm, eps 1e-6 as
  transformers and DeepSeek's code hard-wire it), wq_b [q_b_proj] -> n_heads x (qk_nope + qk_rope);
  with q_lora_rank 0 one wq [q_proj] dim -> heads (DeepSeek-V2-Lite);
- keys and values: wkv_a [kv_a_proj_with_mqa] dim -> kv_lora_rank + qk_rope (the latent and one
  RoPE key shared by all heads), kv_norm [kv_a_layernorm] on the latent, wkv_b [kv_b_proj] latent
  -> n_heads x (qk_nope + v_head);
- a head's key is [its nope part | the shared RoPE key]; RoPE (interleaved pairs, as our
  apply_rope and transformers' rope_interleave=True) rotates the last qk_rope channels of q and k;
- softmax scale 1/sqrt(qk_nope + qk_rope) times mscale(factor, mscale_all_dim)^2 under YaRN
  (launcher/models/layers.py softmax_scale_factor), then wo [o_proj] n_heads x v_head -> dim.
Head counts come from the projected tensors' local sizes, so a column-wise TP plan of wq/wq_b and
wkv_b (heads sharded) and a row-wise wo need nothing here; the down-projections and their norms
are replicated (launcher/models/deepseek_v3/tp.py).

The MoE blocks are launcher/models/moe.py's MoE with a sigmoid router, the correction bias,
group-limited routing and routed_scaling_factor; the first n_dense_layers blocks are dense.
"""

from __future__ import annotations

import torch
from torch import nn

from launcher.models.layers import FeedForward, RMSNorm, _grouped_sdpa, _masked_attention, apply_rope, softmax_scale_factor
from launcher.models.moe import MoE
from launcher.models.shape import block_is_moe, mla_qk_head_dim
from launcher.models.transformer import Transformer, TransformerBlock

# transformers' DeepseekV3RMSNorm(q_lora_rank) and (kv_lora_rank) keep their default eps.
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_heads = int(cfg.n_heads)
        self.qk_nope, self.qk_rope, self.v_head = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
        self.qk_head = mla_qk_head_dim(cfg)
        self.kv_lora_rank = int(cfg.kv_lora_rank)
        dim, q_rank = int(cfg.dim), int(cfg.q_lora_rank)
        if q_rank > 0:
            self.wq_a = nn.Linear(dim, q_rank, bias=False)
            self.q_norm = RMSNorm(q_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(q_rank, self.n_heads * self.qk_head, bias=False)
        else:
            self.wq = nn.Linear(dim, self.n_heads * self.qk_head, bias=False)
        self.wkv_a = nn.Linear(dim, self.kv_lora_rank + self.qk_rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope + self.v_head), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_head, dim, bias=False)
        # Identity on the shared RoPE key; tensor parallelism sums its gradient over the head shards.
        self.rope_key = nn.Identity()
        self.softmax_scale = self.qk_head ** -0.5 * softmax_scale_factor(getattr(cfg, "rope_scaling", None))
        self.expand_kv = False  # set by context parallelism; MLA has as many K/V heads as queries
        # Set by all-gather context parallelism (launcher.parallel.cp.use_gathered_kv): gathers the
        # normed latent and the rotated shared RoPE key (kv_lora_rank + qk_rope channels per token,
        # not the heads' K/V); every rank then up-projects the whole sequence through wkv_b.
        self.kv_gather = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        b = x.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_b") else self.wq(x)
        s = q.shape[1]
        q = q.view(b, s, -1, self.qk_head)
        q_nope, q_rope = q.split([self.qk_nope, self.qk_rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope], dim=-1)
        latent = self.kv_norm(latent)
        k_rope = apply_rope(self.rope_key(k_rope).view(b, s, 1, self.qk_rope), rope)
        if self.kv_gather is not None:
            both = self.kv_gather(torch.cat([latent, k_rope.view(b, s, self.qk_rope).type_as(latent)], dim=-1))
            latent, k_rope = both.split([self.kv_lora_rank, self.qk_rope], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        sk = latent.shape[1]  # the keys' length: s, or the whole sequence under context parallelism
        kv = self.wkv_b(latent).view(b, sk, -1, self.qk_nope + self.v_head)
        k_nope, v = kv.split([self.qk_nope, self.v_head], dim=-1)
        heads = q.shape[2]
        q_rope = apply_rope(q_rope, rope)
        k_rope = k_rope.expand(b, sk, heads, self.qk_rope)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [b, h, s, qk_head]
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        if mask is None:
            o = _grouped_sdpa(q, k, v, 1, False, is_causal=True, scale=self.softmax_scale)
        else:
            o = _masked_attention(q, k, v, mask, 1, False, scale=self.softmax_scale)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class DeepseekV3Block(TransformerBlock):
    """attention_norm, MLA attention, ffn_norm, then a dense SwiGLU FFN (the first n_dense_layers
    blocks) or the DeepSeek MoE."""

    def __init__(self, cfg, layer_id: int):
        nn.Module.__init__(self)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.is_moe = block_is_moe(cfg, layer_id)
        if self.is_moe:
            sigmoid = cfg.score_func == "sigmoid"
            self.moe = MoE(cfg.dim, cfg.moe_ffn_dim or cfg.ffn_dim, cfg.n_experts, cfg.top_k,
                           cfg.n_shared_experts, cfg.capacity_factor,
                           cfg.aux_loss_alpha if sigmoid else cfg.aux_loss_coef,
                           norm_topk_prob=bool(cfg.norm_topk_prob), score_func=cfg.score_func,
                           routed_scaling_factor=cfg.routed_scaling_factor, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, correction_bias=True,
                           aux_loss="sequence" if sigmoid else "switch")
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)


class DeepseekV3Transformer(Transformer):
    """Decoder-only LM with MLA blocks: forward(tokens [b, s]) -> logits [b, s, vocab]."""

    block_class = DeepseekV3Block

    def check_shape(self, cfg) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if int(getattr(cfg, key, 0) or 0) <= 0:
                raise ValueError(f"model.family=deepseek_v3 needs model.{key} > 0")
        if int(cfg.qk_rope_head_dim) % 2:
            raise ValueError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")

    def init_weights(self, seed: int = 0, buffer_device=None) -> None:
        """The shared initialisation, and every correction bias at 0 (transformers' too)."""
        super().init_weights(seed, buffer_device)
        with torch.no_grad():
            for m in self.moe_layers():
                if m.e_score_correction_bias is not None:
                    m.e_score_correction_bias.zero_()
