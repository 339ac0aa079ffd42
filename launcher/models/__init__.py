"""Model definitions (no parallelism here). ``build_model(cfg)`` is the one entry point."""

from __future__ import annotations

from torch import nn

from launcher.models.transformer import Transformer, TransformerBlock


def build_model(cfg) -> nn.Module:
    """Build the decoder described by a ``ModelConfig`` (dense, or MoE when n_experts > 0).

    Works under ``with torch.device("meta")``: parameters are then shapes only; call
    ``model.to_empty(device=...)`` and ``model.init_weights(seed)`` after sharding.
    """
    if cfg.n_experts > 0 and cfg.top_k <= 0:
        raise ValueError(f"model {cfg.name!r}: n_experts={cfg.n_experts} needs top_k >= 1 (set model.top_k)")
    return Transformer(cfg)


__all__ = ["build_model", "Transformer", "TransformerBlock"]
