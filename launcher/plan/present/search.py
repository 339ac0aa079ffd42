"""`action=search`: enumerate parallel layouts, keep the valid ones that fit, rank by plan.objective.

Enumerated per cluster and model: tp (divides the heads, KV heads and FFN widths, at most
one node), cp (sequence divisible by 2*cp; not on CPU with backend.cp_impl=ring), pp (divides what is left, at most
one block per stage) with its schedule and virtual stages, dp_replicate x dp_shard (HSDP)
for the rest, ep (MoE: divides the experts and dp_shard*cp*tp), zero_stage, activation
checkpointing, micro-batch size (the global batch stays fixed); with plan.search_nodes, the
node count too.

Ranking: layouts whose whole memory band (launcher/plan/estimate/bands.py) fits the GPU come first; a
layout whose point estimate fits but whose band's upper end exceeds hardware.memory_gb is kept,
marked "at risk", and ranked after all of them, whatever the objective.

Objective (plan.objective): throughput ranks by tokens/s per GPU; time by the wall time of the
training steps to the budget (launcher/plan/estimate/budget.py: trainer.steps, which trainer.tokens sets);
cost by the GPU-hours (hence USD) to it. On one GPU count the three orders agree (the global
batch is fixed, so each is a function of the step time); across node counts more GPUs finish
sooner but usually cost more, and the orders differ.

Speed: llama405b on 2,048 GPUs has ~10^5 combinations. The estimators are cheap but not
free, so the search works in three passes:
1. model states depend only on the mesh and ZeRO stage: a layout whose states alone exceed
   the GPU is dropped before any activation or time is computed;
2. for each (mesh, ZeRO, micro-batch) only the cheapest recomputation that fits is timed:
   none < selective < full trade memory for compute monotonically, so the others are dominated;
3. the ranked survivors are checked with the real validator (`launcher.config.validate`)
   in order until `limit` valid ones are found; every returned layout passed it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from launcher.config.errors import ConfigError
from launcher.config.schema import replaced_dotted
from launcher.config.validate import (PLAN_OBJECTIVES, accumulate_unsharded_value, tensor_parallel_problems,
                                      tied_pipeline_problems)
from launcher.plan.decide.optim_groups import has_muon
from launcher.plan.estimate.eval_time import eval_estimate, eval_workload
from launcher.plan.estimate.bands import layout_kind, memory_at_risk, memory_range, value_range
from launcher.plan.estimate.budget import budget
from launcher.plan.estimate.figures import capacity_bytes, reserved_bytes
from launcher.plan.estimate.flops import training_flops_per_token
from launcher.plan.layout import NODES_OVERRIDE, Layout, accumulate_unsharded_blocker
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.memory import estimate_memory, model_state_memory, most_loaded
from launcher.plan.estimate.params import ModelShape, model_shape, stage_params
from launcher.plan.estimate.perf import estimate_time
from launcher.plan.decide.resolve import (backend_fields, decide_cp, expert_parallel_problems,
                                          experts_folded, spec_fields, validate, world_size)
from launcher.plan.decide.rules import backend_conflicts

AC_MODES = ("none", "selective", "full")
MAX_MICRO_BATCH = 16
# CP together with PP is searched where each CP rank keeps at least this many tokens of a row
# (long-context runs: Llama 3's 128K stage ran cp=16 x pp=16). Below it the search leaves the
# pair out to stay fast: at 8K tokens it would multiply the candidates, measured 6.6 s instead of
# 1.3 s for `+recipe=llama405b action=search cluster.nodes=256`. Such a layout is still planned
# and run when parallel.cp and parallel.pp are given.
CP_WITH_PP_MIN_TOKENS = 8192


@dataclass
class Candidate:
    """One valid layout that fits, with its estimates and the overrides that select it."""

    layout: Layout
    overrides: Dict[str, Any]
    memory: Dict[str, int]  # most loaded GPU: params, grads, optimizer, activations, other, total
    capacity: int
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_fraction: float
    backends: Dict[str, str] = field(default_factory=dict)  # feature -> backend (features in use)
    kind: str = "fsdp"  # the accuracy kind of the layout (launcher/plan/estimate/bands.py)
    reserved: int = 0  # bytes outside the allocator (the memory band is of the allocator's share)
    gpu_capacity: int = 0  # hardware.memory_gb in bytes, no headroom: where the run goes out of memory
    # Steps, wall time, GPU-hours and cost to the budget (launcher/plan/estimate/budget.py), with ranges.
    budget: Dict[str, Any] = field(default_factory=dict)

    @property
    def step_s_range(self) -> List[float]:
        """Step times measured for layouts of this kind, scaled to this prediction."""
        return list(value_range(self.step_s, self.kind, "time"))

    @property
    def tokens_per_s_per_gpu_range(self) -> List[float]:
        """Tokens/s per GPU measured for layouts of this kind (the step time band, inverted)."""
        lo, hi = self.step_s_range
        return [self.tokens_per_s_per_gpu * self.step_s / hi, self.tokens_per_s_per_gpu * self.step_s / lo]

    @property
    def memory_total_range(self) -> List[float]:
        """Peak memory measured for layouts of this kind, scaled to this prediction."""
        return list(memory_range(self.memory["total"], self.reserved, self.kind))

    @property
    def memory_at_risk(self) -> bool:
        """The upper end of the memory band exceeds the GPU (hardware.memory_gb): the point estimate
        fits, but layouts of this kind have peaked that much higher than planned, so it may OOM."""
        return memory_at_risk(self.memory_total_range, self.gpu_capacity)

    @property
    def fits(self) -> str:
        """"yes" when the whole memory band fits the GPU, "at risk" when only its lower part does."""
        return "at risk" if self.memory_at_risk else "yes"

    @property
    def train_overrides(self) -> str:
        """The command-line overrides, e.g. "parallel.tp=8 parallel.pp=4 ..."."""
        return " ".join(f"{k}={_fmt(v)}" for k, v in self.overrides.items())

    def as_dict(self) -> Dict[str, Any]:
        return {
            "overrides": self.train_overrides,
            "world_size": self.layout.mesh.world_size,
            "nodes": self.layout.nodes,
            "mesh": self.layout.mesh.to_dict(),
            "zero_stage": self.layout.memory.zero_stage,
            "activation_checkpointing": self.layout.memory.ac_mode,
            "micro_batch_size": self.layout.batch.micro_batch_size,
            "pp_schedule": self.layout.schedule,
            "pp_virtual_stages": self.layout.vpp,
            "memory": dict(self.memory),
            "capacity": self.capacity,
            "step_s": self.step_s,
            "step_s_range": self.step_s_range,
            "memory_total_range": self.memory_total_range,
            "gpu_capacity": self.gpu_capacity,
            "fits": self.fits,
            "band_kind": self.kind,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tokens_per_s_per_gpu_range": self.tokens_per_s_per_gpu_range,
            "budget": dict(self.budget),
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "backends": dict(self.backends),
        }


def _fmt(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ----------------------------------------------------------------------------- enumeration


def tp_options(spec) -> List[int]:
    """TP degrees inside one node that the model splits over (the validator's TP rule, written
    once) and that divide the sequence (the search turns sequence parallelism on with TP)."""
    m, gpn = spec.model, spec.cluster.gpus_per_node
    return [t for t in _divisors(gpn) if not tensor_parallel_problems(m, t) and spec.trainer.seq_len % t == 0]


def cp_options(spec) -> List[int]:
    if spec.trainer.device == "cpu" and spec.backend.cp_impl == "ring":
        return [1]  # ring attention has no CPU kernel (all-gather CP runs everywhere)
    s = spec.trainer.seq_len
    return [c for c in (1, 2, 4, 8, 16) if s % (2 * c) == 0 or c == 1]


def schedule_options(pp: int, n_layers: int) -> List[Tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    for v in (2, 4):
        if pp * v <= n_layers:
            out.append(("interleaved_1f1b", v))
    if 2 * pp <= n_layers:
        out.append(("zbv", 2))
    return out


def mesh_options(spec) -> Iterator[Tuple[int, int, int, int, int, int, str, int]]:
    """(tp, cp, pp, dp_replicate, dp_shard, ep, schedule, vpp) for every compatible mesh."""
    m = spec.model
    world = world_size(spec.cluster)
    for tp in tp_options(spec):
        for cp in cp_options(spec):
            if world % (tp * cp):
                continue
            rest = world // (tp * cp)
            for pp in _divisors(rest):
                if pp > m.n_layers or tied_pipeline_problems(m, pp):
                    continue
                if cp > 1 and pp > 1 and spec.trainer.seq_len // cp < CP_WITH_PP_MIN_TOKENS:
                    continue
                dp = rest // pp
                for sched, vpp in schedule_options(pp, m.n_layers):
                    for dp_rep in _divisors(dp):
                        dp_shard = dp // dp_rep
                        eps = [1]
                        if m.n_experts:
                            shard = MeshPlan(dp_shard=dp_shard, cp=cp, tp=tp)
                            eps = [e for e in _divisors(m.n_experts) if not expert_parallel_problems(e, shard)]
                        for ep in eps:
                            yield tp, cp, pp, dp_rep, dp_shard, ep, sched, vpp


def micro_batch_options(gbs: int, dp: int) -> List[int]:
    if gbs % dp:
        return []
    per_rank = gbs // dp
    return [b for b in _divisors(per_rank) if b <= MAX_MICRO_BATCH]


# ----------------------------------------------------------------------------- backends


class _BackendCache:
    """Resolve backends once per combination of the switches the resolver looks at."""

    def __init__(self, spec):
        self.spec = spec
        self.cache: Dict[tuple, Optional[Dict[str, Any]]] = {}

    def get(self, lay: Layout) -> Optional[Dict[str, Any]]:
        key = (lay.memory.zero_stage, lay.mesh.pp > 1, lay.mesh.tp > 1, lay.sp, lay.mesh.cp > 1, lay.mesh.ep > 1,
               lay.memory.ac_mode,
               lay.mesh.dp_replicate > 1, lay.schedule if lay.mesh.pp > 1 else "", lay.vpp)
        if key not in self.cache:
            try:
                conflicts, choices = backend_conflicts(candidate_spec(self.spec, lay), lay.mesh)
                self.cache[key] = None if conflicts else choices
            except Exception:  # noqa: BLE001 - an unexpected resolver error must not kill the search
                self.cache[key] = None
        return self.cache[key]


def candidate_spec(spec, lay: Layout):
    """The JobConfig that selects `lay` (the user's spec with the layout's keys replaced, through
    the one layout <-> overrides map, layout.OVERRIDE_FIELDS). The explicit pipeline split and
    micro-batch count are reset: the layout's own follow from the degrees and the batch."""
    key, path = NODES_OVERRIDE
    return replaced_dotted(spec, {**lay.overrides(), key: lay.value_at(path),
                                  "parallel.pp_layers": [], "parallel.microbatches": -1})


# ----------------------------------------------------------------------------- search


def _base_layout(spec) -> Layout:
    return Layout(**spec_fields(spec))


def _accumulation_held(spec, shape: ModelShape, lay: Layout, reserve: int):
    """(layout, its most loaded memory) with parallel.accumulate_unsharded applied as the resolver
    applies it (resolve.resolve_accumulate_unsharded): held unsharded where the layout allows it,
    for auto only when that fits hardware.memory_gb. Not the search's capacity with headroom: a
    layout between the two would be searched unheld and run held. The caller then drops a layout
    whose memory exceeds the capacity with headroom, as for any other."""
    want = accumulate_unsharded_value(spec.parallel.accumulate_unsharded)
    ranks = (0, lay.mesh.pp - 1)
    if want != "false" and not accumulate_unsharded_blocker(lay):
        held = dataclasses.replace(lay, memory=dataclasses.replace(lay.memory, accumulate_unsharded=True))
        mem = most_loaded(estimate_memory(shape, held, reserve, ranks=ranks))
        if want == "true" or mem.total <= capacity_bytes(spec.hardware):
            return held, mem
    return lay, most_loaded(estimate_memory(shape, lay, reserve, ranks=ranks))


def _with_backends(lay: Layout, choices: Dict[str, Any], spec) -> Layout:
    owners = dataclasses.replace(lay.owners, **backend_fields(choices, spec.offload.optimizer, lay.mesh.pp))
    return dataclasses.replace(lay, owners=owners)


def node_counts(spec) -> List[int]:
    """The cluster.nodes values the search tries: plan.search_nodes, or cluster.nodes alone."""
    return sorted({int(n) for n in spec.plan.search_nodes}) or [spec.cluster.nodes]


def evaluate_layouts(spec) -> Tuple[List[Candidate], Dict[str, int]]:
    """Every fitting layout with its estimates on every node count, best first by plan.objective
    (not yet validated)."""
    out: List[Candidate] = []
    stats: Dict[str, int] = {}
    for nodes in node_counts(spec):
        on_nodes = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, nodes=nodes))
        cands, st = _evaluate_world(on_nodes, with_nodes=bool(spec.plan.search_nodes))
        out += cands
        for k, v in st.items():
            stats[k] = stats.get(k, 0) + v
    out.sort(key=rank_key(spec.plan.objective))
    return _dedupe(out), stats


def _evaluate_world(spec, with_nodes: bool) -> Tuple[List[Candidate], Dict[str, int]]:
    """Every fitting layout on spec's cluster, unsorted; `with_nodes`: its overrides name cluster.nodes."""
    shape: ModelShape = model_shape(spec.model)
    hw = spec.hardware
    # Leave headroom for allocator fragmentation and what the model does not see.
    gpu = capacity_bytes(hw)
    cap = int(gpu * (1.0 - float(spec.plan.search_headroom)))
    reserve = reserved_bytes(hw)
    gbs, seq = spec.trainer.global_batch_size, spec.trainer.seq_len
    flops_tok = training_flops_per_token(spec.model, seq)
    tokens_per_step = gbs * seq
    base = _base_layout(spec)
    backends = _BackendCache(spec)
    stats = {"meshes": 0, "layouts": 0, "states_too_big": 0, "timed": 0, "no_backend": 0, "muon_needs_native": 0}
    muon = has_muon(spec.optim)
    out: List[Candidate] = []
    # Keys candidate_spec resets: they must be in the overrides too, or the user's values clash.
    resets: Dict[str, Any] = {}
    if spec.parallel.microbatches != -1:
        resets["parallel.microbatches"] = -1
    if spec.parallel.pp_layers:
        resets["parallel.pp_layers"] = "[]"
    if with_nodes:
        resets["cluster.nodes"] = spec.cluster.nodes
    steps, price = spec.trainer.steps, spec.hardware.usd_per_gpu_hour
    evaluation = eval_workload(spec)  # the same tasks for every candidate; priced at each one's compute rate
    zeros = [spec.parallel.zero_stage] if spec.offload.optimizer != "none" or spec.offload.params != "none" else [0, 1, 2, 3]
    for tp, cp, pp, dp_rep, dp_shard, ep, sched, vpp in mesh_options(spec):
        stats["meshes"] += 1
        mesh = MeshPlan(pp=pp, dp_replicate=dp_rep, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep)
        dp = mesh.dp
        mbs_opts = micro_batch_options(gbs, dp)
        if not mbs_opts:
            continue
        for zero in zeros:
            if zero < 2 and dp_rep > 1:
                continue  # replicate groups only matter when states are sharded (HSDP)
            memory = dataclasses.replace(base.memory, zero_stage=zero)
            lay0 = dataclasses.replace(base, mesh=mesh, sp=tp > 1, vpp=vpp, schedule=sched, memory=memory,
                                       experts_folded=experts_folded(spec.model.n_experts, tp))
            choices = backends.get(dataclasses.replace(lay0, memory=dataclasses.replace(lay0.memory, ac_mode="none")))
            if choices is None:
                stats["no_backend"] += 1
                continue
            lay0 = _with_backends(lay0, choices, spec)
            if muon and lay0.owners.sharding_backend != "native":
                # Muon is served by the native engine only (launcher/launch/preflight.py refuses the rest).
                stats["muon_needs_native"] += 1
                continue
            # Pass 1: model states of the heaviest stage, before any activation.
            stages = stage_params(shape, pp, vpp, sched, ())
            ends = (stages[0], stages[-1])
            states = max(sum(v for k, v in model_state_memory(st, lay0).items() if k != "host") for st in ends)
            if states + reserve > cap:
                stats["states_too_big"] += 1
                continue
            for mbs in mbs_opts:
                m = gbs // (mbs * dp)
                if pp > 1 and m < pp:
                    continue  # the schedule needs at least pp micro-batches to fill the pipeline
                for ac in AC_MODES:
                    stats["layouts"] += 1
                    batch = dataclasses.replace(lay0.batch, micro_batch_size=mbs, microbatches=m)
                    lay = dataclasses.replace(lay0, batch=batch, memory=dataclasses.replace(lay0.memory, ac_mode=ac))
                    # backend.cp_impl=auto depends on this layout's memory, as the resolver decides it.
                    lay = decide_cp(spec, lay)
                    lay, mem = _accumulation_held(spec, shape, lay, reserve)
                    if mem.total > cap:
                        continue
                    # Pass 2: the first AC mode that fits dominates the heavier-recompute ones.
                    stats["timed"] += 1
                    t = estimate_time(shape, lay, hw, flops_tok, tokens_per_step, ranks=(0, pp - 1))
                    cand = Candidate(
                        layout=lay,
                        overrides={**lay.overrides(), **resets},
                        memory=mem.as_dict(),
                        capacity=cap,
                        step_s=t["step_s"],
                        tokens_per_s_per_gpu=t["tokens_per_s_per_gpu"],
                        mfu=t["mfu"],
                        bubble_fraction=(t["bubble_s"] / t["compute_s"]) if t["compute_s"] else 0.0,
                        backends={k: c.backend for k, c in choices.items() if getattr(c, "impl", "") != "off"},
                        kind=layout_kind(lay, spec.model.n_experts), reserved=reserve, gpu_capacity=gpu,
                    )
                    eval_s = eval_estimate(evaluation, t["compute_s"], tokens_per_step).get("total_s", 0.0)
                    cand.budget = budget(steps, tokens_per_step, cand.step_s, cand.step_s_range,
                                         lay.mesh.world_size, price, eval_s)
                    out.append(cand)
                    break
    return out, stats


def objective_value(c: Candidate, objective: str) -> float:
    """What plan.objective ranks by, lower first: minus tokens/s per GPU (throughput), the wall
    seconds to the budget (time), or its GPU-hours (cost: USD = GPU-hours x one price, so the same
    order, and defined before hardware.usd_per_gpu_hour is)."""
    if objective == "throughput":
        return -c.tokens_per_s_per_gpu
    if objective == "time":
        return c.budget["wall_s"]
    return c.budget["gpu_hours"]  # cost


def rank_key(objective: str):
    """Sort key for plan.objective: every layout whose whole memory band fits the GPU before any
    that is at risk of running out of memory (Candidate.memory_at_risk), then the objective, then
    (for equal estimates) the simpler layout (fewer CP / pipeline / TP ranks), the lower memory,
    and the fewer GPUs. A faster layout that may OOM is worth less than a slower one that runs."""
    if objective not in PLAN_OBJECTIVES:  # fail here, not halfway through a sort
        raise ValueError(f"plan.objective={objective!r} is not one of {', '.join(PLAN_OBJECTIVES)}. "
                         f"Fix: set plan.objective to one of them.")

    def key(c: Candidate) -> tuple:
        lay = c.layout
        m = lay.mesh
        return (c.memory_at_risk, float(f"{objective_value(c, objective):.6g}"), m.cp, m.pp * lay.vpp, m.tp, m.ep, m.dp_replicate,
                c.memory["total"], m.world_size)
    return key


def _dedupe(cands: List[Candidate]) -> List[Candidate]:
    """Drop layouts whose estimates equal an earlier one with the same mesh (e.g. ZeRO-2 and -3
    under a native pipeline, which keeps units unsharded either way)."""
    seen = set()
    out = []
    for c in cands:
        lay = c.layout
        key = (lay.nodes, lay.mesh, lay.schedule, lay.vpp, lay.batch.micro_batch_size, lay.memory.ac_mode, round(c.step_s, 6),
               c.memory["total"])
        if key in seen:
            continue
        seen.add(key)
        out.append(c)
    return out


def search_layouts(spec, limit: Optional[int] = None, stats: Optional[Dict[str, int]] = None) -> List[Candidate]:
    """Valid, fitting layouts ranked by plan.objective (default: tokens/s per GPU), best first.

    Returns at most `limit` candidates (default: max(plan.top_k, 20)); each passed
    `launcher.config.validate.validate` with its overrides applied to `spec`. Raises
    ConfigError when the 50 best layouts all share a problem that no layout can fix.
    """
    limit = limit if limit is not None else max(int(spec.plan.top_k), 20)
    ranked, st = evaluate_layouts(spec)
    valid: List[Candidate] = []
    st["validated"] = st["rejected_by_validator"] = 0
    common: Optional[set] = None  # problems every rejected layout shares
    for cand in ranked:
        if len(valid) >= limit:
            break
        st["validated"] += 1
        problems = validate(candidate_spec(spec, cand.layout))
        if problems:
            st["rejected_by_validator"] += 1
            common = set(problems) if common is None else common & set(problems)
            if not valid and st["rejected_by_validator"] >= 50 and common:
                # A problem outside the layout (data path, model shape...): no layout can fix it.
                raise ConfigError(sorted(common))
            continue
        valid.append(cand)
    st["fitting"] = len(ranked)
    if stats is not None:
        stats.update(st)
    return valid
