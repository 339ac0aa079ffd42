"""The interface between the training loop and a backend (native PyTorch or DeepSpeed).

The trainer owns the loop, data, checkpoint folders, metrics and signals; an Engine owns
the model, optimizer, LR schedule and how one optimizer step is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Protocol, Tuple

import torch

Microbatch = Tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), int64 [micro_batch, seq_len]


@dataclass
class StepStats:
    loss: float  # mean LM loss over every token of the global batch; identical on all ranks
    grad_norm: float  # global L2 norm of the gradients before clipping
    lr: float  # learning rate used for this step
    extra: Dict[str, float] = field(default_factory=dict)  # e.g. moe_aux_loss


class Engine(Protocol):
    """Engines also expose `model_parts` (list of modules) and `optimizers` (list), which the
    memory tracker (launcher/runtime/memtrack.py) reads when trainer.track_memory=true."""

    def train_step(self, microbatches: List[Microbatch]) -> StepStats:
        """One optimizer step over this data-parallel rank's micro-batches (collective)."""

    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state into `directory` (collective)."""

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (collective); the layout may differ from the saver's."""

    def export(self, path: Path, fmt: str) -> None:
        """Write a consolidated model (fmt: fp32 | safetensors) to `path` (collective)."""
