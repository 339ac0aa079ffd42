"""Render a Plan (`action=plan`) or search results (`action=search`) as text tables or JSON.

Pure Python: the CLI prints what these return; nothing here computes an estimate.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence

from launcher.models.family import family_of
from launcher.plan.estimate.bands import memory_at_risk
from launcher.plan.estimate.memory import GiB, other_parts, own_maxima
from launcher.plan.decide.eval_jobs import eval_jobs_line
from launcher.plan.estimate.eval_time import eval_summary
from launcher.plan.degrees import MESH_DIM_NAMES
from launcher.plan.estimate.params import model_shape
from launcher.plan.estimate.perf import correction_bias_bytes
from launcher.plan.decide.resolve import world_size

def assumptions(model: Any, moe_imbalance: float = 1.0) -> str:
    """The plan's assumptions line, naming the family's block the activation and elementwise formulas
    model (launcher/models/<family>/params.py block_description), for MoE models the routing load
    the expert-parallel terms assume (plan.moe_imbalance) and, for DeepSeek-V3, the size of the
    once-per-step router-bias update the step time includes."""
    block = family_of(model).params_module().block_description(model)
    shape = model_shape(model)
    text = (
        "Assumptions: ring collectives at hardware.comm_efficiency of NVLink (group inside a node) or of "
        "the per-GPU network link; compute at hardware.achievable_fraction of dense peak, less for small GEMMs, "
        "plus norms, RoPE, SwiGLU, loss and float8 casts at hardware.hbm_gbps (fused under trainer.compile); "
        "FSDP/ZeRO gathers and reductions overlap compute, TP and EP collectives do not; activations per "
        f"Korthikanti et al. for the {block} with flash attention (docs/planner.md)."
    )
    if shape.n_moe_layers:
        load = ("balanced routing (plan.moe_imbalance=1; a run's moe/tokens_per_expert_max_over_mean gives its own)"
                if moe_imbalance == 1.0 else
                f"the busiest expert-parallel rank at {moe_imbalance:g}x the mean routed tokens (plan.moe_imbalance)")
        text += (f" Routed experts: {load}; one all-to-all row per routed copy, its other-node part on the "
                 f"network link.")
    if shape.correction_bias:
        text += (f" Aux-loss-free router-bias update: one all-reduce of {shape.n_layers} x {shape.n_experts} fp32 "
                 f"expert loads ({correction_bias_bytes(shape) / 1e3:.1f} kB) and a sign/add over "
                 f"{shape.n_moe_layers * shape.n_experts:,} biases per step, in the step time "
                 f"('router bias all-reduce').")
    return text


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def _gb(b: float) -> str:
    return f"{b / 1e9:.2f} GB"


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _table(headers: Sequence[str], rows: List[Sequence[Any]], align: str = "") -> str:
    """A plain text table; `align` holds 'l' or 'r' per column (default: first left, rest right)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))
    lines = []
    for n, r in enumerate(cells):
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  " + "  ".join(parts).rstrip())
        if n == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- action=plan


def plan_json(plan, spec) -> Dict[str, Any]:
    """The plan as one JSON-serialisable dict (plan.json's content plus model and hardware)."""
    d = plan.to_dict()
    d["model"] = {"name": spec.model.name, "params_total": plan.params_total, "params_active": plan.params_active}
    d["hardware"] = {"name": spec.hardware.name, "memory_gb": spec.hardware.memory_gb,
                     "bf16_tflops": spec.hardware.bf16_tflops, "fp8_tflops": spec.hardware.fp8_tflops,
                     "tf32_tflops": spec.hardware.tf32_tflops}
    d["assumptions"] = assumptions(spec.model, spec.plan.moe_imbalance)
    return d


def render_plan(plan, spec, fmt: str = "text") -> str:
    """`action=plan` output. fmt "json": one JSON object; "text": readable tables."""
    if fmt == "json":
        return json.dumps(plan_json(plan, spec), indent=2, default=float)
    if fmt != "text":
        raise ValueError(f"plan.format={fmt!r} is not one of text, json. Fix: plan.format=text or plan.format=json.")
    sections = [
        _header(plan, spec),
        _mesh_section(plan),
        _backends_section(plan),
        _memory_section(plan, spec),
        _comm_section(plan),
        _time_section(plan, spec),
        _checkpoint_section(plan),
        eval_summary(getattr(plan, "eval", {})),
        eval_jobs_line(spec, spec.cluster.name),
        _budget_section(plan, spec),
        assumptions(spec.model, spec.plan.moe_imbalance),
    ]
    if plan.warnings:
        sections.append("Warnings\n" + "\n".join(f"  ! {w}" for w in plan.warnings))
    return "\n\n".join(s for s in sections if s)


def _header(plan, spec) -> str:
    m, b = spec.model, plan.batch
    moe = f", {m.n_experts} experts top-{m.top_k}" if m.n_experts else ""
    return (
        f"Plan: {m.name} on {plan.nodes} node(s) x {plan.gpus_per_node} GPU(s) = {plan.world_size} "
        f"ranks ({spec.hardware.name}, {spec.precision.name})\n"
        f"  model: {_billions(plan.params_total)} parameters ({_billions(plan.params_active)} active), "
        f"{m.n_layers} layers, dim {m.dim}, {m.n_heads} heads / {m.n_kv_heads} KV heads{moe}\n"
        f"  batch: {b.global_batch_size} sequences x {b.seq_len} tokens = {b.tokens_per_step:,} tokens/step; "
        f"micro-batch {b.micro_batch_size}, {b.grad_accum_steps} micro-batches per step per data-parallel rank"
    )


def _mesh_section(plan) -> str:
    mesh = plan.mesh
    rows = []
    stride = 1
    strides = {}
    for name in reversed(MESH_DIM_NAMES):
        strides[name] = stride
        stride *= getattr(mesh, name)
    for name in MESH_DIM_NAMES:
        size = getattr(mesh, name)
        span = strides[name] * size
        where = "-" if size == 1 else ("intra-node" if span <= plan.gpus_per_node else "inter-node")
        first = [strides[name] * i for i in range(min(size, 4))]
        example = ", ".join(map(str, first)) + (", ..." if size > 4 else "")
        rows.append((name, size, strides[name], where, f"[{example}]"))
    if plan.layout.experts_folded:  # folded over TP: the innermost ep ranks of dp_shard*cp*tp
        rows.append(("ep", mesh.ep, strides["tp"], "taken from dp_shard*cp*tp (experts folded over TP)", ""))
    else:
        rows.append(("ep", mesh.ep, strides["cp"], "taken from dp_shard*cp", ""))
    return "Mesh (outermost to innermost; tp consecutive so it stays inside a node)\n" + _table(
        ("dim", "size", "rank stride", "links", "group of rank 0"), rows, "lrrll"
    )


def _backends_section(plan) -> str:
    used = [(f, c) for f, c in plan.backends.items() if c.impl != "off"]
    off = [f for f, c in plan.backends.items() if c.impl == "off"]
    rows = [(f, c.backend, c.impl) for f, c in used]
    text = "Backends\n" + _table(("feature", "backend", "implementation"), rows, "lll")
    text += "\n  why:\n" + "\n".join(f"    {f}: {c.reason}" for f, c in used)
    if off:
        text += "\n  not used: " + ", ".join(off)
    return text


def _memory_section(plan, spec) -> str:
    mem = plan.memory
    if not mem:
        return ""
    detail = mem.get("detail", {})
    phase = mem.get("peak_phase", "blocks")
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in other_parts(detail, phase).items() if v)
    own = own_maxima(detail, mem["grads"], mem["activations"])
    held = own["grads_held"]
    grads_note = (f"none yet at this peak; {_gib(held)} once the backward has made them (optimizer step)"
                  if not mem["grads"] and held else "")
    head = detail.get("activations_head", 0)
    freed = own["activations_max"] - mem["activations"]
    head_note = f"head {_gib(head)}" + (f" ({_gib(freed)} of it freed by the loss's backward, before this peak)"
                                        if freed > 0 else "")
    rows = [
        ("params", _gib(mem["params"]), ""),
        ("grads", _gib(mem["grads"]), grads_note),
        ("optimizer", _gib(mem["optimizer"]), ""),
        ("activations", _gib(mem["activations"]), f"blocks {_gib(detail.get('activations_layers', 0))}, {head_note}"),
        ("other", _gib(mem["other"]), parts),
        ("total", _gib(mem["total"]), f"of {_gib(mem['capacity'])}; measured peaks of this kind of layout: "
                                      f"{_gib_range(mem.get('total_range'))}"),
    ]
    if mem.get("host"):
        rows.append(("offloaded", _gib(mem["host"]), "on the host (CPU RAM / NVMe), not on the GPU"))
    margin = mem["margin"]
    verdict = (f"FITS with {_gib(margin)} to spare ({margin / mem['capacity']:.0%})" if mem["fits"]
               else f"DOES NOT FIT: {_gib(-margin)} over")
    if mem["fits"] and mem.get("total_range") and memory_at_risk(mem["total_range"], mem["capacity"]):
        verdict += (f", but AT RISK: measured peaks of this kind of layout reach {_gib(mem['total_range'][1])}, "
                    f"over the GPU's {_gib(mem['capacity'])} (action=search ranks such layouts last)")
    per_rank = mem.get("per_pp_rank", [])
    spread = ""
    if len(per_rank) > 1:
        spread = "\n  per pipeline rank total: " + ", ".join(
            f"{r['pp_rank']}: {r['total'] / GiB:.1f}" for r in per_rank[:8]) + (" ..." if len(per_rank) > 8 else "") + " GiB"
    return (f"Memory per GPU (most loaded: pipeline rank {mem['most_loaded_pp_rank']})\n"
            + _table(("category", "bytes", "notes"), rows, "lrl") + f"\n  verdict: {verdict}" + spread)


def _comm_section(plan) -> str:
    comm = plan.comm
    if not comm or not comm.get("collectives"):
        return "Communication: none (single rank)"
    rows = [
        (c["name"], c["collective"], f"{c['group']} ({c['group_size']})", c["where"], _gb(c["bytes_per_step"]),
         f"{c['time_s'] * 1e3:.1f}", f"{c['exposed_s'] * 1e3:.1f}")
        for c in comm["collectives"]
    ]
    return (f"Communication per step, one GPU of pipeline rank {comm.get('pp_rank', 0)}\n"
            + _table(("what", "collective", "group", "where", "sent", "time ms", "exposed ms"), rows, "llllrrr")
            + f"\n  total {_gb(comm['bytes_per_step'])}: intra-node {_gb(comm['intra_node_bytes'])}, "
              f"inter-node {_gb(comm['inter_node_bytes'])}")


def _time_section(plan, spec) -> str:
    p, t = plan.pipeline, plan.time
    if not t:
        return ""
    pipe = (f"Pipeline: pp={p['pp']}, schedule {p['schedule']}, {p['virtual_stages']} chunk(s) per rank, "
            f"{p['microbatches']} micro-batches, bubble {p['bubble_fraction']:.1%} of compute"
            if p.get("pp", 1) > 1 else "Pipeline: none (pp=1)")
    rows = [
        ("compute", f"{t['compute_s']:.3f}"),
        ("pipeline bubble", f"{t['bubble_s']:.3f}"),
        ("exposed communication", f"{t['exposed_comm_s']:.3f}"),
        ("optimizer step", f"{t['optimizer_s']:.3f}"),
        *_muon_rows(t.get("muon")),
        ("step", f"{t['step_s']:.3f} ({_range(t.get('step_s_range'), '.3f')})"),
    ]
    return (pipe + "\n\nTime per step (seconds)\n" + _table(("part", "s"), rows)
            + f"\n  throughput: {t['tokens_per_s']:,.0f} tokens/s ({_range(t.get('tokens_per_s_range'), ',.0f')}), "
              f"{t['tokens_per_s_per_gpu']:,.1f} tokens/s per GPU, "
              f"{t['model_tflops_per_s_per_gpu']:.0f} model TFLOP/s per GPU"
            + _muon_line(t.get("muon"))
            + f"\n  MFU: {t['mfu']:.1%} of {t['peak_tflops']:.0f} TFLOP/s dense {spec.precision.name if spec.precision.name == 'fp8' else 'bf16'} peak"
            + _band_line(t.get("band")))


def _muon_rows(m) -> list:
    """The optimizer step's Muon part (launcher/plan/estimate/perf.py muon_step_s), when some
    parameter gets Muon."""
    if not m:
        return []
    return [("  of it Muon Newton-Schulz", f"{m['ns_s']:.3f}"),
            ("  of it Muon gather/scatter", f"{m['gather_scatter_s']:.3f}"),
            ("  of it Muon momentum + update", f"{m['elementwise_s']:.3f}")]


def _muon_line(m) -> str:
    """What the Muon rows are: the busiest owner's Newton-Schulz work and its imbalance, the bytes
    each rank moves to and from the owners."""
    if not m:
        return ""
    return (f"\n  Muon: {m['matrices']:,} matrices orthogonalised by their owner ranks (Newton-Schulz in bf16, "
            f"{m['ns_tflops']:.3g} TFLOP on the busiest rank, {m['ns_imbalance']:.2f}x the mean); "
            f"{_gb(m['gather_scatter_bytes'])} per rank gathered to the owners and scattered back")


def _range(pair, fmt: str) -> str:
    return "-" if not pair else f"{format(pair[0], fmt)}-{format(pair[1], fmt)}"


def _gib_range(pair) -> str:
    return "-" if not pair else f"{pair[0] / GiB:.1f}-{pair[1] / GiB:.1f} GiB"


def _band_line(band) -> str:
    """Where the ranges in brackets come from (launcher/plan/estimate/bands.py, docs/planner.md)."""
    if not band:
        return ""
    if band["measured"]:
        memory = ("" if band.get("memory_measured", True) else
                  f"; memory: no measured {band['kind']} row yet, so the widest band of any kind, 25 % wider")
        return (f"\n  ranges in brackets: what was measured for {band['kind']} layouts ({band['rows']} accuracy rows, "
                f"bench/planner_accuracy.py --bands){memory}")
    return (f"\n  ranges in brackets: no measured {band['kind']} row yet, so the widest band of any kind, "
            f"25 % wider (bench/planner_accuracy.py --bands)")


def _budget_section(plan, spec) -> str:
    b = plan.budget
    if not b:
        return ""
    hours = b["wall_s"] / 3600
    lo, hi = (s / 3600 for s in b["wall_s_range"])
    source = f"trainer.tokens={spec.trainer.tokens:,}" if spec.trainer.tokens else f"trainer.steps={b['steps']:,}"
    what = "training steps and evaluation" if b.get("eval_s") else "training steps"
    text = (f"Budget ({source}): {b['steps']:,} steps, {b['tokens']:,} tokens; {hours:,.1f} h of {what} "
            f"({lo:,.1f}-{hi:,.1f}), {b['gpu_hours']:,.0f} GPU-hours ({_range(b['gpu_hours_range'], ',.0f')})")
    if b["usd"] is None:
        return text + "; set hardware.usd_per_gpu_hour for the cost"
    return text + (f", ${b['usd']:,.0f} (${b['usd_range'][0]:,.0f}-${b['usd_range'][1]:,.0f}) at "
                   f"${b['usd_per_gpu_hour']:g}/GPU-hour")


def _checkpoint_section(plan) -> str:
    ck = plan.checkpoint
    if not ck:
        return ""
    return (f"Checkpoint save: {_gib(ck['bytes_per_rank'])} per rank, {_gib(ck['bytes_per_node'])} per node at "
            f"{ck['storage_gbps']:g} GB/s (hardware.storage_gbps) = {ck['save_s']:.1f} s; a stop (step + save) "
            f"{ck['stop_s']:.1f} s; torchrun --shutdown-timeout {ck['shutdown_timeout_s']} s"
            f"{_lost_work(ck)}")


def _lost_work(ck: Dict[str, Any]) -> str:
    """The checkpoint line's tail: expected work lost per failure (half an interval) for each tier."""
    if "lost_per_failure_s" not in ck:  # a plan.json written before these fields
        return ""
    if ck["lost_per_failure_s"] is None:
        text = ("\n  Lost per failure: everything since the start (no periodic checkpoint: checkpoint.interval=0 "
                "or checkpoint.enabled=false)")
    else:
        text = (f"\n  Lost per failure (half an interval): {ck['lost_per_failure_s']:.1f} s from the shared "
                f"checkpoint (checkpoint.interval={ck['interval_steps']} steps)")
    if ck.get("local_lost_per_failure_s") is not None:
        text += (f", {ck['local_lost_per_failure_s']:.1f} s from the node-local tier "
                 f"(checkpoint.local_interval={ck['local_interval_steps']} steps)")
    elif ck["lost_per_failure_s"] is not None:
        text += "; set checkpoint.local_dir for a node-local tier at checkpoint.local_interval"
    return text


# ----------------------------------------------------------------------------- action=search


# The search table's column for a plan.objective other than throughput (tok/s/GPU is always shown).
OBJECTIVE_COLUMNS = {"time": "wall h", "cost": "USD"}


def _objective_label(spec) -> str:
    budget_of = (f"trainer.tokens={spec.trainer.tokens:,}" if spec.trainer.tokens
                 else f"trainer.steps={spec.trainer.steps:,}")
    return {"throughput": "tokens/s per GPU (plan.objective=throughput)",
            "time": f"wall time of the training steps to {budget_of} (plan.objective=time)",
            "cost": f"USD to {budget_of} at ${spec.hardware.usd_per_gpu_hour}/GPU-hour (plan.objective=cost)",
            }[spec.plan.objective]


def _objective_cell(b, objective: str) -> str:
    """The budget figure plan.objective ranks by, with its range (launcher/plan/estimate/budget.py)."""
    if objective == "time":
        return f"{b['wall_s'] / 3600:,.1f} ({_range([s / 3600 for s in b['wall_s_range']], ',.1f')})"
    return f"{b['usd']:,.0f} ({_range(b['usd_range'], ',.0f')})"


def render_search(candidates, spec, fmt: str = "text", top_k: int = 10) -> str:
    """`action=search` output: the best `top_k` layouts with the overrides that select each."""
    world = world_size(spec.cluster)
    best = list(candidates)[: max(0, int(top_k))]
    if fmt == "json":
        return json.dumps({
            "model": spec.model.name,
            "hardware": spec.hardware.name,
            "world_size": world,
            "global_batch_size": spec.trainer.global_batch_size,
            "seq_len": spec.trainer.seq_len,
            "objective": spec.plan.objective,
            "candidates": [c.as_dict() for c in best],
        }, indent=2)
    if fmt != "text":
        raise ValueError(f"plan.format={fmt!r} is not one of text, json. Fix: plan.format=text or plan.format=json.")
    nodes = sorted({int(n) for n in spec.plan.search_nodes})
    gpus = (f"{', '.join(str(n * spec.cluster.gpus_per_node) for n in nodes)} GPUs" if nodes
            else f"{world} GPUs")
    head = (f"Search: {spec.model.name} on {gpus} ({spec.hardware.name}), global batch "
            f"{spec.trainer.global_batch_size} x {spec.trainer.seq_len} tokens, ranked by {_objective_label(spec)}")
    if not best:
        return (head + "\n  no valid layout fits. Fix: more nodes, offload (offload.optimizer=cpu), a shorter "
                "trainer.seq_len, or a smaller trainer.global_batch_size; `action=plan` shows the memory of one layout.")
    objective = spec.plan.objective
    rows = []
    for i, c in enumerate(best, 1):
        lay = c.layout
        pipe = f"{lay.mesh.pp}" + (f"x{lay.vpp} {lay.schedule}" if lay.mesh.pp > 1 else "")
        tps = f"{c.tokens_per_s_per_gpu:,.0f}"
        if objective == "throughput":
            tps += f" ({_range(c.tokens_per_s_per_gpu_range, ',.0f')})"
        lead = [i] + ([_objective_cell(c.budget, objective)] if objective != "throughput" else [])
        lead += [lay.mesh.world_size] if nodes else []
        rows.append((*lead, tps, f"{c.mfu:.1%}",
                     f"{c.step_s:.2f} ({_range(c.step_s_range, '.2f')})",
                     f"{c.memory['total'] / GiB:.1f} ({_range([b / GiB for b in c.memory_total_range], '.1f')})", c.fits,
                     pipe, lay.mesh.dp_replicate, lay.mesh.dp_shard, lay.mesh.cp, lay.mesh.tp,
                     lay.mesh.ep, lay.memory.zero_stage, lay.memory.ac_mode, lay.batch.micro_batch_size, c.backends.get("sharding", "native")))
    heads = ["#"] + ([OBJECTIVE_COLUMNS[objective]] if objective != "throughput" else []) + (["GPUs"] if nodes else [])
    table = _table((*heads, "tok/s/GPU", "MFU", "step s", "mem GiB", "fits", "pp", "dp_rep", "dp_shard", "cp", "tp",
                    "ep", "zero", "AC", "mbs", "sharding"), rows, "r" * len(heads) + "rrrrllrrrrrrlrl")
    cmds = "\n".join(f"  {i}: train {c.train_overrides}" for i, c in enumerate(best, 1))
    table += ("\n  (ranges: step time and peak memory measured for layouts of the same kind, scaled to each "
              "prediction: bench/planner_accuracy.py --bands, docs/planner.md)")
    at_risk = [i for i, c in enumerate(best, 1) if c.memory_at_risk]
    if at_risk:
        gpu = best[at_risk[0] - 1].gpu_capacity / GiB
        table += (f"\n  at risk ({', '.join(f'#{i}' for i in at_risk)}): the upper end of the memory range exceeds the "
                  f"GPU's {gpu:.1f} GiB (hardware.memory_gb), so the run may go out of memory; ranked after every "
                  f"layout whose whole range fits")
    return f"{head}\n{table}\n\nOverrides that select each layout (add them to your command)\n{cmds}\n\n{assumptions(spec.model, spec.plan.moe_imbalance)}"
