"""The Engine contract both engines meet, and the pieces they share (written once here).

The trainer owns the loop, data, checkpoint folders, metrics and signals; an Engine owns
the model, optimizer, LR schedule and how one optimizer step is computed. Both engines are
built the same way:

    Engine(model_cfg, optim_cfg, layout, device, options)

- ``layout``: the resolved Layout (launcher/plan/layout.py): mesh degrees, micro-batches,
  schedule, ZeRO stage, precision, FSDP on/off, backend per feature. Engines obey it and
  derive nothing from the config again;
- ``options``: the narrow settings the Layout does not cover (`EngineOptions`): step count,
  clipping, seed, export and the run folder. Precision, fp8, activation checkpointing and
  offload come from the Layout only.

Both expose ``model_parts`` (this rank's modules) and ``optimizers`` (torch optimizers or
wrappers with ``.optimizer``), which the memory tracker reads (trainer.track_memory), and
``built()``: what the engine actually built, in Layout terms, so tests can compare it with
plan.json.

Micro-batches are ``launcher.data.batch.Microbatch`` records (inputs, labels and the optional
positions / document_ids / sources); a plain ``(inputs, labels)`` tuple still works and means
no masking, default positions and no mixture (``as_microbatch``). Engines hand positions and
document ids to the model in every path; with ``sources`` set they also report the mean loss
per mixture source (``StepStats.source_loss``, ``EvalStats``), gathered with the step's one
loss all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from launcher.data.batch import Microbatch

IGNORE_INDEX = -100  # labels equal to this are not counted in the loss


class StepStats:
    """One optimizer step's statistics, identical on all ranks.

    An engine hands device tensors (0-dim loss, grad norm and extras; the all-reduced per-source
    sums as one [2 * n_sources] tensor, see `source_sums`): nothing here waits for the device
    until a value is read. The first read of `loss`, `grad_norm`, `extra` or `source_loss` copies
    all of them to the host in one transfer per device (`materialise`; on a GPU the host waits for
    the step there) and keeps the numbers; `materialised` tells whether that has happened. The
    trainer reads them at log and validation steps only. (The native engine still reads one
    boolean per step, whether the global gradient norm is finite, to skip a non-finite step:
    launcher/runtime/numerics.py.) Python numbers are accepted too (what an engine already has on the
    host costs nothing to read).
    """

    def __init__(self, loss: Any, grad_norm: Any, lr: float, extra: Optional[Dict[str, Any]] = None,
                 source_loss: Union[Dict[int, float], torch.Tensor, None] = None,
                 skipped: Optional[NonFiniteStep] = None):
        self.lr = float(lr)  # learning rate used for this step (the scheduler's, on the host)
        # Set when the global gradient norm was not finite and the engine skipped the update (the
        # same decision on every rank): this rank's diagnosis, read by launcher/runtime/numerics.py.
        self.skipped = skipped
        # loss: mean LM loss over every token of the global batch; grad_norm: global L2 norm of the
        # gradients before clipping; extra: e.g. moe_aux_loss.
        self._pending: Dict[str, Any] = {"loss": loss, "grad_norm": grad_norm,
                                         **{f"extra/{k}": v for k, v in (extra or {}).items()}}
        # Mixture source index -> mean token loss over the global batch of that source's rows this
        # step (sources with no counted token this step are left out); empty without Microbatch.sources.
        # A tensor: the all-reduced source_sums, turned into means (source_means) when read.
        self._source = source_loss if source_loss is not None else {}
        self._values: Optional[Dict[str, float]] = None
        self._source_loss: Dict[int, float] = {}

    @property
    def materialised(self) -> bool:
        """Whether the values have been copied to the host (the one device wait of this step)."""
        return self._values is not None

    def materialise(self) -> None:
        """Copy every value to the host at once: one concatenated fp64 tensor per device, one
        `.tolist()` each (fp32 -> fp64 is exact, so the numbers equal a per-value float())."""
        if self._values is not None:
            return
        by_device: Dict[torch.device, List[Tuple[str, torch.Tensor]]] = {}
        values: Dict[str, float] = {}
        for key, value in self._pending.items():
            if torch.is_tensor(value):
                by_device.setdefault(value.device, []).append((key, value.detach().reshape(1)))
            else:
                values[key] = float(value)
        source = self._source
        if torch.is_tensor(source):
            by_device.setdefault(source.device, []).append(("source", source.detach().reshape(-1)))
        for pieces in by_device.values():
            flat = torch.cat([t.to(torch.float64) for _, t in pieces]).tolist()
            at = 0
            for key, t in pieces:
                if key == "source":
                    self._source_loss = source_means(flat[at:at + t.numel()])[0]
                else:
                    values[key] = flat[at]
                at += t.numel()
        if not torch.is_tensor(source):
            self._source_loss = dict(source)
        self._pending = {}
        self._values = values

    def _read(self) -> Dict[str, float]:
        self.materialise()
        return self._values

    @property
    def loss(self) -> float:
        return self._read()["loss"]

    @property
    def grad_norm(self) -> float:
        return self._read()["grad_norm"]

    @property
    def extra(self) -> Dict[str, float]:
        return {key[len("extra/"):]: v for key, v in self._read().items() if key.startswith("extra/")}

    @property
    def source_loss(self) -> Dict[int, float]:
        self.materialise()
        return dict(self._source_loss)


@dataclass
class NonFiniteStep:
    """A step skipped for a non-finite gradient norm, as one rank saw it: whether its own loss
    (before the all-reduce) was finite, and the first parameter whose local gradient was not."""

    local_loss_finite: bool
    first_nonfinite: Optional[str]


@dataclass
class EvalStats:
    """``Engine.eval_stats``: the forward-only loss of a batch, overall and per mixture source.

    To combine several batches (a validation pass), weight each batch's per-source loss by its
    ``source_tokens``: mean = sum(loss * tokens) / sum(tokens) per source."""

    loss: float  # mean token loss over the global batch (what eval_step returns)
    tokens: float  # counted tokens (labels != -100) in the global batch
    source_loss: Dict[int, float] = field(default_factory=dict)  # source -> mean token loss
    source_tokens: Dict[int, float] = field(default_factory=dict)  # source -> counted tokens
    # source -> counted tokens that were the argmax of their logits (lm-eval's is_greedy: a source
    # is greedy when this equals source_tokens); filled when eval_stats is asked with greedy=True
    source_greedy: Dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineOptions:
    """What an engine needs besides the model, the optimizer config and the Layout."""

    total_steps: int
    grad_clip: float = 1.0
    seed: int = 1234
    compile: bool = False
    work_dir: Optional[Path] = None  # where the DeepSpeed engine writes its JSON (the run dir)
    export_dtype: str = "bf16"  # checkpoint.export=hf weights: bf16 | fp16 | fp32 | fp8_block
    export_tokenizer_files: Tuple[Path, ...] = ()  # copied into an hf export
    # Mixture sources in the run (len(data.mix); 0: unknown or no mix). Sizes the per-source loss
    # sums so they ride on the step's loss all-reduce; when 0 and Microbatch.sources is set, one
    # extra tiny MAX all-reduce per step agrees on the count.
    n_sources: int = 0
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

    def eval_stats(self, microbatches: List[Microbatch], n_sources: int = 0, greedy: bool = False) -> EvalStats:
        """eval_step's loss plus token counts and, with Microbatch.sources, the per-source losses
        (collective). n_sources: how many source indices the micro-batches number (0: the run's
        mix size, EngineOptions.n_sources); downstream evaluation numbers its rows as sources.
        greedy (with sources): also count per source the tokens that were the argmax of their
        logits (EvalStats.source_greedy; launcher/engines/greedy.py)."""

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


def as_microbatch(mb) -> Microbatch:
    """`mb` as a Microbatch: a Microbatch as it is, a plain (inputs, labels) tuple as one with
    no positions, document ids or sources (what callers that predate the record pass)."""
    return mb if isinstance(mb, Microbatch) else Microbatch(*mb)


def as_microbatches(microbatches: Sequence) -> List[Microbatch]:
    """as_microbatch over a step's micro-batches; they must agree on which optional fields are
    set (one step is either masked or not, mixed or not)."""
    mbs = [as_microbatch(mb) for mb in microbatches]
    for name in ("positions", "document_ids", "sources"):
        present = {getattr(mb, name) is not None for mb in mbs}
        if len(present) > 1:
            raise ValueError(f"the step's micro-batches disagree on Microbatch.{name}: some set it, some not. "
                             f"Fix: the data side must set it on every micro-batch of a run or on none")
    return mbs


def model_kwargs(mb: Microbatch, device: torch.device) -> Dict[str, torch.Tensor]:
    """The keyword arguments the model's forward takes from a micro-batch: positions and
    document_ids where set (none at all for a plain micro-batch, so its call is unchanged)."""
    out = {}
    if mb.positions is not None:
        out["positions"] = mb.positions.to(device)
    if mb.document_ids is not None:
        out["document_ids"] = mb.document_ids.to(device)
    return out


def local_token_count(microbatches: List[Microbatch]) -> int:
    """Tokens that count in the loss on this rank (labels != IGNORE_INDEX)."""
    return sum(int((as_microbatch(mb).labels != IGNORE_INDEX).sum()) for mb in microbatches)


def step_source_count(microbatches: List[Microbatch], n_sources: int) -> int:
    """How many mixture sources this step's per-source sums cover: `n_sources` (the run's mix
    size, EngineOptions.n_sources) when known, else 1 + the largest source index on this rank
    (the engine then agrees on it across ranks with one MAX all-reduce); 0 without sources."""
    mbs = [as_microbatch(mb) for mb in microbatches]
    if not mbs or mbs[0].sources is None:
        return 0
    local = 1 + max(int(mb.sources.max()) for mb in mbs)
    if n_sources and local > n_sources:
        raise ValueError(f"Microbatch.sources holds source index {local - 1} but the run has {n_sources} "
                         f"sources (EngineOptions.n_sources). Fix: number the sources 0..{n_sources - 1}")
    return n_sources or local


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [b, s] in fp32 (0 where the label is IGNORE_INDEX); a DTensor under
    loss parallelism. Its sum is token_loss_sum's value (to rounding)."""
    per = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                          reduction="none")
    return per.view(labels.shape)


def source_sums(per_token: torch.Tensor, labels: torch.Tensor, sources: torch.Tensor, n_sources: int) -> torch.Tensor:
    """[2 * n_sources] fp64: the summed token losses of each source's rows, then their counted
    tokens (per_token [b, s] plain, labels [b, s], sources [b] source index per row)."""
    counted = (labels != IGNORE_INDEX)
    row_loss = per_token.double().sum(1)
    row_tokens = counted.sum(1).double()
    src = sources.to(per_token.device).long()
    out = torch.zeros(2 * n_sources, dtype=torch.float64, device=per_token.device)
    out[:n_sources].index_add_(0, src, row_loss)
    out[n_sources:].index_add_(0, src, row_tokens)
    return out


def source_means(sums: Union[torch.Tensor, Sequence[float]]) -> Tuple[Dict[int, float], Dict[int, float]]:
    """({source: mean token loss}, {source: counted tokens}) from all-reduced source_sums (a host
    tensor or its values); sources without a counted token are left out."""
    values = sums.tolist() if torch.is_tensor(sums) else list(sums)
    n = len(values) // 2
    loss, tokens = {}, {}
    for i in range(n):
        if values[n + i] > 0:
            loss[i] = values[i] / values[n + i]
            tokens[i] = values[n + i]
    return loss, tokens


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
