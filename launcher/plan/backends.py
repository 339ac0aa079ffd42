"""Backend resolver: which implementation (native PyTorch or DeepSpeed) serves each feature.

Decided once here and recorded in the Plan; the runtime obeys it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from launcher.config.schema import JobConfig


@dataclass
class BackendChoice:
    backend: str  # native | deepspeed
    impl: str  # e.g. "FSDP2 fully_shard", "DeepSpeed ZeRO-3"
    reason: str


def resolve_backends(spec: JobConfig) -> Dict[str, BackendChoice]:
    """Per-feature backend decision. (Foundation version: everything native.)"""
    zero = spec.parallel.zero_stage
    return {
        "sharding": BackendChoice(
            "native",
            f"FSDP2 fully_shard (zero_stage={zero})",
            "native FSDP2 serves ZeRO-2/3 with DTensor composability",
        ),
    }
