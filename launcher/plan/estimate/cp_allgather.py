"""The costs of all-gather context parallelism (backend.cp_impl=allgather, launcher/parallel/cp.py).

Per layer and micro-batch, every cp rank all-gathers the keys and values of the whole sequence in
forward (again when the block is recomputed) and reduce-scatters their gradients in backward:
GQA gathers the kv heads' K and V (not repeated to the query heads; split by tp), MLA its
compressed latent and shared RoPE key (whole on every TP rank), which each rank then up-projects
through wkv_b for the whole sequence: cp times the wkv_b FLOPs of its own tokens. The gathered
K/V (MLA: also the latent and the up-projected K/V) of the whole sequence are saved for backward
on every rank. The collectives run on the compute stream, before and after the attention that
needs them, so the planner counts them exposed (no overlap). Ring attention's costs are in ring.py.
Pure Python.
"""

from __future__ import annotations

from typing import Any

from launcher.plan.estimate.params import ModelShape


def is_allgather(lay: Any) -> bool:
    """All-gather context parallelism: cp > 1 and the Layout's owners chose it."""
    return lay.mesh.cp > 1 and getattr(lay.owners, "cp_impl", "ring") == "allgather"


def gathered_bytes_per_token(shape: ModelShape, lay: Any) -> float:
    """Bytes of one token's gathered keys and values on one GPU (activation dtype): GQA's kv heads'
    K and V, split by tp; MLA's latent and shared RoPE key, whole on every TP rank."""
    at = shape.attention_layout
    if at.assembled_qk:  # MLA: the input of the v_source up-projection (the latent) + the RoPE key
        return (at.linear(at.v_source).in_features + at.rope_dim) * lay.act_bytes
    return at.n_kv_heads * (at.qk_head_dim + at.v_head_dim) * lay.act_bytes / lay.mesh.tp


def repeated_up_projection_params(shape: ModelShape) -> int:
    """MLA: the weights of wkv_b (the up-projection of the gathered latent), which every cp rank
    applies to the whole sequence; 0 for attention that gathers its K/V themselves."""
    at = shape.attention_layout
    if not at.assembled_qk:
        return 0
    up = at.linear(at.v_source)
    return up.in_features * up.out_features


def repeated_up_projection_flops(shape: ModelShape, lay: Any, n_layers: int, recompute: float) -> float:
    """Extra FLOPs on one GPU per micro-batch: the (cp - 1)/cp of the sequence whose latent a rank
    up-projects beyond its own tokens (forward + backward, and a recomputed forward), split by tp."""
    if not is_allgather(lay):
        return 0.0
    cp = lay.mesh.cp
    return (6.0 * repeated_up_projection_params(shape) * n_layers * lay.microbatch_tokens * (1 + recompute / 3)
            * (cp - 1) / cp / lay.mesh.tp)
