"""A rank's training step as the rehearsal runs it, on fake tensors or real ones.

    step = build_rank_step(engine, layout, model_cfg, notes, microbatches, reduce_pipeline=True)
    step.run()                                   # one optimizer step of this rank
    memory = track_rank_step(engine, layout, step)   # MemTracker's categories of one more step

The fake rehearsal (launcher/rehearse/rank.py) tracks it once on fake tensors; the real-tensor
rehearsal (launcher/rehearse/real.py, `rehearse.tensors=real`) runs it on the local device with
each part timed (`phase`), and bench/rehearse_gpu.py compares the two. Both run on a fake
process group: MoE layers route balanced (no router values under fake tensors, garbage split
sizes from a fake all-to-all), and a pipeline's stages are set up as its first step would, with
the schedule's shape vote set to its static outcome (nothing can be received on a fake group).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed._tools.mem_tracker import _MemRefType
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from launcher import compat
from launcher.engines.base import token_loss_sum
from launcher.models.moe import moe_layers_of
from launcher.parallel.pp import pipeline_order, schedule_stages, schedule_with_microbatches
from launcher.rehearse.fake_memory import fake_step_as_real
from launcher.rehearse.pp_states import smallest_equivalent_microbatches
from launcher.observe.memtrack import track_step_memory


def no_phase(name: str):
    """The step runners' default `phase`: nothing timed (launcher/rehearse/real.py passes a timer)."""
    return contextlib.nullcontext()


def rank_device(engine) -> torch.device:
    """The device of the rank's parameters: the CPU under the rehearsal's fake tensors, the local
    GPU when the step runs for real (rehearse.tensors=real, bench/rehearse_gpu.py)."""
    return next(p for part in engine.model_parts for p in part.parameters()).device


def step_runner(engine, layout, vocab_size: int, microbatches: int, phase=no_phase):
    """One training step of the native engine on fake token batches (no pipeline): the
    engine's own autocast and loss-parallel contexts, its loss, then the optimizer step.
    `phase(name)` wraps the "forward", "backward" and "optimizer" parts (a timer, for real tensors)."""

    shape = (layout.batch.micro_batch_size, layout.batch.seq_len)
    model = engine.parts[0]
    device = rank_device(engine)
    inputs = torch.randint(0, vocab_size, shape, device=device)
    labels = torch.randint(0, vocab_size, shape, device=device)
    # All-gather context parallelism: the rank's slice, as the engine's forward takes it; multi-token
    # prediction (model.mtp_layers) runs in training steps: its shifted tokens and targets too.
    inputs, labels, kwargs = engine.forward_inputs(inputs, labels, {}, train=True)

    def step():
        for _ in range(microbatches):
            with engine._loss_parallel():
                with phase("forward"):
                    with engine._autocast():
                        logits = model(inputs, **kwargs)
                    loss = token_loss_sum(logits, labels) / float(layout.microbatch_tokens)
                with phase("backward"):
                    loss.backward()
        with phase("optimizer"):
            for opt in engine.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return step


def reduced_pipeline_schedule(engine, layout) -> Tuple[Any, int, str]:
    """(schedule, micro-batches it runs, note) for the rehearsal's fake pipeline steps.

    The peak of a pipeline rank is set by the states its schedule passes through (micro-batches
    in flight per stage, pending weight gradients, outputs kept by the last stage); torch's
    action lists give them without running anything (launcher/rehearse/pp_states.py). When a
    smaller count visits exactly the same states on this rank, the same schedule class over the
    same stages runs that many: same peak and categories, a fraction of the time (a fake step
    costs per op). Otherwise the engine's schedule runs all of the layout's micro-batches."""


    schedule = engine.pp_schedule
    full = engine.pp_microbatches
    if isinstance(schedule, PipelineScheduleMulti):
        # The looped schedules keep every send's Work, which holds the sent tensor, until the
        # step ends (launcher/rehearse/fake_memory.py makes the fake group's Works do the same):
        # each micro-batch adds to the peak, so no smaller count is equivalent.
        return schedule, full, (f"pipeline: fake steps run all {full} micro-batches ({layout.schedule} keeps "
                                f"every micro-batch's sent tensors until the step ends)")
    n_stages = layout.mesh.pp * layout.vpp
    pp_rank = engine.world["pp"].get_local_rank()
    local = [st.stage_index for st in schedule_stages(schedule)]

    def order_for(n: int):
        if n == full:
            return pipeline_order(schedule)
        try:
            return pipeline_order(schedule_with_microbatches(schedule, layout, n))
        except (ValueError, RuntimeError, AssertionError):  # a count this schedule refuses
            return None

    n = smallest_equivalent_microbatches(order_for, full, pp_rank, local, n_stages - 1)
    if n == full:
        return schedule, full, (f"pipeline: fake steps run all {full} micro-batches ({layout.schedule}: no "
                                f"smaller count passes through the same memory states on this rank)")
    why = ("the same micro-batches in flight per stage, pending gradients and kept outputs as "
           f"{full} (launcher/rehearse/pp_states.py), so the same peak")
    return (schedule_with_microbatches(schedule, layout, n), n,
            f"pipeline: fake steps ran {n} of the {full} micro-batches per step ({layout.schedule}: {n} pass "
            f"through {why})")


def _recv_buffers(stages):
    """(activation buffers, gradient buffers) the stages hold for every micro-batch: torch allocates
    one receive buffer per micro-batch and stage input (and per output gradient) in the first step
    and keeps them; a step reads them as its micro-batches arrive."""

    def tensors(per_mb):
        return [info.buffer for infos in per_mb.values() for info in infos
                if isinstance(getattr(info, "buffer", None), torch.Tensor)]

    return ([t for st in stages for t in tensors(st.args_recv_info)],
            [t for st in stages for t in tensors(st.grad_recv_info)])


def register_recv_buffers(stages):
    """track_step_memory's on_enter: count every micro-batch's receive buffers from the start of the
    tracked step, as the device holds them (MemTracker would otherwise count each only once a
    micro-batch first reads it, so the figure at the peak would depend on how many had arrived).
    Activation buffers count as activations and gradient buffers as temporaries ("other"), the
    categories MemTracker gives them when they are first read."""

    def register(tracker) -> None:
        acts, grads = _recv_buffers(stages)
        for t in acts:
            tracker._update_and_maybe_create_winfos(t, _MemRefType.ACT)
        for t in grads:
            tracker._update_and_maybe_create_winfos(t, _MemRefType.TEMP)

    return register


def per_microbatch_bytes(engine, layout, stages, n_run: int) -> Dict[str, int]:
    """Bytes a pipeline step holds per micro-batch for the whole step, by category: the receive
    buffers (activations and gradients, registered from the step's start) and, on the first stage,
    the micro-batch's slice of token ids (the schedule splits the batch when the step starts)."""
    acts, grads = _recv_buffers(stages)
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    act = nbytes(acts) // n_run
    if engine.has_first:
        act += layout.microbatch_tokens * 8  # int64 token ids
    return {"activations": act, "other": nbytes(grads) // n_run}


def pipeline_step_runner(engine, layout, vocab_size: int, schedule=None, n_microbatches: int = 0,
                               phase=no_phase):
    """One training step of the engine's pipeline schedule on fake token batches: the rank's
    real stage modules, schedule, micro-batch count, loss and optimizer (the shape vote set to
    its static outcome: _vote_static_shapes). The schedule interleaves forwards and backwards, so
    `phase` sees one "forward_backward" part and the "optimizer"."""

    schedule = schedule if schedule is not None else engine.pp_schedule
    n_microbatches = n_microbatches or engine.pp_microbatches
    _vote_static_shapes(schedule)
    rows = layout.batch.micro_batch_size * n_microbatches
    shape = (rows, layout.batch.seq_len)
    device = rank_device(engine)
    inputs = torch.randint(0, vocab_size, shape, device=device)
    labels = torch.randint(0, vocab_size, shape, device=device)

    def step():
        engine._token_norm = float(rows * layout.batch.seq_len)
        if getattr(engine, "mtp_layers", 0):
            engine._set_mtp_scale()
        # As the engine's step: MTP's targets for every stage, the rank's CP slices of the rows.
        mine, targets, kwargs = engine.pipeline_inputs(inputs, labels, {}, train=True)
        if engine.has_last:
            kwargs.update(target=targets, losses=[])
        args = (mine,) if engine.has_first else ()
        with phase("forward_backward"), engine._loss_parallel(), engine._autocast():
            schedule.step(*args, **kwargs)
        with phase("optimizer"):
            for opt in engine.optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return step


def _vote_static_shapes(schedule) -> None:
    """Replace the schedule's shape vote by its outcome on statically built stages.

    The fake group delivers no values, so torch's warm-up vote (each stage tells the next one
    whether its shapes are static; a received value decides) cannot run: the stages were built
    with static shapes (launcher.parallel.pp.stage_io_meta), so each is set STATIC, as the vote
    would decide in a real run. Checked, not assumed: a stage torch would infer dynamically is
    refused. A torch without the vote (launcher/compat.py) needs nothing here: a stage given its
    shapes never infers them."""
    if not compat.has("pipeline_shape_vote"):
        return
    from torch.distributed.pipelining._utils import InferenceMode  # lazy: newer than the torch floor (absent in 2.11)

    for st in schedule_stages(schedule):
        if InferenceMode.needs_dynamic(st._user_meta, True):
            raise RuntimeError(f"pipeline stage {st.stage_index} has no static input/output shapes; "
                               f"its shape inference cannot run on a fake process group")

    def vote(stages_, has_backward, p2p_done):
        for st in stages_:
            st._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


def set_up_pipeline_stages(engine, layout, schedule, n_microbatches: int) -> None:
    """What a pipeline schedule's first step sets up and keeps, without running it: torch's stage
    set-up (one receive buffer per micro-batch and stage input, one per output gradient; static
    shapes, so nothing is sent or run). With the optimizer states from `_zero_grad_step`, the next
    step is a steady-state step: the rehearsal tracks it instead of a second step after an untracked
    one (llama405b rank 0: 77 s instead of 123 s, the same bytes). tests/test_parallel_layouts.py holds the
    tracked step's activations and peak equal to those of a real rank after a real first step."""


    _vote_static_shapes(schedule)  # the set-up runs the vote; on a fake group it must not send
    rows = layout.batch.micro_batch_size * n_microbatches
    tokens = torch.zeros((rows, layout.batch.seq_len), dtype=torch.long, device=rank_device(engine))
    tokens, _, kwargs = engine.pipeline_inputs(tokens, tokens, {}, train=False)  # the rank's CP slices
    args_split, kwargs_split = schedule._split_inputs((tokens,) if engine.has_first else (), kwargs)
    # The first micro-batch's target, split along the rows as the schedule splits it.
    target = tokens.tensor_split(n_microbatches)[0] if engine.has_last else None
    for st in schedule_stages(schedule):
        st.has_backward = schedule._has_backward
    initialize = (schedule._initialize_stages if isinstance(schedule, PipelineScheduleMulti)
                  else schedule._initialize_stage)
    with_target = (target,) if compat.has("pipeline_init_with_target") else ()
    with engine._loss_parallel(), engine._autocast():
        initialize(args_split[0], kwargs_split[0], *with_target)


def balance_moe_routing(parts) -> str:
    """Route every MoE layer of ``parts`` with balanced routing (launcher/models/moe.py
    ``balanced_assignment``): fake tensors have no router values, so top-k cannot choose; the
    balanced load (tokens*top_k/n_experts per expert, what the planner assumes) makes every
    per-expert count, and so every dispatch split, known without values. Returns the note for
    the report ("" without MoE layers)."""

    n = 0
    for part in parts:
        for layer in moe_layers_of(part):
            layer.routing = "balanced"
            n += 1
    if not n:
        return ""
    return (f"MoE: the rehearsal's step routes balanced ({n} MoE layers; tokens*top_k/n_experts per expert, the "
            f"plan's assumption); a real run's skewed routing moves expert-parallel activations")


@dataclasses.dataclass
class RankStep:
    """A rank's training step as the rehearsal runs it (build_rank_step): the step function, the
    micro-batches it runs, and the pipeline schedule it steps (None without a pipeline)."""

    run: Any
    microbatches: int
    schedule: Any = None


def build_rank_step(engine, layout, model_cfg, notes: List[str], max_microbatches: int,
                    reduce_pipeline: bool, phase=no_phase) -> RankStep:
    """The rank's training step, set up as the rehearsal runs it (fake or real tensors): MoE
    routing balanced, at most `max_microbatches` micro-batches without a pipeline, a pipeline's
    smallest equivalent count with its stages set up as the schedule's first step would.
    `phase(name)` wraps the step's parts (launcher/rehearse/real.py times them)."""

    note = balance_moe_routing(engine.model_parts)
    if note:
        notes.append(note)
    n_micro = max(1, min(layout.batch.microbatches, max_microbatches))
    if n_micro < layout.batch.microbatches and layout.mesh.pp == 1:
        notes.append(f"the rehearsal's steps run {n_micro} of the {layout.batch.microbatches} micro-batches per step "
                     f"(the peak is reached by the second: gradients exist from then on)")
    if layout.mesh.pp == 1:
        return RankStep(step_runner(engine, layout, model_cfg.vocab_size, n_micro, phase), n_micro)
    # The smallest micro-batch count that passes through the same memory states.
    schedule, n_pipe, note = (reduced_pipeline_schedule(engine, layout) if reduce_pipeline
                              else (engine.pp_schedule, engine.pp_microbatches, ""))
    if note:
        notes.append(note)
    step = pipeline_step_runner(engine, layout, model_cfg.vocab_size, schedule, n_pipe, phase)
    # A schedule's first step also sets up its stages' receive buffers: set up alone.
    set_up_pipeline_stages(engine, layout, schedule, n_pipe)
    return RankStep(step, n_pipe, schedule)


def track_rank_step(engine, layout, step: RankStep) -> Dict[str, int]:
    """One tracked step (MemTracker, launcher/observe/memtrack.py) of a built rank step, the
    optimizer states already created: {activations, peak, other} in bytes, a reduced pipeline's
    micro-batches not run added for the whole step (also alone: `unrun_microbatch_bytes`); plus
    `cuda_max_allocated` on a GPU."""
    on_enter = register_recv_buffers(schedule_stages(step.schedule)) if step.schedule is not None else None
    # Measure what a real step holds, not fake-mode artefacts (launcher/rehearse/fake_memory.py).
    with fake_step_as_real():
        measured = track_step_memory(engine.model_parts, engine.optimizers, step.run, warmup_steps=0,
                                     on_enter=on_enter)
    unrun = 0
    if step.schedule is not None and step.microbatches < engine.pp_microbatches:
        # What the micro-batches not run would hold for the whole step (constant over it).
        extra = per_microbatch_bytes(engine, layout, schedule_stages(step.schedule), step.microbatches)
        for cat, b in extra.items():
            measured[cat] += (engine.pp_microbatches - step.microbatches) * b
            unrun += (engine.pp_microbatches - step.microbatches) * b
        measured["total"] += unrun
    memory = {"activations": int(measured["activations"]), "peak": int(measured["total"]),
              "other": int(measured["other"]), "unrun_microbatch_bytes": unrun}
    if "cuda_max_allocated" in measured:
        memory["cuda_max_allocated"] = int(measured["cuda_max_allocated"])
    return memory


def rank_report(rank: int, layout, held: Dict[str, int], step_memory: Dict[str, Any],
                notes: List[str]) -> Dict[str, Any]:
    """One rank's row of the rehearsal: what it holds (`held`: StateBytesProbe's result) and its
    step's activations and peak (`step_memory`), fake or real tensors alike."""
    return {
        "rank": rank,
        "coords": layout.mesh.coordinates(rank),
        "params_numel": held["params_numel"],
        "memory": {"params": held["params"], "grads": held["grads"], "optimizer": held["optimizer"],
                   "activations": step_memory["activations"], "peak": step_memory["peak"]},
        "error": None,
        "notes": notes,
    }
