"""Which ranks a rehearsal builds, and the planner's answer for each of them. Pure Python.

`rehearsal_ranks(layout, "auto")` picks one rank per distinct shard shape: ranks differ in
what they hold only through their pipeline rank (its stages and virtual chunks: the
embedding, the output layer, the layer split) and through uneven shards, where the first
and the last coordinate of a mesh dimension can differ (FSDP2 and torch's Shard put the
remainder on the first shards, so the last one is the smallest, possibly empty). So `auto`
is: rank 0 of every pipeline rank (all other coordinates 0), for every other mesh dimension
of size > 1 the rank with that coordinate last (the others 0), and the last rank of the
world (every coordinate last). For llama405b (pp 8 x dp_shard 8 x tp 8 on 512 GPUs) that is
8 + 2 + 1 = 11 ranks.

`predicted_for_rank` is the planner's per-rank estimate (plan.memory.per_pp_rank) in the
rehearsal's categories: the rehearsal measures what a rank *holds* between steps, so
`grads` here is the plan's gradient memory without the accumulation transient (one extra
gradient tensor while a micro-batch's gradient is added to the existing one), which the
plan keeps in its `grads_held` figure and is reported as `grads_step_peak`; `activations` is the
plan's `activations_max` (every block's and the head's, as the rehearsal measures them);
`peak_comparable` is the plan's peak less what a fake step cannot hold (`peak_set_apart`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Union

from launcher.observe.rehearsal_table import planned_figure
from launcher.plan.layout import Layout
from launcher.plan.estimate.memory import ALLOCATOR_FRAGMENTATION, model_state_memory
from launcher.plan.degrees import MESH_DIM_NAMES
from launcher.plan.estimate.params import ModelShape, stage_params
from launcher.plan.estimate.perf import microbatch_compute_s, optimizer_step_s

STATE_CATEGORIES = ("params", "grads", "optimizer")


def rehearsal_ranks(layout: Layout, choice: Union[str, Sequence[int]]) -> List[int]:
    """The global ranks to rehearse: `auto` (see the module doc), `all`, or the given list."""
    mesh = layout.mesh
    if choice == "all":
        return list(range(mesh.world_size))
    if not isinstance(choice, str):
        return sorted(set(int(r) for r in choice))
    ranks = {mesh.rank_of({"pp": p}) for p in range(mesh.pp)}
    for name in MESH_DIM_NAMES[1:]:
        size = getattr(mesh, name)
        if size > 1:
            ranks.add(mesh.rank_of({name: size - 1}))
    ranks.add(mesh.world_size - 1)
    return sorted(ranks)


def rank_problems(layout: Layout, choice: Union[str, Sequence[int]]) -> List[str]:
    """A problem line when a listed rank is outside the layout's world (the resolver owns its size)."""
    if isinstance(choice, str):
        return []
    bad = [r for r in choice if not 0 <= r < layout.mesh.world_size]
    if not bad:
        return []
    return [f"rehearse.ranks={list(choice)} names rank(s) {bad} outside the world of {layout.mesh.world_size} ranks. "
            f"Fix: global ranks within [0, {layout.mesh.world_size - 1}]."]


def predicted_for_rank(shape: ModelShape, layout: Layout, plan_memory: Dict[str, Any], rank: int) -> Dict[str, Any]:
    """The plan's prediction for one global rank: {params, grads, optimizer, grads_step_peak,
    activations, other, peak} in bytes, the CUDA reserve left out (per_pp_rank of plan.memory for this rank's pipeline rank)."""
    pp_rank = layout.mesh.coordinates(rank)["pp"]
    row = next((r for r in plan_memory.get("per_pp_rank", []) if r.get("pp_rank") == pp_rank), None)
    stage = stage_params(shape, layout.mesh.pp, layout.vpp, layout.schedule, layout.pp_layers)[pp_rank]
    # Held states: the same formula with one micro-batch (no accumulation transient).
    one_micro = dataclasses.replace(layout.batch, microbatches=1)
    held = model_state_memory(stage, dataclasses.replace(layout, batch=one_micro), shape)
    out: Dict[str, Any] = {c: int(held[c]) for c in STATE_CATEGORIES}
    row = row or {}
    # The CUDA context / NCCL reserve is no tensor: the rehearsal (on CPU) cannot see it.
    reserved = int(plan_memory.get("detail", {}).get("reserved", 0))
    # Each category at its own maximum, as the rehearsal measures them (a plan.json from before
    # these keys: what exists at the peak).
    out["grads_step_peak"] = int(row.get("grads_held", row.get("grads", held["grads"])))
    out["activations"] = int(row.get("activations_max", row.get("activations", 0)))
    out["other"] = max(0, int(row.get("other", 0)) - reserved)
    out["peak"] = max(0, int(row.get("total", 0)) - reserved)
    # The plan's figure for what the rehearsal's peak measures (tensors its fake step holds): the
    # allocator's fragmentation margin is no tensor, and the fake step runs its micro-batches
    # without the unsharded accumulation buffers (parallel.accumulate_unsharded keeps the whole
    # unsharded parameters and gradients across the step's micro-batches; pipelines excepted,
    # whose schedule the fake step runs).
    apart = {"allocator_fragmentation": int(row.get("allocator_fragmentation", 0))}
    if layout.memory.accumulate_unsharded and layout.mesh.pp == 1:
        apart["unsharded_accumulation"] = int(row.get("unsharded_params", 0)) + int(row.get("unsharded_grads", 0))
    out["peak_set_apart"] = {k: v for k, v in apart.items() if v}
    out["peak_comparable"] = max(0, out["peak"] - sum(apart.values()))
    return out


def relative_errors(measured: Dict[str, Any], predicted: Dict[str, Any]) -> Dict[str, float]:
    """(measured - planned) / planned per category measured and planned (> 0), the planned figure
    being the one for the same quantity (`planned_figure`)."""
    out = {}
    for cat in STATE_CATEGORIES + ("activations", "peak"):
        got, want = measured.get(cat), planned_figure(predicted, cat)
        if got is not None and want:
            out[cat] = (got - want) / want
    return out


def predicted_time_for_rank(shape: ModelShape, layout: Layout, hw: Any, rank: int) -> Dict[str, float]:
    """The plan's compute model for one global rank (launcher/plan/estimate/perf.py, its pipeline
    rank's stage): {microbatch_s (forward + backward of one micro-batch), compute_s (the layout's
    micro-batches), optimizer_s} in seconds, what a real-tensor rehearsal measures for the rank
    (no communication, no bubble: the fake process group returns at once)."""
    pp_rank = layout.mesh.coordinates(rank)["pp"]
    stage = stage_params(shape, layout.mesh.pp, layout.vpp, layout.schedule, layout.pp_layers)[pp_rank]
    per_micro = microbatch_compute_s(shape, stage, layout, hw)
    return {"microbatch_s": per_micro, "compute_s": per_micro * layout.batch.microbatches,
            "optimizer_s": optimizer_step_s(stage, layout, hw)}


def predicted_peaks_for_rank(layout: Layout, plan_memory: Dict[str, Any], rank: int) -> Dict[str, int]:
    """The plan's peak for one global rank as a GPU's allocator reports it: `reserved` (what
    torch.cuda.max_memory_reserved sees: the total without hardware.reserved_gb, the CUDA context
    and NCCL buffers outside the allocator), `allocated` (max_memory_allocated: that without the
    allocator's fragmentation too) and `total` (the plan's figure, what must fit the GPU)."""
    pp_rank = layout.mesh.coordinates(rank)["pp"]
    row = next((r for r in plan_memory.get("per_pp_rank", []) if r.get("pp_rank") == pp_rank), {})
    total = int(row.get("total", plan_memory.get("total", 0)))
    share = max(0, total - int(plan_memory.get("detail", {}).get("reserved", 0)))
    # The plan's fragmentation is a fraction of the allocated bytes (launcher/plan/estimate/memory.py).
    return {"total": total, "reserved": share, "allocated": int(share / (1 + ALLOCATOR_FRAGMENTATION))}
