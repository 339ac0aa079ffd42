"""Time of the memory-bound work of a training step: norms, RoPE, SwiGLU, residuals, cross-entropy,
float8 casts, and per family the attention's own norms (Qwen3's QK-norm, MLA's latent norms), MLA's
q/k assembly and DeepSeek-V3's router. Pure Python; perf.py adds it to the matmul time.

These ops move bytes, they do not use the tensor cores: each costs the bytes it reads and
writes over `hbm_gbps * HBM_EFFICIENCY`. Byte counts are per token and follow the code the
runtime runs (launcher/models/layers.py, launcher/engines/base.py, launcher/parallel/fp8.py):

- eager (trainer.compile=false) runs every PyTorch op as its own kernel: RMSNorm in fp32 is
  six kernels (cast, pow, mean, multiply, weight multiply, cast back), RoPE upcasts q and k to
  fp32 and rotates them in several kernels, SwiGLU is silu then a multiply;
- compiled (trainer.compile=true, per block) fuses each norm with its residual add, RoPE with
  its casts and silu with the multiply: one read of the inputs, one write of the outputs; an MoE
  block is compiled in parts (launcher/parallel/compile.py), so its residual adds, routing, token
  movement and routed experts' SwiGLU stay eager and its norms are fused with nothing;
- backward reads the saved inputs and the incoming gradient and writes the gradient:
  BACKWARD_BYTES_FACTOR x the forward bytes;
- recomputation (selective op-level or full AC) runs the forward elementwise ops again;
- the loss (F.cross_entropy on fp32 logits, outside the compiled blocks) is eager always;
- float8 (torchao, dynamic scaling): every converted Linear computes an amax of its input and
  casts it (read a, read a, write 1 byte per element), in backward the same for the gradient
  of its output, plus transposed fp8 copies of both for the weight gradient; rowwise scaling
  needs a separate amax for the transposed copies;
- MoE blocks move each token's top_k dim-wide rows into expert order, under EP to local-expert
  order and back, and combine them weighted (`moe_dispatch_bytes`).
Under sequence parallelism every elementwise op of a block runs on 1/tp of the tokens; without
it the norms and residual adds run on the full sequence on every TP rank.
"""

from __future__ import annotations

from typing import Any

from launcher.plan.layout import Layout
from launcher.plan.estimate.params import ModelShape

# Streaming kernels reach about 80-90 % of HBM bandwidth on H100/A100 (STREAM-like copy
# kernels); PyTorch's elementwise kernels on these tensor sizes sit at the low end.
HBM_EFFICIENCY = 0.8
# An elementwise op's backward reads its saved input(s) and the output gradient and writes
# the input gradient: about twice its forward traffic.
BACKWARD_BYTES_FACTOR = 2.0


def _inner_norm_bytes(shape: ModelShape, lay: Layout) -> float:
    """Forward bytes per token of the attention's own RMSNorms (Qwen3's QK-norm over every q and k
    head, MLA's latent norms, which TP leaves whole): six fp32 kernels eager, one read and one write
    compiled."""
    a, t = lay.act_bytes, lay.mesh.tp
    per_elem = 2 * a if lay.compile else 2 * a + 36
    return sum(per_elem * n.width / (t if n.split else 1) for n in shape.attention_layout.norms)


def router_bytes(shape: ModelShape, lay: Layout) -> float:
    """Forward bytes per token of one MoE router's elementwise work beyond its matmul, for DeepSeek-V3's
    router (launcher/models/moe.py, sigmoid scores over E experts; TP leaves the router whole):

    eager: fp32 cast of the logits (a + 4) E, sigmoid 8E, + correction bias 8E, with n_group > 1
    the per-group top-2 read 4E, the group mask expanded to [T, E] and negated (4 + 1 + 2) E,
    masked_fill 9E, then the top-k read 4E, and the sequence-wise balance loss (one-hot [T, E]
    written, scores normalised and averaged: 16E): (a + 60) E with groups. Eager under
    trainer.compile too: launcher/parallel/compile.py leaves an MoE block's routing uncompiled.

    The softmax router of Mixtral and Qwen3-MoE is not costed (as before the family-aware formulas:
    Llama and Mixtral plans stay as they were): a few hundred bytes per token at 8 experts, under
    0.05 % of a Mixtral block's elementwise bytes."""
    if shape.score_func != "sigmoid":
        return 0.0
    a, e = lay.act_bytes, shape.n_experts
    per_e = a + 4 + 8 + (8 if shape.correction_bias else 0) + 4 + 16
    if shape.n_group > 1:
        per_e += 4 + 7 + 9
    return float(per_e * e)


def moe_dispatch_bytes(shape: ModelShape, lay: Layout) -> float:
    """Forward bytes per token of one MoE block's token movement (launcher/models/moe.py forward,
    launcher/parallel/ep.py dispatch/combine), each of the top_k copies a `dim`-wide row:

    - the rows gathered into expert order (x[token_idx]): read and write, 2a per element;
    - under expert parallelism, the received rows permuted to local-expert order (rows[perm]) and
      back (index_copy) before the combine's all-to-all: 2a each;
    - the combine: y.float() (a + 4), times the routing weight (8), cast back (4 + a) and
      index_add_ into the output (3a: read the rows, read and write the sums) = 16 + 5a.
    All eager, under trainer.compile too (launcher/parallel/compile.py compiles neither the routing
    nor the routed experts).
    Per token routed: with the experts folded over TP each TP rank moves its own 1/tp of the tokens
    (block_forward_bytes divides by tp); replicated, every TP rank moved them all."""
    if not shape.n_moe_layers:
        return 0.0
    a, k, h = lay.act_bytes, max(1, shape.top_k), shape.dim
    per_elem = 2 * a + (4 * a if lay.mesh.ep > 1 else 0) + (16 + 5 * a)
    return per_elem * k * h


def block_forward_bytes(shape: ModelShape, lay: Layout) -> float:
    """Bytes the elementwise ops of one block's forward move per token on one GPU (the attention's
    sizes from the family's layout, launcher/models/<family>/params.py attention_layout).

    Under trainer.compile an MoE block is compiled in parts (launcher/parallel/compile.py: the
    routed part's data-dependent shapes would break the graph): its norms, attention and shared
    experts are compiled one by one, so each norm is fused with nothing and the residual adds run
    eager; the router, the token movement and the routed experts' SwiGLU run eager. Averaged over
    the blocks, like the FFN width: only MoE blocks route."""
    a, h, f, t = lay.act_bytes, shape.dim, shape.ffn_dim, lay.mesh.tp
    moe_share = shape.n_moe_layers / shape.n_layers if shape.n_moe_layers else 0.0
    routed_f = shared_f = 0.0
    if shape.n_moe_layers:
        routed_f = shape.moe_ffn_dim * max(1, shape.top_k)
        shared_f = shape.n_shared_experts * shape.moe_ffn_dim
        f = routed_f + shared_f
    at = shape.attention_layout
    hq = at.n_heads * at.v_head_dim  # the SDPA output (n_heads x v head)
    rope_elems = (at.n_heads + at.rope_k_heads) * at.rope_dim
    sp = t if lay.sp else 1  # norms and residual adds: sequence-sharded only under SP
    # TP splits a dense FFN's columns; an MoE's tokens when its experts are folded over TP (each TP
    # rank routes 1/tp of them), else every TP rank runs the whole MoE.
    ft = (t if lay.experts_folded else 1) if shape.n_moe_layers else t
    mt = t if lay.experts_folded else 1  # an MoE block's tokens per TP rank: 1/tp when folded
    extra = 0.0
    if at.norms:
        extra += _inner_norm_bytes(shape, lay)
    if at.assembled_qk:
        # MLA: q and k are concatenated from their no-RoPE and RoPE parts (the shared RoPE key
        # expanded to every head): one read and one write of each.
        extra += 2 * a * 2 * at.n_heads * at.qk_head_dim / t
    if shape.n_moe_layers:
        # Eager under compile too (docstring); folded over TP, each TP rank routes 1/tp of the tokens.
        extra += (router_bytes(shape, lay) + moe_dispatch_bytes(shape, lay)) * moe_share / mt
    norm = (2 * a + 36) * h  # fp32 RMSNorm as six kernels (module docstring)
    residual = 2 * 3 * a * h
    if lay.compile:
        fused_norms = 2 * 4 * a * h  # fused residual add + norm: read x and residual, write sum and output
        # An MoE block: each norm compiled alone (read, write), the residual adds eager.
        norms = (fused_norms * (1 - moe_share) + (2 * 2 * a * h + residual) * moe_share) / sp
        rope = 2 * a * rope_elems / t
        attn_copy = 2 * a * hq / t
        swiglu = 3 * a * (f - routed_f * moe_share) / ft + 5 * a * routed_f * moe_share / mt
        return norms + rope + attn_copy + swiglu + extra
    rope = (2 * a + 48) * rope_elems  # fp32 upcast, 4 multiplies, 2 adds, stack, cast back
    attn_copy = 2 * a * hq  # the SDPA output made contiguous for wo
    swiglu = 5 * a * f  # silu: read + write; multiply: 2 reads + write
    return (2 * norm + residual) / sp + (rope + attn_copy) / t + swiglu / ft + extra


def fp8_cast_bytes(shape: ModelShape, lay: Layout) -> float:
    """Bytes per token per block the float8 casts of the converted Linears move (forward + backward)."""
    if lay.numerics.precision != "fp8":
        return 0.0
    a, h, t = lay.act_bytes, shape.dim, lay.mesh.tp
    f = shape.ffn_dim if not shape.n_moe_layers else shape.moe_ffn_dim * max(1, shape.top_k)
    mms = shape.attention_layout.linears
    split_in = sum(m.in_features for m in mms if m.split)
    split_out = sum(m.out_features for m in mms if m.split)
    inputs = (split_in + 2 * h + f) / t  # each attention matmul; w1, w3; w2 each cast their input
    grads = (split_out + 2 * f + h) / t  # gradient of every Linear's output
    # MLA's down-projections are whole on every TP rank.
    whole = sum(m.in_features + m.out_features for m in mms if not m.split)
    cast = 2 * a + 1  # amax read, cast read, fp8 write
    transposed = (a + 1) if lay.numerics.fp8_recipe == "tensorwise" else (2 * a + 1)
    return (inputs + grads + whole) * (cast + transposed)


def loss_bytes(shape: ModelShape, lay: Layout) -> float:
    """Bytes per token of the cross-entropy on fp32 logits, forward + backward (vocab split by TP)."""
    a = lay.act_bytes
    # forward: cast to fp32 (read a, write 4), log-softmax (3 reads, 1 write of fp32);
    # backward: softmax - one-hot (read 4, write 4), cast back (read 4, write a).
    per_elem = (a + 4) + 16 + 8 + (4 + a)
    return per_elem * shape.vocab_size / lay.mesh.tp


def elementwise_s(shape: ModelShape, lay: Layout, hw: Any, n_layers: int, recomputed: float,
                  has_output: bool, tokens: float) -> float:
    """Seconds of memory-bound work for one micro-batch of `tokens` tokens on one GPU of a stage.

    `recomputed`: share of the blocks whose elementwise forward runs again in backward.
    """
    bw = hw.hbm_gbps * 1e9 * HBM_EFFICIENCY
    fwd = block_forward_bytes(shape, lay)
    per_block = fwd * (1 + BACKWARD_BYTES_FACTOR + recomputed) + fp8_cast_bytes(shape, lay)
    total = per_block * n_layers + (loss_bytes(shape, lay) if has_output else 0.0)
    return total * tokens / bw
