"""``trainer.compile``: torch.compile each transformer block in place.

Per block rather than the whole model: blocks are identical so the compiled code is reused
(one compile, not n_layers), FSDP's per-block hooks stay outside the compiled regions, and
``Module.compile`` keeps parameter names (no ``_orig_mod``), so checkpoints are unchanged.

MoE blocks: the routed part has data-dependent shapes (tokens per expert), which makes
dynamo break the graph and recompile for new split sizes (measured: a 4-layer debug_moe
compile took ~5x longer than the dense model). So in an MoE block only the attention, the
norms and the shared experts are compiled; routing and routed experts stay eager.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)


def _inner(block: nn.Module) -> nn.Module:
    # Activation checkpointing wraps the block; reach the block to find its sub-modules.
    return getattr(block, "_checkpoint_wrapped_module", block)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every block of ``model.layers`` (in place) and return the model."""
    whole, partial = 0, 0
    for block in model.layers.values():
        inner = _inner(block)
        moe = getattr(inner, "moe", None) if getattr(inner, "is_moe", False) else None
        if moe is None:
            block.compile(fullgraph=False)
            whole += 1
            continue
        for sub in (inner.attention_norm, inner.attention, inner.ffn_norm, moe.shared_experts):
            if sub is not None:
                sub.compile(fullgraph=False)
        partial += 1
    log.info("compiled %d blocks whole and %d MoE blocks without their routed experts "
             "(torch.compile per block)", whole, partial)
    return model
