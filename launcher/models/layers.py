"""Building blocks shared by the dense and MoE decoders: RMSNorm, RoPE, attention, SwiGLU.

Nothing here knows about parallelism. Two conventions make the parallel wrappers work:
- RoPE takes the sequence length from the projected queries (full sequence even under
  sequence parallelism, where the block input is a sequence shard);
- head counts are derived from the projected tensors' local sizes, so column-wise tensor
  parallelism (fewer local heads per rank) needs no change here.

Document masking (data.document_masking, data.reset_positions): attention optionally takes a
mask built once per forward by ``document_attention_mask`` from per-token document ids
(block-causal: a token sees the earlier tokens of its own document only), and RoPE a per-row
table gathered at per-token positions (``rope_at_positions``). Without them the code path is
exactly the plain causal one (``is_causal=True``, the shared [s, d/2, 2] table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from launcher.models.shape import rope_dim_of


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (no mean subtraction, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)


def _scaling_value(scaling, key: str):
    """A field of model.rope_scaling, given as a dataclass/DictConfig (attributes) or a plain dict."""
    return scaling[key] if isinstance(scaling, dict) else getattr(scaling, key)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(inv: torch.Tensor, dim: int, theta: float, scaling) -> torch.Tensor:
    """transformers' _compute_yarn_parameters (DeepSeek-V3's yarn): per frequency, between the
    extrapolated (kept) and interpolated (divided by factor) value along a linear ramp over the
    dimensions whose rotations within original_max_position_embeddings lie between beta_fast
    and beta_slow (rounded out to whole dimensions with truncate)."""
    factor = float(_scaling_value(scaling, "factor"))
    old_len = float(_scaling_value(scaling, "original_max_position_embeddings"))
    beta_fast = float(_scaling_value(scaling, "beta_fast") or 32)
    beta_slow = float(_scaling_value(scaling, "beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if bool(_scaling_value(scaling, "truncate")):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv.device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    # The same expressions as transformers' (inv_freq_interpolation = 1 / (factor * base^(2i/d))).
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=inv.device, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def scale_rope_frequencies(inv: torch.Tensor, scaling, theta: float = 10000.0) -> torch.Tensor:
    """Apply model.rope_scaling to RoPE inverse frequencies `inv` (fp32; `theta`: their base).

    type "none": unchanged. type "llama3" (Llama 3.1-3.3 long context): wavelengths shorter than
    original_max_position_embeddings / high_freq_factor are kept, those longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, and the band
    between is interpolated smoothly -- the same arithmetic as Meta's reference code and
    transformers' `_compute_llama3_parameters`, so logits match a Hugging Face checkpoint.
    type "yarn" (DeepSeek-V3): _yarn_frequencies; its cos/sin magnitude is rope_magnitude's."""
    kind = str(_scaling_value(scaling, "type")) if scaling is not None else "none"
    if kind == "none":
        return inv
    if kind == "yarn":
        return _yarn_frequencies(inv, 2 * inv.shape[0], theta, scaling)
    if kind != "llama3":  # validate.py refuses other types before launch
        raise ValueError(f"model.rope_scaling.type={kind!r} is not one of none, llama3, yarn")
    factor = float(_scaling_value(scaling, "factor"))
    low = float(_scaling_value(scaling, "low_freq_factor"))
    high = float(_scaling_value(scaling, "high_freq_factor"))
    old_len = float(_scaling_value(scaling, "original_max_position_embeddings"))
    wavelen = 2 * math.pi / inv
    out = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, out)


def rope_magnitude(scaling) -> float:
    """The factor cos and sin are multiplied by (transformers' attention_factor): 1 except for
    yarn, mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else
    mscale(factor)."""
    kind = str(_scaling_value(scaling, "type")) if scaling is not None else "none"
    if kind != "yarn":
        return 1.0
    factor = float(_scaling_value(scaling, "factor"))
    mscale, mscale_all_dim = float(_scaling_value(scaling, "mscale")), float(_scaling_value(scaling, "mscale_all_dim"))
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def softmax_scale_factor(scaling) -> float:
    """What DeepSeek-V3 multiplies the softmax scale 1/sqrt(qk head size) by: mscale(factor,
    mscale_all_dim)^2 under yarn with mscale_all_dim given (transformers' yarn_apply_mscale), else 1."""
    kind = str(_scaling_value(scaling, "type")) if scaling is not None else "none"
    if kind == "none":
        return 1.0
    mscale_all_dim = float(_scaling_value(scaling, "mscale_all_dim") or 0) if kind == "yarn" else 0.0
    if not mscale_all_dim:
        return 1.0
    m = yarn_mscale(float(_scaling_value(scaling, "factor")), mscale_all_dim)
    return m * m


def rope_table(head_dim: int, max_seq_len: int, theta: float, device=None, scaling=None) -> torch.Tensor:
    """cos/sin table [max_seq_len, head_dim // 2, 2] (fp32) for rotary embeddings; `scaling`:
    model.rope_scaling (None: plain RoPE)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    inv = scale_rope_frequencies(inv, scaling, theta)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    ang = torch.outer(pos, inv)
    table = torch.stack([ang.cos(), ang.sin()], dim=-1)
    magnitude = rope_magnitude(scaling)
    return table if magnitude == 1.0 else table * magnitude


def model_rope_table(cfg, device=None) -> torch.Tensor:
    """The RoPE table of model config `cfg` (rotary size, max_seq_len, rope_theta, rope_scaling):
    the one place every builder and loader takes it from. The rotary size is the head size, or
    under MLA (DeepSeek) qk_rope_head_dim (launcher/models/shape.py rope_dim_of)."""
    return rope_table(rope_dim_of(cfg), cfg.max_seq_len, cfg.rope_theta, device=device,
                      scaling=getattr(cfg, "rope_scaling", None))


def rope_at_positions(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-row RoPE table [b, s, d/2, 2]: the rows of `table` [max_seq_len, d/2, 2] at
    `positions` (int [b, s], e.g. restarting at 0 at each packed document)."""
    return table[positions.long()]


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x [b, s, h, d] by the angles in table [s, d/2, 2] (positions
    0..s-1 in every row) or [b, s, d/2, 2] (per-row positions, from rope_at_positions)."""
    b, s, h, d = x.shape
    xf = x.float().reshape(b, s, h, d // 2, 2)
    if table.dim() == 4:
        cos = table[:, :s, :, 0].view(b, s, 1, d // 2)
        sin = table[:, :s, :, 1].view(b, s, 1, d // 2)
    else:
        cos = table[:s, :, 0].view(1, s, 1, d // 2)
        sin = table[:s, :, 1].view(1, s, 1, d // 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


ATTENTION_KERNELS = ("auto", "sdpa", "flex")


@dataclass(frozen=True)
class KeyIndex:
    """Where the keys of attention lie when they are not the forward's own tokens: the sequence
    positions of the local queries (int [s_q], or [b, s_q] where each row has its own, as context
    parallelism's per-document balancer gives) and of the keys (int [s_k] or [b, s_k], in the
    order the keys arrive), and the keys' document ids ([b, s_k], or None without document masking)."""

    query_index: torch.Tensor
    key_index: torch.Tensor
    key_document_ids: Optional[torch.Tensor] = None


def document_attention_mask(document_ids: torch.Tensor, kernel: str = "auto", dtype: Optional[torch.dtype] = None):
    """The block-causal mask of packed rows, built once per forward and shared by every layer:
    query i may attend to key j when j <= i and both lie in the same document
    (document_ids int [b, s]); attention_mask with the queries' and keys' positions 0..s-1."""
    index = torch.arange(document_ids.shape[1], device=document_ids.device)
    return attention_mask(index, index, document_ids, document_ids, kernel, dtype)


def attention_mask(query_index: torch.Tensor, key_index: torch.Tensor, query_docs: Optional[torch.Tensor] = None,
                   key_docs: Optional[torch.Tensor] = None, kernel: str = "auto",
                   dtype: Optional[torch.dtype] = None):
    """The causal (block-causal with document ids) mask of queries at sequence positions
    `query_index` (int [s_q], or [b, s_q] per row) over keys at `key_index` (int [s_k], or
    [b, s_k]), built once per forward and
    shared by every layer: query i may attend to key j when key_index[j] <= query_index[i] and,
    with `query_docs` [b, s_q] / `key_docs` [b, s_k], both lie in the same document. The keys
    need not be in sequence order (context parallelism's gathered K/V are in rank order).

    kernel "flex" (what "auto" picks on CUDA): a FlexAttention BlockMask, whose blocks that
    cross documents or lie above the diagonal are skipped entirely; "sdpa" (what "auto" picks
    elsewhere: FlexAttention has no CPU backward in torch 2.13): a tensor [b or 1, 1, s_q, s_k]
    for SDPA's attn_mask, boolean (True = attend) or, with `dtype` (the attention's dtype),
    additive (0 / -inf). SDPA turns a boolean mask into an additive one in every call and saves
    that copy for backward (s x s per layer); an additive mask in the query's dtype is used as
    it is, so all layers save the same tensor. All give the same attention, to rounding."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not one of {', '.join(ATTENTION_KERNELS)}")
    device = query_index.device
    if kernel == "auto":
        kernel = "flex" if device.type == "cuda" else "sdpa"
    if kernel == "sdpa":
        allowed = key_index.unsqueeze(-2) <= query_index.unsqueeze(-1)  # [s_q, s_k] or [b, s_q, s_k]
        if allowed.dim() == 2:
            allowed = allowed.unsqueeze(0)
        if query_docs is not None:
            allowed = allowed & (query_docs.unsqueeze(2) == key_docs.unsqueeze(1))
        allowed = allowed.unsqueeze(1)
        if dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
    b = query_docs.shape[0] if query_docs is not None else (query_index.shape[0] if query_index.dim() == 2 else 1)
    # H=None: one mask broadcast over the heads, so it serves any number of local heads (TP).
    return _flex_functions()[1](flex_mask_mod(query_index, key_index, query_docs, key_docs), b, None,
                                query_index.shape[-1], key_index.shape[-1], device=device)


def flex_mask_mod(query_index: torch.Tensor, key_index: torch.Tensor, query_docs: Optional[torch.Tensor] = None,
                  key_docs: Optional[torch.Tensor] = None):
    """attention_mask's rule as a FlexAttention mask_mod (bi, hi, qi, ki) -> bool, with qi/ki
    indices into the local queries and the (possibly gathered, rank-ordered) keys."""
    if query_index.dim() == 2:  # per-row positions (context parallelism's per-document balancer)
        def before(bi, qi, ki):
            return key_index[bi, ki] <= query_index[bi, qi]
    else:
        def before(bi, qi, ki):
            return key_index[ki] <= query_index[qi]
    if query_docs is None:
        def causal(bi, hi, qi, ki):
            return before(bi, qi, ki)
        return causal

    def same_document_causal(bi, hi, qi, ki):
        return (query_docs[bi, qi] == key_docs[bi, ki]) & before(bi, qi, ki)
    return same_document_causal


_FLEX = None


def _flex_functions():
    """(flex_attention, create_block_mask), compiled once on first use: uncompiled, flex_attention
    materialises the whole score matrix, and create_block_mask the [b, s, s] mask."""
    global _FLEX
    if _FLEX is None:
        _FLEX = (torch.compile(flex_attention, dynamic=False), torch.compile(create_block_mask, dynamic=False))
    return _FLEX


def _is_block_mask(mask) -> bool:
    return type(mask).__name__ == "BlockMask"


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, groups: int,
                      expand_kv: bool, scale: Optional[float] = None) -> torch.Tensor:
    """Attention under a document mask from document_attention_mask (FlexAttention or SDPA);
    `scale`: the softmax scale (None: 1/sqrt(q's head size))."""
    extra = {} if scale is None else {"scale": scale}
    if _is_block_mask(mask):
        out = _flex_functions()[0](q, k, v, block_mask=mask, enable_gqa=groups > 1, **extra)
        return out.to(q.dtype)
    if mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)  # SDPA wants an additive mask in the query's dtype
    return _grouped_sdpa(q, k, v, groups, expand_kv, attn_mask=mask, **extra)


def _grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, expand_kv: bool,
                  **mask_args) -> torch.Tensor:
    """SDPA with each K/V head shared by `groups` query heads: enable_gqa, or copies per query
    head with `expand_kv`; `mask_args` is is_causal=True or attn_mask=MASK."""
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, **mask_args)
    if expand_kv:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **mask_args)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask_args)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, expand_kv: bool = False,
                      mask=None) -> torch.Tensor:
    """Causal SDPA with q [b, hq, s, d] and k, v [b, hkv, s, d], hq a multiple of hkv.

    By default SDPA's ``enable_gqa`` shares each K/V head among its query group without
    materialising copies; ``expand_kv`` copies K/V per query head (repeat_interleave) for the
    paths whose attention does not accept enable_gqa (context parallelism's ring attention).
    ``mask``: None (plain causal attention), or a document mask from document_attention_mask.
    """
    groups = q.shape[1] // k.shape[1]
    if mask is not None:
        return _masked_attention(q, k, v, mask, groups, expand_kv)
    return _grouped_sdpa(q, k, v, groups, expand_kv, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query attention through F.scaled_dot_product_attention.

    head_dim: size of one head (0: dim // n_heads). qk_norm (Qwen3): an RMSNorm over each query
    and key head (one weight [head_dim] shared by the heads), before RoPE."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int = 0, qk_norm: bool = False,
                 norm_eps: float = 1e-6):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
        self.head_dim = head_dim or dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        # True only under ring context parallelism (launcher.parallel.cp.use_expanded_kv): torch's
        # ring attention has no enable_gqa support, so K/V are copied to every query head there.
        self.expand_kv = False
        # Set only under all-gather context parallelism (launcher.parallel.cp.use_gathered_kv): a
        # function [b, s_local, ...] -> [b, s_whole, ...] returning every rank's keys and values;
        # the mask then says which of them each local query sees.
        self.kv_gather = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask=None) -> torch.Tensor:
        """x [b, s, dim]; rope: [s, d/2, 2] or per-row [b, s, d/2, 2]; mask: None (causal) or
        document_attention_mask's mask."""
        b = x.shape[0]
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        # Local sizes: under tensor parallelism each rank holds a subset of the heads, and
        # under sequence parallelism q holds the full (gathered) sequence.
        s = q.shape[1]
        q = q.view(b, s, -1, self.head_dim)
        k = k.view(b, s, -1, self.head_dim)
        v = v.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.kv_gather is not None:  # one collective for K and V, with kv heads only (GQA)
            k, v = self.kv_gather(torch.cat([k, v], dim=-1)).split([k.shape[-1], v.shape[-1]], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        o = grouped_attention(q, k, v, expand_kv=self.expand_kv, mask=mask)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
