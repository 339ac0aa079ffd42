"""`resolve(spec) -> Layout`: every derived decision, made once.

This is the only code that reads the parallel, offload, precision, backend and cluster groups
to derive

- the world size (``cluster.nodes * cluster.gpus_per_node``, here and nowhere else),
- the mesh degrees, with ``parallel.dp_shard=-1`` inferred from the world size,
- the gradient accumulation (micro-batches per optimizer step on each data-parallel rank),
- the pipeline micro-batches (THE rule: the schedule runs the accumulation micro-batches),
- the schedule and virtual stages, whether FSDP2 wraps the model (``Layout.fsdp_wraps``),
- whether FSDP2 accumulates gradients unsharded (``Layout.memory.accumulate_unsharded``, from
  parallel.accumulate_unsharded: auto checks the planner's memory against hardware.memory_gb),
- which backend and implementation owns each feature (launcher/plan/decide/rules.py), and which
  context-parallel implementation runs (``backend.cp_impl``: auto by the planner's memory,
  launcher/plan/decide/cp_choice.py).

`validate(spec)` is the full check: the config-level rules of launcher/config/validate.py
plus the rules that need those derived values; the CLI, the search and the tests use it.
Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from launcher.config.errors import ConfigError
from launcher.config.schema import ClusterConfig, JobConfig, ParallelConfig, ProfileConfig, TrainerConfig, world_size
from launcher.config.validate import _divisors, _fmt_choices, accumulate_unsharded_value, basic_problems
from launcher.config.validate import validate as validate_config
from launcher.data.checks import data_problems
from launcher.data.eval_inputs import eval_input_problems
from launcher.plan.features import FEATURES, BackendChoice
from launcher.plan.layout import (BackendPlan, DeepSpeedPlan, Layout, MemoryPlan, NumericsPlan, RankBatchPlan,
                                   ResiliencePlan, accumulate_unsharded_blocker)
from launcher.plan.estimate.memory import estimate_memory, most_loaded
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.params import model_shape
from launcher.plan.decide.optim_groups import model_group_problems, model_muon_matrices
from launcher.plan.decide.cp_choice import choose_cp_impl, cp_description, cp_memory
from launcher.plan.decide.rules import backend_conflicts, hpz_partition_size
from launcher.plan.decide.support import Switches


def derive_mesh(parallel: ParallelConfig, cluster: ClusterConfig) -> Tuple[Optional[MeshPlan], List[str]]:
    """(mesh, problems): the degrees with dp_shard=-1 inferred; None when they cannot fit."""
    p, c = parallel, cluster
    world = world_size(c)
    fixed = p.pp * p.dp_replicate * p.cp * p.tp
    if min(fixed, world) < 1:
        return None, []  # reported by the positive-value rules
    where = f"world size {world} (cluster.nodes={c.nodes} x cluster.gpus_per_node={c.gpus_per_node})"
    dp_shard = p.dp_shard
    if dp_shard == -1:
        if world % fixed:
            return None, [
                f"parallel: pp*dp_replicate*cp*tp = {p.pp}*{p.dp_replicate}*{p.cp}*{p.tp} = {fixed} does not divide "
                f"the {where}. Fix: choose degrees whose product divides {world}, or change cluster.nodes/gpus_per_node."
            ]
        dp_shard = world // fixed
    elif fixed * dp_shard != world:
        return None, [
            f"parallel: pp*dp_replicate*dp_shard*cp*tp = {p.pp}*{p.dp_replicate}*{p.dp_shard}*{p.cp}*{p.tp} = "
            f"{fixed * dp_shard} != {where}. Fix: set parallel.dp_shard=-1 to infer it, or make the product equal {world}."
        ]
    return MeshPlan(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard, cp=p.cp, tp=p.tp, ep=p.ep), []


def batch_split_problems(trainer: TrainerConfig, dp: int) -> List[str]:
    """The global batch must split into micro-batches over `dp` data-parallel ranks."""
    t = trainer
    per_step = t.micro_batch_size * dp
    if per_step < 1 or t.global_batch_size % per_step == 0:
        return []
    good = [g for g in range(per_step, per_step * 4 + 1, per_step)]
    return [
        f"trainer.global_batch_size={t.global_batch_size} is not a multiple of micro_batch_size*dp = "
        f"{t.micro_batch_size}*{dp} = {per_step} (global = micro x grad-accumulation x data-parallel size). "
        f"Fix: set trainer.global_batch_size to one of {good[:3]}, or change trainer.micro_batch_size."
    ]


def derive_accumulation(trainer: TrainerConfig, parallel: ParallelConfig, mesh: MeshPlan) -> Tuple[int, List[str]]:
    """(micro-batches per step per data-parallel rank, problems): global = micro x accumulation x dp.

    The one micro-batch rule: the gradient accumulation is global / (micro x dp), and the
    pipeline schedule runs exactly these micro-batches (`Layout.pp_microbatches`).
    """
    t, p = trainer, parallel
    dp = mesh.dp
    per_step = t.micro_batch_size * dp
    split = batch_split_problems(t, dp)
    if per_step < 1 or split:
        return 1, split
    accum = t.global_batch_size // per_step
    problems: List[str] = []
    if mesh.pp > 1 and p.pp_schedule != "gpipe" and accum < mesh.pp:
        problems.append(
            f"parallel.pp_schedule={p.pp_schedule} with parallel.pp={mesh.pp} needs at least {mesh.pp} micro-batches per "
            f"step, but global_batch_size/(micro_batch_size*dp) = {t.global_batch_size}/({t.micro_batch_size}*{dp}) "
            f"= {accum}. Fix: trainer.global_batch_size={mesh.pp * per_step} (or more), or a smaller "
            f"trainer.micro_batch_size."
        )
    if p.microbatches != -1 and p.microbatches != accum:
        problems.append(
            f"parallel.microbatches={p.microbatches} but global_batch_size/(micro_batch_size*dp) = "
            f"{t.global_batch_size}/({t.micro_batch_size}*{dp}) = {accum} micro-batches per step. "
            f"Fix: parallel.microbatches=-1, or trainer.global_batch_size={p.microbatches * per_step}."
        )
    return accum, problems


def expert_parallel_problems(ep: int, mesh: MeshPlan) -> List[str]:
    """Expert-parallel ranks are taken from dp_shard * cp * tp: the sharded data-parallel ranks and,
    the experts being folded over TP (each TP rank routes its own tokens), the TP ranks. ep > 1 is
    only valid for an MoE model (launcher/config/validate.py), whose experts fold whenever tp > 1."""
    shard_ranks = mesh.dp_shard * mesh.cp * mesh.tp
    if ep > 1 and shard_ranks % ep:
        return [
            f"parallel.ep={ep} must divide dp_shard*cp*tp = {mesh.dp_shard}*{mesh.cp}*{mesh.tp} = {shard_ranks} "
            f"(expert-parallel ranks are taken from the sharded data-parallel and the tensor-parallel ranks). "
            f"Fix: choose parallel.ep in {_fmt_choices(_divisors(shard_ranks))}."
        ]
    return []


def _layout_problems(spec: JobConfig) -> Tuple[Optional[Layout], List[str]]:
    """(layout, problems) assuming the basic rules (choices, positive values) passed."""
    mesh, problems = derive_mesh(spec.parallel, spec.cluster)
    if mesh is None:
        # Report a batch that no layout of these degrees can split together with the mesh
        # problem: its data-parallel size is at least dp_replicate (x dp_shard when given).
        p = spec.parallel
        floor = MeshPlan(dp_replicate=p.dp_replicate, dp_shard=max(1, p.dp_shard))
        return None, problems + batch_split_problems(spec.trainer, floor.dp)
    accum, batch_problems = derive_accumulation(spec.trainer, spec.parallel, mesh)
    problems += batch_problems + expert_parallel_problems(spec.parallel.ep, mesh)
    problems += profile_rank_problems(spec.profile, world_size(spec.cluster))
    conflicts, choices = backend_conflicts(spec, mesh)
    problems += [c.text() for c in conflicts]
    if problems or choices is None:
        return None, problems
    layout = build_layout(spec, mesh, accum, choices)
    async_problems = async_checkpoint_problems(spec, layout) + local_tier_problems(spec, layout)
    if async_problems:
        return None, async_problems
    held = resolve_accumulate_unsharded(spec, layout)[0]
    return replace(layout, memory=replace(layout.memory, accumulate_unsharded=held)), []


def async_checkpoint_problems(spec: JobConfig, layout: Layout) -> List[str]:
    """checkpoint.async=true needs the native engine: DeepSpeed's save_checkpoint writes in the
    foreground and offers no staged background write with our atomic publish (refused, not ignored)."""
    if not spec.checkpoint.saves_async or layout.owners.sharding_backend != "deepspeed":
        return []
    return [f"checkpoint.async=true: asynchronous checkpoints are written by the native engine (DCP async_save), "
            f"but this layout gives the model states to DeepSpeed (ZeRO-{layout.memory.zero_stage}), whose checkpoints are "
            f"written synchronously. Fix: checkpoint.async=false, or a layout the native engine runs (backend=native)."]


def local_tier_problems(spec: JobConfig, layout: Layout) -> List[str]:
    """checkpoint.local_dir needs the native engine: its node-local save copies each rank's local
    shards, which DeepSpeed's ZeRO engine does not hand out (refused, not ignored)."""
    if not (spec.checkpoint.enabled and spec.checkpoint.local_dir) or layout.owners.sharding_backend != "deepspeed":
        return []
    return [f"checkpoint.local_dir={spec.checkpoint.local_dir}: the node-local checkpoint tier is written by the "
            f"native engine, but this layout gives the model states to DeepSpeed (ZeRO-{layout.memory.zero_stage}). "
            f"Fix: checkpoint.local_dir='' (the shared checkpoint at checkpoint.interval only), or a layout the "
            f"native engine runs (backend=native)."]


def profile_rank_problems(profile: ProfileConfig, world: int) -> List[str]:
    """profile.ranks must name ranks of this job (an empty list picks the defaults)."""
    bad = [r for r in profile.ranks if not 0 <= r < world]
    if not (profile.enabled and bad):
        return []
    return [f"profile.ranks has {bad}, outside the job's ranks 0..{world - 1}. Fix: e.g. profile.ranks=[0], or [] "
            f"for rank 0 and the last pipeline rank."]


def resolve_accumulate_unsharded(spec: JobConfig, lay: Layout) -> Tuple[bool, str]:
    """(accumulate_unsharded, why): parallel.accumulate_unsharded resolved for `lay`.

    true: held unsharded wherever the layout allows it (else false, for the reason given);
    false: today's per-micro-batch communication; auto: true when allowed and the planner's
    memory of the most loaded GPU with it still fits hardware.memory_gb.
    """
    want = accumulate_unsharded_value(spec.parallel.accumulate_unsharded)
    if want == "false":
        return False, "parallel.accumulate_unsharded=false"
    blocker = accumulate_unsharded_blocker(lay)
    if blocker:
        return False, blocker
    if want == "true":
        return True, "parallel.accumulate_unsharded=true"
    need = unsharded_peak_bytes(spec, replace(lay, memory=replace(lay.memory, accumulate_unsharded=True)))
    capacity = int(spec.hardware.memory_gb * 1024**3)
    if need > capacity:
        return False, (f"auto: held unsharded the most loaded GPU needs {need / 1024**3:.1f} GiB "
                       f"> hardware.memory_gb={spec.hardware.memory_gb}")
    return True, f"auto: fits ({need / 1024**3:.1f} GiB <= hardware.memory_gb={spec.hardware.memory_gb})"


def unsharded_peak_bytes(spec: JobConfig, lay: Layout) -> int:
    """The planner's memory (bytes, most loaded GPU, with the reserve) of `lay`."""
    reserved = int(spec.hardware.reserved_gb * 1024**3)
    return int(most_loaded(estimate_memory(model_shape(spec.model), lay, reserved)).total)


def backend_fields(choices: Dict[str, BackendChoice], offload_optimizer: str, pp: int) -> Dict[str, str]:
    """The BackendPlan's owner fields from the per-feature choices (shared with the search)."""
    choice = lambda name: choices.get(name) or BackendChoice("native", "off", "")  # noqa: E731
    owner = choice("sharding").backend
    offload = choice("offload_optimizer" if offload_optimizer != "none" else "offload_params")
    ac = choice("activation_checkpointing")
    return {
        "sharding_backend": owner,
        "offload_backend": offload.backend if offload.impl != "off" else owner,
        "pp_backend": choice("pp").backend if pp > 1 else owner,
        "ac_backend": ac.backend if ac.impl != "off" else owner,
        "fp8_impl": "torchao" if choice("fp8").impl != "off" else "off",
    }


def with_cp_impl(spec: JobConfig, lay: Layout, impl: str) -> Layout:
    """`lay` with context parallelism's implementation `impl` and the document mask it implies."""
    return replace(lay, owners=replace(lay.owners, cp_impl=impl), document_mask=document_mask_kernel(spec, impl))


def decide_cp(spec: JobConfig, lay: Layout) -> Layout:
    """`lay` with backend.cp_impl resolved (launcher/plan/decide/cp_choice.py: auto by the planner's
    memory of `lay` with each implementation) and the reason written into its "cp" choice, which
    `action=plan` prints. Shared with the search."""
    if lay.mesh.cp <= 1:
        return with_cp_impl(spec, lay, "off")
    s = Switches.read(spec, lay.mesh)
    shape = model_shape(spec.model)

    def candidate(impl: str) -> Layout:  # as it would run: parallel.accumulate_unsharded resolved on it
        with_impl = with_cp_impl(spec, lay, impl)
        held = resolve_accumulate_unsharded(spec, with_impl)[0]
        return replace(with_impl, memory=replace(with_impl.memory, accumulate_unsharded=held))

    impl, why = choose_cp_impl(s.cp_impl, lay.mesh.cp, s.device, s.document_masking,
                               memory=lambda ring: cp_memory(candidate, shape, spec.hardware, ring), mtp=s.mtp,
                               pipeline=lay.mesh.pp > 1)
    out = with_cp_impl(spec, lay, impl)
    text = cp_description(lay.mesh.cp, impl, why)
    choices = tuple((name, replace(c, impl=text) if name == "cp" else c) for name, c in lay.owners.choices)
    return replace(out, owners=replace(out.owners, choices=choices))


def spec_fields(spec: JobConfig) -> Dict[str, Any]:
    """The Layout fields read straight from the spec, the same for every layout of it
    (precision, offload, DeepSpeed buckets and ZeRO++ keys, cluster size, seq_len); shared with the search."""
    pr, b, o = spec.precision, spec.backend, spec.offload
    return dict(
        nodes=spec.cluster.nodes,
        gpus_per_node=spec.cluster.gpus_per_node,
        batch=RankBatchPlan(seq_len=spec.trainer.seq_len),
        numerics=NumericsPlan(
            precision=pr.name,
            reduce_dtype=pr.reduce_dtype,
            fp8_all_gather=bool(pr.fp8.all_gather),
            fp8_recipe=str(pr.fp8.recipe),
            tf32=bool(pr.tf32),
            fp8_emulate=bool(pr.fp8.emulate),
            fp8_min_features=int(pr.fp8.min_features),
            fp8_exclude=tuple(str(x) for x in pr.fp8.exclude),
            optimizer=str(spec.optim.name),
            muon_matrices=model_muon_matrices(spec.model, spec.optim),
            muon_ns_steps=int(spec.optim.muon.ns_steps),
        ),
        memory=MemoryPlan(
            ac_selective=str(spec.activation_checkpointing.selective),
            offload_optimizer=o.optimizer,
            offload_params=o.params,
            offload_nvme_path=str(o.nvme_path),
            offload_pin_memory=bool(o.pin_memory),
        ),
        deepspeed=DeepSpeedPlan(
            reduce_bucket_size=int(b.reduce_bucket_size),
            allgather_bucket_size=int(b.allgather_bucket_size),
            zeropp_quantized_weights=bool(b.zeropp_quantized_weights),
            zeropp_quantized_gradients=bool(b.zeropp_quantized_gradients),
            zeropp_hierarchical_partition=int(b.zeropp_hierarchical_partition),
        ),
        compile=bool(spec.trainer.compile),
        document_mask=document_mask_kernel(spec),
        moe_imbalance=float(spec.plan.moe_imbalance),
        resilience=resilience_plan(spec),
    )


def experts_folded(n_experts: int, tp: int) -> bool:
    """MoE under tensor parallelism folds its experts over TP: each TP rank routes only its own
    tokens and the expert-parallel groups may take the TP ranks (Megatron's MoE parallel folding),
    so no expert is computed twice. Replicating the MoE over TP (every rank computing all of it)
    is never cheaper: it repeats the expert FLOPs and all-to-all tp times for no saving."""
    return n_experts > 0 and tp > 1


def resilience_plan(spec: JobConfig) -> ResiliencePlan:
    """The node checks, their `auto` decided here once. trainer.health_check=auto is on for multi-node
    jobs (one node has no other node to compare with); trainer.straggler_action=auto excludes a
    straggler's node only with a spare to take its place (cluster.spare_nodes > 0: without one, ending
    the job for a slow node would cost a requeue, hours in a busy queue)."""
    t, c = spec.trainer, spec.cluster
    health = t.health_check == "on" or (t.health_check == "auto" and c.nodes > 1)
    exclude = t.straggler_action == "exclude" or (t.straggler_action == "auto" and c.spare_nodes > 0)
    return ResiliencePlan(health_check=health, exclude_stragglers=exclude)


def document_mask_kernel(spec: JobConfig, cp_impl: str = "off") -> str:
    """The Layout's document_mask: "none" without data.document_masking (nor all-gather context
    parallelism, whose attention always takes a mask), else the kernel the model picks
    (launcher/models/layers.py): SDPA with a boolean mask on CPU (FlexAttention has no CPU
    backward), FlexAttention on GPUs (trainer.device cuda or auto: plans target GPUs)."""
    if not bool(getattr(spec.data, "document_masking", False)) and cp_impl != "allgather":
        return "none"
    return "sdpa" if spec.trainer.device == "cpu" else "flex"


def build_layout(spec: JobConfig, mesh: MeshPlan, accum: int, choices: Dict[str, BackendChoice]) -> Layout:
    """The Layout of a spec whose mesh, accumulation and backend choices are resolved."""
    p = spec.parallel
    fixed = spec_fields(spec)
    # hpZ groups follow the mesh (HSDP maps to groups of dp_shard), so they are set here, not in spec_fields.
    fixed["deepspeed"] = replace(fixed["deepspeed"], hpz_partition_size=hpz_partition_size(
        int(spec.backend.zeropp_hierarchical_partition), mesh.dp_replicate, mesh.dp_shard))
    fixed["batch"] = replace(fixed["batch"], micro_batch_size=spec.trainer.micro_batch_size, microbatches=max(1, accum))
    fixed["memory"] = replace(fixed["memory"], zero_stage=int(p.zero_stage), ac_mode=spec.activation_checkpointing.mode)
    return decide_cp(spec, Layout(
        **fixed,
        mesh=mesh,
        sp=bool(p.sp) and mesh.tp > 1,
        experts_folded=experts_folded(spec.model.n_experts, mesh.tp),
        vpp=max(1, int(p.pp_virtual_stages)) if mesh.pp > 1 else 1,
        schedule=p.pp_schedule,
        pp_layers=tuple(p.pp_layers),
        owners=BackendPlan(choices=tuple((f.name, choices[f.name]) for f in FEATURES if f.name in choices),
                           **backend_fields(choices, spec.offload.optimizer, mesh.pp)),
    ))


def resolve(spec: JobConfig) -> Layout:
    """The Layout of a spec. Raises ConfigError (one line per problem) when it cannot be resolved.

    Call `validate(spec)` first for the config-level problems; this raises only for what the
    derivation itself finds (degrees vs world size, batch arithmetic, backend conflicts...).
    """
    basic = basic_problems(spec)
    if basic:
        raise ConfigError(basic)
    layout, problems = _layout_problems(spec)
    if layout is None:
        raise ConfigError(problems)
    return layout


def resolve_all(spec: JobConfig) -> Tuple[Optional[Layout], List[str]]:
    """(layout, problems): every rule, config-level and derived, with the backend rules run once;
    the layout is None when there is any problem."""
    problems = validate_config(spec)
    if basic_problems(spec):
        return None, problems  # the derivation needs valid choices and positive degrees
    problems += data_problems(spec)
    problems += eval_input_problems(spec)
    problems += model_group_problems(spec.model, spec.optim)
    layout, derived = _layout_problems(spec)
    problems += derived
    if layout is not None:
        problems += eval_batch_problems(spec, layout)
    return (None if problems else layout), problems


def eval_rows_per_rank(trainer: TrainerConfig, batch_tokens: int, layout: Layout) -> int:
    """Rows (one scored sequence each, trainer.seq_len long) per forward call of downstream
    evaluation on each data-parallel rank: eval.batch_tokens // seq_len, or (0) the training step's."""
    if batch_tokens:
        return batch_tokens // trainer.seq_len
    return layout.batch.micro_batch_size * layout.batch.microbatches


def eval_batch_problems(spec: JobConfig, layout: Layout) -> List[str]:
    """eval.batch_tokens against the layout: whole micro-batches, and the step's shape under a pipeline."""
    e, t = spec.eval, spec.trainer
    if not e.tasks or e.batch_tokens < t.seq_len:  # 0: the step's shape; below one row: validate.py says so
        return []
    mbs = layout.batch.micro_batch_size
    train_rows = mbs * layout.batch.microbatches
    unit = t.seq_len * mbs
    if layout.mesh.pp > 1 and e.batch_tokens != train_rows * t.seq_len:
        return [f"eval.batch_tokens={e.batch_tokens}: under parallel.pp={layout.mesh.pp} evaluation runs the "
                f"pipeline's training shape, {train_rows} rows of {t.seq_len} tokens per data-parallel rank. "
                f"Fix: eval.batch_tokens=0 (or {train_rows * t.seq_len})."]
    if e.batch_tokens % unit:
        return [f"eval.batch_tokens={e.batch_tokens} is not a whole number of micro-batches (micro_batch_size "
                f"{mbs} x seq_len {t.seq_len} = {unit} tokens). Fix: eval.batch_tokens="
                f"{max(1, e.batch_tokens // unit) * unit}, or 0 for the training step's shape."]
    return []


def validate(spec: JobConfig) -> List[str]:
    """Every problem with `spec` (empty list: valid): config-level rules, then the resolver's."""
    return resolve_all(spec)[1]


def check(spec: JobConfig) -> Layout:
    """The Layout, or ConfigError with every problem (config-level and derived) at once.

    What a launch calls: the rules and the backend resolution run once.
    """
    layout, problems = resolve_all(spec)
    if problems or layout is None:
        raise ConfigError(problems)
    return layout
