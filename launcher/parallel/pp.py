"""Pipeline parallelism with torch.distributed.pipelining.

The decoder is cut into ``pp * pp_virtual_stages`` stages of whole blocks. Each stage is a
copy of the (meta) model with the other blocks deleted; the first stage keeps the
embedding, the last one the final norm and output layer, so parameter names stay those of
the full model and checkpoints move between pipeline layouts.

Stage placement: single-stage schedules (gpipe, 1f1b) give rank r stage r; looped
schedules (interleaved_1f1b, zero_bubble) give rank r stages r, r+pp, r+2pp...; zbv
(V-shape, exactly 2 stages per rank) gives rank r stages r and 2pp-1-r.

Layers per stage: ``parallel.pp_layers`` (one entry per stage, summing to n_layers), else an
even split with the remainder going to the earliest stages. Each schedule step splits the
rank's batch into ``microbatches`` chunks along the batch dimension; gradients are not
rescaled by the schedule (the engine's loss is already normalised by the global token
count).

Stages are built with static input/output shapes (``stage_io_meta``): torch's shape inference
would run an extra forward and backward per stage on the first step and after each
validation, and sends shapes with object collectives (which a fake process group cannot run).
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from launcher.plan.layout import Layout
from launcher.plan.estimate.params import chunk_layer_counts, chunks_of_rank

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
_SINGLE = ("gpipe", "1f1b")


def layers_per_stage(n_layers: int, n_stages: int, explicit: Sequence[int] = ()) -> List[int]:
    """Number of blocks in each stage: ``explicit`` if given (checked), else an even split."""
    if explicit:
        explicit = list(explicit)
        if len(explicit) != n_stages or sum(explicit) != n_layers or min(explicit) < 0:
            raise ValueError(
                f"parallel.pp_layers={explicit} must list {n_stages} non-negative counts "
                f"(pp * pp_virtual_stages) summing to model.n_layers={n_layers}; "
                f"got {len(explicit)} entries summing to {sum(explicit)}"
            )
        return explicit
    if n_layers < n_stages:
        raise ValueError(
            f"model.n_layers={n_layers} cannot fill {n_stages} pipeline stages "
            f"(pp * pp_virtual_stages); lower parallel.pp or parallel.pp_virtual_stages"
        )
    # The planner's split, so predicted and real stage sizes are the same by construction.
    return chunk_layer_counts(n_layers, n_stages)


def stage_ids_for_rank(rank: int, pp: int, virtual: int, schedule: str) -> List[int]:
    """Global stage indices held by pipeline rank ``rank``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={schedule!r} is not one of {'|'.join(SCHEDULES)}")
    if schedule in _SINGLE:
        if virtual != 1:
            raise ValueError(
                f"parallel.pp_schedule={schedule} runs one stage per rank but "
                f"parallel.pp_virtual_stages={virtual}; use pp_schedule=interleaved_1f1b (or "
                f"zero_bubble) for virtual stages, or set pp_virtual_stages=1"
            )
        return [rank]
    if schedule == "zbv":
        if virtual != 2:
            raise ValueError(
                f"parallel.pp_schedule=zbv needs exactly 2 stages per rank; set "
                f"parallel.pp_virtual_stages=2 (got {virtual})"
            )
    return chunks_of_rank(rank, pp, virtual, schedule)


def build_stage_module(whole: nn.Module, stage: int, counts: Sequence[int]) -> nn.Module:
    """A copy of ``whole`` (meta) holding only the blocks of ``stage``."""
    first, last = stage == 0, stage == len(counts) - 1
    lo = sum(counts[:stage])
    keep = {str(i) for i in range(lo, lo + counts[stage])}
    part = copy.deepcopy(whole)
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if last and part.mtp is not None and not first:
        # Multi-token prediction lives with the head and embeds tokens too: a copy of stage 0's table
        # (same initial values and checkpoint-independent name, launcher.models.init.canonical_name);
        # the engine sums the two tables' gradients so they stay equal (as Megatron does).
        part.mtp_embeddings = part.tok_embeddings
    if not last:
        part.mtp = None
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


def split_into_stages(whole: nn.Module, layout: Layout, pp_mesh: DeviceMesh) -> Tuple[List[nn.Module], List[int]]:
    """This rank's stage modules and their global stage indices (tied embeddings, which cannot
    be pipelined, were refused by the validator)."""
    pp, v = pp_mesh.size(), layout.vpp
    counts = layers_per_stage(whole.cfg.n_layers, pp * v, layout.pp_layers)
    ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, v, layout.schedule)
    parts = [build_stage_module(whole, s, counts) for s in ids]
    log.info("pipeline: %d stages over pp=%d (%s), layers per stage %s; this rank holds stages %s",
             pp * v, pp, layout.schedule, counts, ids)
    return parts, ids


def activation_dtype(layout: Layout) -> torch.dtype:
    """The dtype of the hidden states sent between stages. Under FSDP2 the MixedPrecisionPolicy
    gives bf16 parameters, so the residual stream is bf16; without FSDP the engine's autocast
    leaves the residual stream in fp32 (the embedding output is fp32 and fp32 + bf16 is fp32)."""
    if layout.fsdp_wraps and layout.numerics.precision in ("bf16", "fp8"):
        return torch.bfloat16
    return torch.float32


def stage_io_meta(stage: int, n_stages: int, layout: Layout, model_cfg) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input, output) meta tensors of one pipeline micro-batch for global stage ``stage``.

    Given to PipelineStage so that it skips torch's shape inference (an extra forward and
    backward per stage on the first step and after each validation, plus object collectives
    that a fake process group cannot run). Rows: trainer.micro_batch_size sequences per
    pipeline micro-batch (Layout.pp_microbatches). Under context parallelism (all-gather) a rank
    holds seq_len/cp tokens of each row; with TP + sequence parallelism the residual stream
    between blocks is the rank's local 1/tp slice of those. The last
    stage's output (logits) is never sent; torch only counts it. Float tensors require grad:
    torch derives from that which gradients a stage receives and sends back.
    """
    rows, tp = layout.batch.micro_batch_size, layout.mesh.tp
    seq = layout.batch.seq_len // layout.mesh.cp  # all-gather context parallelism: the rank's slice
    local_seq = seq // tp if (tp > 1 and layout.sp) else seq
    hidden = (rows, local_seq, model_cfg.dim)
    dtype = activation_dtype(layout)
    meta = torch.device("meta")
    if stage == 0:
        inputs = torch.empty((rows, seq), dtype=torch.int64, device=meta)
    else:
        inputs = torch.empty(hidden, dtype=dtype, device=meta, requires_grad=True)
    if stage == n_stages - 1:
        outputs = torch.empty((rows, seq, model_cfg.vocab_size), dtype=torch.float32, device=meta,
                              requires_grad=True)
    else:
        outputs = torch.empty(hidden, dtype=dtype, device=meta, requires_grad=True)
    return inputs, outputs


def build_schedule(parts: List[nn.Module], stage_ids: List[int], layout: Layout, pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn: Callable, n_microbatches: int):
    """(schedule, has_first_stage, has_last_stage) for this rank's materialised stage modules."""
    # lazy: torch.distributed.pipelining takes ~0.4 s to import; only pp > 1 uses it
    from torch.distributed.pipelining import PipelineStage

    pp, v = pp_mesh.size(), layout.vpp
    n_stages = pp * v
    if n_microbatches < pp and layout.schedule == "1f1b":
        raise ValueError(
            f"parallel.pp_schedule=1f1b needs at least as many micro-batches as stages: "
            f"{n_microbatches} micro-batches per step < pp={pp}; raise trainer.global_batch_size or "
            f"lower trainer.micro_batch_size, or use pp_schedule=gpipe")
    if n_microbatches < pp:
        msg = (f"{n_microbatches} micro-batches per step < pipeline stages ({pp}): most "
               f"ranks idle (bubble fraction ~ (p-1)/m = {(pp - 1) / n_microbatches:.2f}); use "
               f"at least {pp} micro-batches (a larger trainer.global_batch_size or a smaller "
               f"trainer.micro_batch_size), ideally several times more")
        warnings.warn(msg)
        log.warning(msg)
    group = pp_mesh.get_group()
    stages = []
    for part, sid in zip(parts, stage_ids):
        # Static shapes: no shape-inference forward (and none of its object collectives).
        inputs, outputs = stage_io_meta(sid, n_stages, layout, part.cfg)
        stages.append(PipelineStage(part, sid, n_stages, device, input_args=inputs, output_args=outputs,
                                    group=group))
    cls = schedule_class(layout.schedule)
    target = stages[0] if layout.schedule in _SINGLE else stages
    schedule = cls(target, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    log.info("applied pipeline schedule %s: %d micro-batches, %d stage(s) on this rank",
             cls.__name__, n_microbatches, len(stages))
    return schedule, 0 in stage_ids, n_stages - 1 in stage_ids


def schedule_class(name: str):
    """torch's schedule class for parallel.pp_schedule ``name``."""
    # lazy: torch.distributed.pipelining takes ~0.4 s to import; only pp > 1 uses it
    from torch.distributed.pipelining import schedules as S

    return {
        "gpipe": S.ScheduleGPipe,
        "1f1b": S.Schedule1F1B,
        "interleaved_1f1b": S.ScheduleInterleaved1F1B,
        "zero_bubble": S.ScheduleInterleavedZeroBubble,
        "zbv": S.ScheduleZBVZeroBubble,
    }[name]


def schedule_stages(schedule) -> list:
    """The PipelineStage objects a built schedule runs (one for gpipe/1f1b, several when looped)."""
    return list(schedule._stages) if hasattr(schedule, "_stages") else [schedule._stage]


def schedule_with_microbatches(schedule, layout: Layout, n_microbatches: int):
    """The same schedule class over the same stages and loss, with ``n_microbatches`` micro-batches
    per step (raises what torch raises for a count the schedule does not accept)."""
    stages = schedule_stages(schedule)
    target = stages[0] if layout.schedule in _SINGLE else stages
    return schedule_class(layout.schedule)(target, n_microbatches=n_microbatches, loss_fn=schedule._loss_fn,
                                           scale_grads=False)


def pipeline_order(schedule) -> dict:
    """{pipeline rank: [action, ...]}: the compute order torch's schedule runs on every rank."""
    order = getattr(schedule, "pipeline_order", None)
    return order if order else schedule._get_pipeline_order()
