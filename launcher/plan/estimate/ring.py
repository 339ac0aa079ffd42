"""Context parallelism's ring attention, costed the way torch runs it. Pure Python; perf.py uses it.

The runtime (launcher/parallel/cp.py) uses torch's `context_parallel`
(torch/distributed/tensor/experimental/_context_parallel/_attention.py): with the head-tail
load balancer each of the cp ranks holds 2 chunks of the sequence (n = s/cp tokens) and, per
layer, runs cp attention kernels ("hops"):
- hop 0, its own K/V, causal: an n x n causal block; hops 1..cp-1, another rank's K/V: an
  (n x n/2) or (n/2 x n) block without mask. Every rank does the same causal share, so the
  attention FLOPs per rank are the causal total / cp (perf.py counts them).
- forward: K/V are all-gathered once (the default "allgather" rotation) while hop 0 runs; each
  hop's output is cast to fp32 and merged into the running output with its logsumexp
  (`_SDPAMerger`), a partial hop's through a `torch.cat` of the two halves; every hop but the
  last also concatenates K and V into one send buffer.
- backward: K/V are all-gathered again, and the dK/dV accumulated in fp32 travel the ring: after
  each hop a rank adds its block's dK/dV to the buffer it received and sends it on (all-to-all,
  `_AllToAllRotater`), so they cross cp links, the last one after the layer's last hop.
  dQ is accumulated in fp32 too.
- K/V are expanded to every query head first (no enable_gqa in ring attention).

Costed here: the bytes those merges, accumulations and concatenations move (memory-bound, at
HBM bandwidth), the collectives, and RING_HOP_EFFICIENCY: the hops' kernels measured slower than
the single causal kernel of the same FLOPs (a fit with a hypothesis, see the constant).
"""

from __future__ import annotations

from typing import Any

from launcher.plan.estimate.elementwise import HBM_EFFICIENCY
from launcher.plan.layout import Layout
from launcher.plan.estimate.params import ModelShape

F32 = 4.0

# Published (torchtitan Llama 3.1 8B, Table 2 of benchmarks/llama3_h100_202412_torchtitan.md, 32K
# tokens per GPU in every row): from CP 2 to CP 4 and CP 8 the cost of one hop grows from about
# 4.5 s to 7.3 s per step where its FLOPs and its kernel shapes (32K x 16K) are the same, and
# the code above has nothing that grows with cp beyond the hop count. The merge traffic below
# explains about 0.3 s of it. The rest is modelled as the hop kernels running at this fraction of
# the single causal kernel's rate. HYPOTHESIS, not derived: lock-step hops wait for the slowest of
# cp power-capped GPUs every hop, and NCCL's copy kernels for the K/V gather and the fp32 dK/dV
# take SMs from the attention kernels while they run. Fitted to Table 2: the value that centres its
# four tokens/s ratios (0.96, 0.85, 1.11, 1.14); no per-hop constant fits CP 2 and CP 4 both.
# Table 6 (405B, another model and layout, not used for the fit) is its check: 0.86-1.09.
RING_HOP_EFFICIENCY = 0.88


def ring_hops(lay: Layout) -> int:
    """Attention kernels per layer and pass beyond the local causal one (cp - 1)."""
    return max(0, lay.mesh.cp - 1)


def expanded_widths(shape: ModelShape) -> tuple:
    """(q, k, v, o) widths per token as the ring gets them: K/V repeated to every query head."""
    at = shape.attention_layout
    q = at.n_heads * at.qk_head_dim
    o = at.n_heads * at.v_head_dim
    return q, q, o, o


def kv_bytes_per_token(shape: ModelShape, lay: Layout) -> float:
    """Bytes of one token's K and V as the ring sends them (expanded, activation dtype; split by tp)."""
    _, k, v, _ = expanded_widths(shape)
    return (k + v) * lay.act_bytes / lay.mesh.tp


def merge_bytes_per_token(shape: ModelShape, lay: Layout) -> tuple:
    """(forward, backward) HBM bytes per local token, layer and hop that the ring's bookkeeping
    moves beyond the attention kernels (torch's _attention.py, averaged over ranks: half the hops
    are partial, i.e. touch half the output):

    forward: the K/V send buffer (read and write K+V in the activation dtype); the block output
    cast to fp32 (read a, write 4 per element, three quarters of the output on average); the merge
    (out - block_out, times sigmoid, subtracted: 32 B per fp32 element, half of it on a partial
    hop, which then rebuilds the output with torch.cat: 8 B) = 28 B per element on average.
    backward: the K/V send buffer again; dK/dV accumulated in fp32 (+= a bf16 block gradient:
    10 B per element, or half that on the first half plus the torch.cat of both: 13 B; 11.5 on
    average), then concatenated into the fp32 send buffer (8 B); dQ the same 11.5 B."""
    q, k, v, o = expanded_widths(shape)
    a, t = lay.act_bytes, lay.mesh.tp
    send = 2.0 * (k + v) * a
    fwd = send + 0.75 * (a + F32) * o + 28.0 * o
    bwd = send + (11.5 + 8.0) * (k + v) + 11.5 * q
    return fwd / t, bwd / t


def ring_bookkeeping_s(shape: ModelShape, lay: Layout, hw: Any, n_layers: int, recompute: float,
                       tokens: float) -> float:
    """Memory-bound seconds of one micro-batch's ring bookkeeping on a rank holding `tokens`
    tokens: per layer and hop, the forward's (again when recomputed) and the backward's bytes."""
    hops = ring_hops(lay)
    if not hops:
        return 0.0
    fwd, bwd = merge_bytes_per_token(shape, lay)
    return hops * n_layers * tokens * (fwd * (1 + recompute) + bwd) / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)


def hop_time_factor(lay: Layout) -> float:
    """Attention time under the ring / the same FLOPs in one causal kernel: the local causal hop is
    1/cp of a rank's attention FLOPs, the cp - 1 others run at RING_HOP_EFFICIENCY."""
    cp = lay.mesh.cp
    if cp <= 1:
        return 1.0
    return (1.0 + (cp - 1) / RING_HOP_EFFICIENCY) / cp
