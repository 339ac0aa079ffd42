"""``trainer.compile``: torch.compile each transformer block in place.

Per block rather than the whole model: blocks are identical so the compiled code is reused
(one compile, not n_layers), FSDP's per-block hooks stay outside the compiled regions, and
``Module.compile`` keeps parameter names (no ``_orig_mod``), so checkpoints are unchanged.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module) -> nn.Module:
    """Compile every block of ``model.layers`` (in place) and return the model."""
    for block in model.layers.values():
        block.compile(fullgraph=False)
    log.info("compiled %d blocks with torch.compile (per block)", len(model.layers))
    return model
