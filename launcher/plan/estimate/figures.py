"""Fills a Plan's estimates: parameter counts, memory, communication, pipeline, time.

`fill(plan, spec)` is called by `build_plan`. It writes plain dicts (bytes, seconds) so that
plan.json stays a stable, readable schema; docs/planner.md lists the keys.
"""

from __future__ import annotations

from typing import Any, Dict, List

from launcher.config.validate import accumulate_unsharded_value
from launcher.plan.estimate.bands import band_summary, layout_kind, memory_range, value_range
from launcher.plan.estimate.flops import training_flops_per_token
from launcher.plan.layout import Layout, accumulate_unsharded_blocker
from launcher.plan.estimate.memory import GiB, StageMemory, estimate_memory, inflight_microbatches, most_loaded
from launcher.plan.estimate.params import ModelShape, chunk_layer_counts, model_shape
from launcher.plan.estimate.perf import bubble_fraction, estimate_time


def capacity_bytes(hw: Any) -> int:
    """GPU memory as the allocator sees it: memory_gb is GiB, as nvidia-smi reports it."""
    return int(hw.memory_gb * GiB)


def reserved_bytes(hw: Any) -> int:
    return int(hw.reserved_gb * GiB)


def memory_summary(stages: List[StageMemory], hw: Any) -> Dict[str, Any]:
    """The `plan.memory` dict: the most loaded rank's categories, capacity, verdict and margin."""
    top = most_loaded(stages)
    cap = capacity_bytes(hw)
    d: Dict[str, Any] = top.as_dict()
    d.update(
        capacity=cap,
        fits=top.total <= cap,
        margin=cap - top.total,
        most_loaded_pp_rank=top.rank,
        peak_phase=top.peak_phase,
        host=top.host,
        detail=dict(top.detail),
        per_pp_rank=[s.as_dict() | {"pp_rank": s.rank, "host": s.host} | s.maxima()
                     | {k: int(s.detail.get(k, 0)) for k in PEAK_PARTS} for s in stages],
    )
    return d


# Parts of each rank's peak that the rehearsal compares apart (launcher/rehearse/ranks.py,
# predicted_for_rank: what its fake step cannot hold).
PEAK_PARTS = ("allocator_fragmentation", "unsharded_params", "unsharded_grads")


def fill(plan, spec) -> None:
    """Compute every estimate for `plan` from its resolved layout."""
    fill_from_layout(plan, spec, model_shape(spec.model), plan.layout)


def fill_from_layout(plan, spec, shape: ModelShape, lay: Layout) -> None:
    hw = spec.hardware
    plan.params_total = shape.total
    plan.params_active = shape.active
    stages = estimate_memory(shape, lay, reserved_bytes(hw))
    plan.memory = memory_summary(stages, hw)

    flops_per_token = training_flops_per_token(spec.model, lay.batch.seq_len)
    t = estimate_time(shape, lay, hw, flops_per_token, lay.tokens_per_step)
    comm = t.pop("comm")
    plan.comm = {
        "collectives": [c.as_dict() for c in comm],
        "bytes_per_step": sum(c.bytes_per_step for c in comm),
        "intra_node_bytes": sum(c.bytes_per_step for c in comm if c.where == "intra"),
        "inter_node_bytes": sum(c.bytes_per_step for c in comm if c.where == "inter"),
        "exposed_s": sum(c.exposed_s for c in comm),
        "pp_rank": t["slowest_stage"],
    }
    counts = chunk_layer_counts(shape.n_layers, lay.mesh.pp * lay.vpp, lay.pp_layers)
    plan.pipeline = {
        "pp": lay.mesh.pp,
        "schedule": lay.schedule if lay.mesh.pp > 1 else "none",
        "virtual_stages": lay.vpp,
        "microbatches": lay.pp_microbatches,
        "bubble_fraction": bubble_fraction(lay),
        "layers_per_chunk": counts,
        "inflight_microbatches": [inflight_microbatches(lay, r) for r in range(lay.mesh.pp)],
    }
    t["model_flops_per_token"] = flops_per_token
    kind = layout_kind(lay, spec.model.n_experts)
    t["step_s_range"] = list(value_range(t["step_s"], kind, "time"))
    t["tokens_per_s_range"] = [lay.tokens_per_step / t["step_s_range"][1], lay.tokens_per_step / t["step_s_range"][0]]
    t["band"] = band_summary(kind)
    plan.time = t
    plan.memory["total_range"] = list(memory_range(plan.memory["total"], plan.memory["detail"].get("reserved", 0), kind))
    plan.warnings = list(plan.warnings) + warnings_for(plan, spec, lay)


def warnings_for(plan, spec, lay: Layout) -> List[str]:
    """Actionable warnings: memory that does not fit, a large bubble, TP across nodes."""
    out: List[str] = []
    mem = plan.memory
    gib = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    if not mem["fits"]:
        fixes = []
        if lay.memory.ac_mode != "full":
            fixes.append("activation_checkpointing=full")
        if lay.memory.zero_stage != 3:
            fixes.append("parallel.zero_stage=3")
        if lay.batch.micro_batch_size > 1:
            fixes.append(f"trainer.micro_batch_size={lay.batch.micro_batch_size // 2}")
        if lay.memory.accumulate_unsharded:
            fixes.append("parallel.accumulate_unsharded=false (accumulate sharded gradients)")
        fixes.append("a larger parallel.tp / parallel.pp, or more nodes")
        fixes.append("`action=search` to list layouts that fit")
        out.append(
            f"does not fit: pipeline rank {mem['most_loaded_pp_rank']} needs {gib(mem['total'])} per GPU "
            f"(params {gib(mem['params'])}, grads {gib(mem['grads'])}, optimizer {gib(mem['optimizer'])}, "
            f"activations {gib(mem['activations'])}, other {gib(mem['other'])}) but {spec.hardware.name} has "
            f"{gib(mem['capacity'])}. Fix: " + "; ".join(fixes) + "."
        )
    bubble = plan.pipeline["bubble_fraction"]
    if lay.mesh.pp > 1 and bubble > 0.25:
        out.append(
            f"pipeline bubble is {bubble:.0%} of compute (pp={lay.mesh.pp}, {lay.pp_microbatches} micro-batches, "
            f"schedule {lay.schedule}). Fix: more micro-batches (trainer.global_batch_size or a smaller "
            f"trainer.micro_batch_size), parallel.pp_schedule=interleaved_1f1b with pp_virtual_stages=2, or a lower pp."
        )
    out += accumulate_unsharded_note(spec, lay)
    if spec.precision.name == "fp32" and not spec.precision.tf32:
        out.append(
            f"precision.tf32=false: the runtime runs fp32 matmuls at the plain FP32 rate, but the time is costed "
            f"at hardware.tf32_tflops={spec.hardware.tf32_tflops:g} (TF32 tensor cores), so it is optimistic "
            f"(about 7x on an H100). Fix: precision.tf32=true, or read the time as a lower bound."
        )
    if lay.mesh.tp > lay.gpus_per_node:
        out.append(
            f"parallel.tp={lay.mesh.tp} spans more than one node ({lay.gpus_per_node} GPUs per node): every block's "
            f"TP collectives cross the network. Fix: parallel.tp <= {lay.gpus_per_node} and use pp or dp_shard instead."
        )
    return out


def accumulate_unsharded_note(spec, lay: Layout) -> List[str]:
    """Why parallel.accumulate_unsharded=true was resolved to false for this layout, if it was."""
    if accumulate_unsharded_value(spec.parallel.accumulate_unsharded) != "true" or lay.memory.accumulate_unsharded:
        return []
    return [f"parallel.accumulate_unsharded=true does not apply to this layout ({accumulate_unsharded_blocker(lay)}): "
            f"gradients accumulate as with false. Fix: parallel.accumulate_unsharded=auto to silence this."]
