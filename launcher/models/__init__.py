"""Model definitions (no parallelism here). ``build_model(cfg)`` is the one entry point.

Each family lives in its own folder behind launcher/models/family.py's registry, keyed by
model.family. This package imports no torch itself: the planner reads the families' pure-Python
parts (Hugging Face maps, parameter formulas) through it.
"""

from __future__ import annotations

from typing import Any

from launcher.models.family import family_of


def build_model(cfg) -> Any:
    """Build the decoder described by a ``ModelConfig`` (its family's model class).

    Works under ``with torch.device("meta")``: parameters are then shapes only; call
    ``model.to_empty(device=...)`` and ``model.init_weights(seed)`` after sharding.
    """
    if cfg.n_experts > 0 and cfg.top_k <= 0:
        raise ValueError(f"model {cfg.name!r}: n_experts={cfg.n_experts} needs top_k >= 1 (set model.top_k)")
    return family_of(cfg).model_class()(cfg)


def __getattr__(name: str) -> Any:
    # `from launcher.models import Transformer` keeps working without importing torch up front.
    if name in ("Transformer", "TransformerBlock"):
        # lazy: transformer imports torch; this package stays torch-free for the planner
        from launcher.models import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["build_model", "Transformer", "TransformerBlock"]
