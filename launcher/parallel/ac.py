"""Activation checkpointing per block: none | selective | full.

- full: every block's activations are recomputed in backward (stores only block inputs).
- selective, ``activation_checkpointing.selective="op"``: op-level selective checkpointing:
  the outputs of matmuls, attention and TP collectives are saved, the cheap element-wise
  ops (norms, activations, RoPE) are recomputed (Korthikanti et al.'s trade-off).
- selective, ``activation_checkpointing.selective="op_alternate_mm"``: as "op", but only every
  second ``aten.mm`` output of a block is saved (the 1st, 3rd, 5th, ...; the others are recomputed
  in backward), the policy torchtitan's op-level selective AC uses. On the Llama block (wq, wk, wv,
  wo, w1, w3, w2) it saves wq, wv, w1 and w2 and recomputes wk, wo and w3: less memory for about
  2 x (kv_dim + dim + ffn_dim) x dim FLOPs per token and block more.
- selective, an integer string N: every N-th block (0, N, 2N, ...) is fully checkpointed.

Wrapping uses ``checkpoint_wrapper``; its ``_checkpoint_wrapped_module`` name component
is dropped by torch's state-dict helpers and by launcher.models.init.canonical_name, so
checkpoints and initialisation are the same as without AC.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

log = logging.getLogger(__name__)


def _save_list():
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    c10d = getattr(torch.ops, "_c10d_functional", None)
    if c10d is not None:
        # Recomputing a collective costs communication, not just FLOPs: keep its output.
        for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"):
            if hasattr(c10d, name):
                ops.add(getattr(c10d, name).default)
    return ops


def _op_policy(save_ops, ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_mm_policy(save_ops, counts, ctx, op, *args, **kwargs):
    # Forward and recompute count their own mm calls, so the recompute makes the same
    # save/recompute decision for the n-th matmul as the forward did.
    if op == torch.ops.aten.mm.default:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE


def _alternate_mm_contexts(save_ops):
    # Called once per checkpointed forward of a block: the counts restart with every block call.
    counts = {"forward": 0, "recompute": 0}
    return create_selective_checkpoint_contexts(partial(_alternate_mm_policy, save_ops, counts))


def _wrap_selective_op_alternate_mm(block: nn.Module) -> nn.Module:
    return checkpoint_wrapper(block, context_fn=partial(_alternate_mm_contexts, _save_list()),
                              preserve_rng_state=False)


def _wrap_full(block: nn.Module) -> nn.Module:
    return checkpoint_wrapper(block, preserve_rng_state=False)


def _wrap_selective_op(block: nn.Module) -> nn.Module:
    ctx_fn = partial(create_selective_checkpoint_contexts, partial(_op_policy, _save_list()))
    return checkpoint_wrapper(block, context_fn=ctx_fn, preserve_rng_state=False)


def apply_activation_checkpointing(model: nn.Module, mode: str, selective: str = "op") -> nn.Module:
    """Wrap the blocks in ``model.layers`` in place according to ``mode``."""
    if mode == "none":
        return model
    if mode == "full":
        wrap, every = _wrap_full, 1
    elif mode == "selective" and selective == "op":
        wrap, every = _wrap_selective_op, 1
    elif mode == "selective" and selective == "op_alternate_mm":
        wrap, every = _wrap_selective_op_alternate_mm, 1
    elif mode == "selective" and selective.isdigit() and int(selective) >= 1:
        wrap, every = _wrap_full, int(selective)
    else:
        raise ValueError(
            f"activation_checkpointing.mode={mode!r} selective={selective!r} is not understood; "
            f"use mode none|selective|full, and for selective 'op', 'op_alternate_mm' or a positive "
            f"integer N (checkpoint every N-th block)"
        )
    wrapped = 0
    for name, block in list(model.layers.items()):
        if int(name) % every == 0:
            model.layers[name] = wrap(block)
            wrapped += 1
    log.info("applied %s activation checkpointing to %d of %d blocks%s", mode, wrapped,
             len(model.layers), f" (selective={selective})" if mode == "selective" else "")
    return model
