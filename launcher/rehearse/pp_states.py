"""Which pipeline micro-batch count reaches the same memory states as the layout's (rehearsal).

A pipeline rank's memory during a schedule step is set by what its stages hold when each
compute action runs: per local stage the micro-batches forwarded and not yet backwarded (their
saved activations), those whose input-gradient ran but weight-gradient did not (zero-bubble
schedules), whether a gradient exists yet, and on the last stage the outputs and losses the
schedule keeps until the step ends (``output_chunks``, one per forwarded micro-batch). The
schedule's action list for every rank (``pipeline_order``) gives these states without running
anything. If a smaller micro-batch count visits exactly the same set of (state, action) pairs
as the layout's count, a step with it passes through the same memory states, so its peak and
every category's maximum are the same; the rehearsal then runs that many (the time of a fake
step is per op, so it scales with the micro-batches run). Ranks holding the last stage keep
one output per micro-batch, so no smaller count ever matches there.

The claim is held by tests/test_pp_states.py: for each schedule, tracked fake steps with the
reduced and the full count report the same bytes in every category.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

Action = Tuple[str, int, int]  # (kind F|B|I|W, global stage index, micro-batch index)
COMPUTE_KINDS = ("F", "B", "I", "W")


def rank_compute_actions(pipeline_order: Dict[int, Sequence[Any]], rank: int) -> List[Action]:
    """The compute actions (forward, full backward, input / weight backward) of pipeline rank
    ``rank`` in the order its schedule runs them (communication and idle slots dropped)."""
    out: List[Action] = []
    for act in pipeline_order[rank]:
        if act is None:
            continue
        kind = str(getattr(act.computation_type, "value", act.computation_type))
        if kind == "OVERLAP_F_B":  # a fused pair: its sub-actions in order
            for sub in act.sub_actions or ():
                out.append((str(sub.computation_type.value), sub.stage_index, sub.microbatch_index))
        elif kind in COMPUTE_KINDS:
            out.append((kind, act.stage_index, act.microbatch_index))
    return out


def memory_states(actions: Sequence[Action], local_stages: Sequence[int], last_stage: int,
                  n_microbatches: int) -> FrozenSet[tuple]:
    """The set of (state before the action, action) pairs of one rank's step.

    State per local stage: micro-batches in flight (forward done, backward not started),
    awaiting their weight gradient, whether any gradient exists; plus the outputs (and losses)
    the last stage keeps until the step ends. The action is its kind and stage, and whether it
    is the stage's first forward or last backward (the gradient sync runs there). Micro-batch
    indices do not enter: all micro-batches have the same shapes."""
    stages = list(local_stages)
    fwd = {s: 0 for s in stages}
    bwd_in = {s: 0 for s in stages}  # B or I done (the saved activations are freed)
    bwd_w = {s: 0 for s in stages}   # B or W done (weight gradients accumulated)
    pending_w = {s: 0 for s in stages}
    seen = set()
    for kind, stage, _mb in actions:
        state = tuple((fwd[s] - bwd_in[s], pending_w[s], bwd_w[s] > 0) for s in stages)
        kept = fwd[last_stage] if last_stage in fwd else 0
        first_fwd = kind == "F" and fwd[stage] == 0
        last_bwd = kind in ("B", "W") and bwd_w[stage] == n_microbatches - 1
        seen.add((state, kept, kind, stage, first_fwd, last_bwd))
        if kind == "F":
            fwd[stage] += 1
        elif kind == "B":
            bwd_in[stage] += 1
            bwd_w[stage] += 1
        elif kind == "I":
            bwd_in[stage] += 1
            pending_w[stage] += 1
        elif kind == "W":
            pending_w[stage] -= 1
            bwd_w[stage] += 1
    return frozenset(seen)


def smallest_equivalent_microbatches(order_for: Callable[[int], Optional[Dict[int, Sequence[Any]]]],
                                     n_microbatches: int, rank: int, local_stages: Sequence[int],
                                     last_stage: int) -> int:
    """The smallest micro-batch count whose schedule visits the same memory states on ``rank``
    as ``n_microbatches`` (``n_microbatches`` itself when none does).

    order_for(n): the schedule's pipeline_order for n micro-batches, or None where the schedule
    refuses n."""
    if last_stage in local_stages:
        # The last stage keeps one output per micro-batch until the step ends: the state with
        # n_microbatches - 1 kept outputs exists only with n_microbatches or more (no scan needed).
        return n_microbatches
    full = order_for(n_microbatches)
    if full is None:
        return n_microbatches
    want = memory_states(rank_compute_actions(full, rank), local_stages, last_stage, n_microbatches)
    for n in range(1, n_microbatches):
        order = order_for(n)
        if order is None:
            continue
        if memory_states(rank_compute_actions(order, rank), local_stages, last_stage, n) == want:
            return n
    return n_microbatches
