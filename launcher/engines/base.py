"""The Engine contract both engines meet, and the pieces they share (written once here).

The trainer owns the loop, data, checkpoint folders, metrics and signals; an Engine owns
the model, optimizer, LR schedule and how one optimizer step is computed. Both engines are
built the same way:

    Engine(model_cfg, optim_cfg, layout, device, options)

- ``layout``: the resolved Layout (launcher/plan/layout.py): mesh degrees, micro-batches,
  schedule, ZeRO stage, precision, FSDP on/off, backend per feature. Engines obey it and
  derive nothing from the config again;
- ``options``: the narrow settings the Layout does not cover (`EngineOptions`).

Both expose ``model_parts`` (this rank's modules) and ``optimizers`` (torch optimizers or
wrappers with ``.optimizer``), which the memory tracker reads (trainer.track_memory), and
``built()``: what the engine actually built, in Layout terms, so tests can compare it with
plan.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from launcher.config.schema import ActivationCheckpointingConfig, Fp8Config, OffloadConfig

Microbatch = Tuple[torch.Tensor, torch.Tensor]  # (inputs, labels), int64 [micro_batch, seq_len]

IGNORE_INDEX = -100  # labels equal to this are not counted in the loss


@dataclass
class StepStats:
    loss: float  # mean LM loss over every token of the global batch; identical on all ranks
    grad_norm: float  # global L2 norm of the gradients before clipping
    lr: float  # learning rate used for this step
    extra: Dict[str, float] = field(default_factory=dict)  # e.g. moe_aux_loss


@dataclass(frozen=True)
class EngineOptions:
    """What an engine needs besides the model, the optimizer config and the Layout."""

    total_steps: int
    grad_clip: float = 1.0
    seed: int = 1234
    compile: bool = False
    ac: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # nvme_path, pin_memory
    fp8: Fp8Config = field(default_factory=Fp8Config)  # recipe, emulate, exclusions
    work_dir: Optional[Path] = None  # where the DeepSpeed engine writes its JSON (the run dir)
    export_dtype: str = "bf16"  # checkpoint.export=hf weights: bf16 | fp16 | fp32
    export_tokenizer_files: Tuple[Path, ...] = ()  # copied into an hf export
    # The rehearsal's FakeTensorMode (launcher/rehearse/rank.py): the native engine enters it
    # once the model is sharded (meshes and sharding need real rank tensors), so materialisation,
    # optimizer and steps use fake tensors; the caller exits it. None in real runs.
    fake_mode: Optional[Any] = None


class Engine(Protocol):
    """One optimizer step at a time over this data-parallel rank's micro-batches."""

    model_parts: List[nn.Module]
    optimizers: List[Any]

    def train_step(self, microbatches: List[Microbatch]) -> StepStats:
        """One optimizer step over this data-parallel rank's micro-batches (collective)."""

    def eval_step(self, microbatches: List[Microbatch]) -> float:
        """Mean token loss over the global batch, forward only; no state changes (collective)."""

    def save(self, directory: Path) -> None:
        """Write model, optimizer and LR-schedule state into `directory` (collective)."""

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (collective); the layout may differ from the saver's."""

    def export(self, path: Path, fmt: str) -> None:
        """Write a consolidated model (fmt: fp32 | safetensors | hf) to `path` (collective)."""

    def built(self) -> Dict[str, Any]:
        """What was built, in Layout terms (mesh sizes, micro-batches, FSDP, backends)."""


# ----------------------------------------------------------------------------- shared pieces


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the token cross-entropies in fp32, ignoring IGNORE_INDEX labels."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def local_token_count(microbatches: List[Microbatch]) -> int:
    """Tokens that count in the loss on this rank (labels != IGNORE_INDEX)."""
    return sum(int((lab != IGNORE_INDEX).sum()) for _, lab in microbatches)


def aux_loss_scale(n_microbatches: int, averaging_ranks: int) -> float:
    """Weight of the MoE load-balancing loss per micro-batch so that the step's gradient is the
    mean over micro-batches and over the ranks whose gradients are summed (1 when the backend
    averages over them itself)."""
    return 1.0 / (n_microbatches * averaging_ranks)


def built_report(mesh: Dict[str, int], pp_microbatches: Optional[int], fsdp: bool,
                 backends: Dict[str, Any]) -> Dict[str, Any]:
    """The `built()` dict both engines return (same keys, so one comparison serves both):
    mesh sizes, pipeline micro-batches per step (None without a pipeline), whether FSDP2 wraps
    the model, and who serves each feature."""
    return {"mesh": dict(mesh), "pp_microbatches": None if pp_microbatches is None else int(pp_microbatches),
            "fsdp": bool(fsdp), "backends": dict(backends)}
