"""The resolved layout: every decision derived from the config, made once and obeyed everywhere.

`launcher.plan.decide.resolve.resolve(spec)` is the only code that reads the parallel, offload,
precision, backend and cluster groups to derive the world size, the mesh degrees (dp_shard
inferred), gradient accumulation, the pipeline micro-batches and schedule, whether FSDP
wraps the model, and which backend and implementation owns each feature. It returns one
frozen `Layout`, written into plan.json under the key ``layout``. The estimators
(memory.py, perf.py), the report, the DeepSpeed config generator and both engines read it;
none derives a degree again.

The search (search.py) evaluates tens of thousands of layouts and cannot afford to build a
JobConfig for each: it builds cheap candidates with ``dataclasses.replace`` on a base Layout,
so every field has a default and the derived values are properties of the fields.

Sub-records: the mesh degrees and their sizes are `Layout.mesh` (plan/degrees.py's MeshPlan, their
only home), the per-rank batch `Layout.batch` (RankBatchPlan), the ZeRO stage, activation checkpointing
and offload `Layout.memory` (MemoryPlan), the precision and fp8 options `Layout.numerics`
(NumericsPlan), the backend owning each feature `Layout.owners` (BackendPlan; Layout.backends is
its per-feature table as a dict), the DeepSpeed knobs `Layout.deepspeed`, the node checks `Layout.resilience` (ResiliencePlan); plan.json
writes them flat (PLAN_KEY_ORDER). OVERRIDE_FIELDS is
the one map between a layout and the `train` overrides that select it.

Pure Python, no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from functools import reduce
from typing import Any, Dict, Literal, Tuple

from launcher.config.schema import Fp8Config
from launcher.plan.features import BackendChoice
from launcher.plan.degrees import MeshPlan

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]
Precision = Literal["fp32", "bf16", "fp8"]
ReduceDtype = Literal["fp32", "bf16"]
AcMode = Literal["none", "selective", "full"]
OffloadTarget = Literal["none", "cpu", "nvme"]
BackendName = Literal["native", "deepspeed"]
Fp8Impl = Literal["off", "torchao"]


# The one map between a layout and the `train` overrides that select it: (dotted override key,
# Layout field path). Layout.overrides() reads a layout through it; the search writes a
# candidate layout into a JobConfig through it (search.candidate_spec), and a resolve of that
# JobConfig gives the layout back (tests/test_plan_search.py holds the round trip).
OVERRIDE_FIELDS: Tuple[Tuple[str, str], ...] = (
    ("parallel.dp_replicate", "mesh.dp_replicate"),
    ("parallel.dp_shard", "mesh.dp_shard"),
    ("parallel.tp", "mesh.tp"),
    ("parallel.sp", "sp"),
    ("parallel.pp", "mesh.pp"),
    ("parallel.pp_schedule", "schedule"),
    ("parallel.pp_virtual_stages", "vpp"),
    ("parallel.cp", "mesh.cp"),
    ("parallel.ep", "mesh.ep"),
    ("parallel.zero_stage", "memory.zero_stage"),
    ("activation_checkpointing.mode", "memory.ac_mode"),
    ("trainer.micro_batch_size", "batch.micro_batch_size"),
)
# The node count: an override of its own only where the search varies it (plan.search_nodes).
NODES_OVERRIDE: Tuple[str, str] = ("cluster.nodes", "nodes")


@dataclass(frozen=True)
class DeepSpeedPlan:
    """The DeepSpeed-only knobs of a layout (its ZeRO buckets and ZeRO++), read by the DeepSpeed
    config generator and by the estimators when DeepSpeed owns the sharding."""

    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    zeropp_quantized_weights: bool = False
    zeropp_quantized_gradients: bool = False
    zeropp_hierarchical_partition: int = 0  # the backend.* key as given (0 = off)
    hpz_partition_size: int = 1  # DeepSpeed zero_hpz_partition_size (HSDP maps to hpZ groups of dp_shard)


@dataclass(frozen=True)
class RankBatchPlan:
    """The batch one data-parallel rank runs per optimizer step. `microbatches` is the gradient
    accumulation: micro-batches per step on each data-parallel rank; the pipeline runs exactly
    these micro-batches (Layout.pp_microbatches). The global sizes are Layout properties: they
    need the mesh's dp, and a record that held a copy of dp would be a second source of it."""

    micro_batch_size: int = 1
    microbatches: int = 1
    seq_len: int = 2048


@dataclass(frozen=True)
class MemoryPlan:
    """The memory knobs of a layout: ZeRO stage, activation checkpointing and offload, read by the
    estimators, the engines and the DeepSpeed config generator."""

    zero_stage: int = 3
    ac_mode: AcMode = "none"
    ac_selective: str = "op"  # op | N (every N-th block fully)
    offload_optimizer: OffloadTarget = "none"
    offload_params: OffloadTarget = "none"
    # offload.nvme_path and offload.pin_memory: DeepSpeed's offload section, FSDP2's CPUOffloadPolicy.
    offload_nvme_path: str = ""
    offload_pin_memory: bool = False
    # Native FSDP2 without pipelining, more than one micro-batch: parameters and gradients stay
    # unsharded from the first micro-batch to the last backward of the step, so FSDP all-gathers
    # and reduce-scatters once per step (parallel.accumulate_unsharded, resolved in resolve.py).
    accumulate_unsharded: bool = False


@dataclass(frozen=True)
class NumericsPlan:
    """How a layout computes: the training precision (its dtype name: fp32 | bf16 | fp8), the
    gradient-reduce dtype, TF32 and the fp8 options. The rank builds its precision and fp8 from
    these (not from the config): precision.tf32 (fp32 matmuls on TF32 tensor cores),
    precision.fp8.recipe (also the float8 casting work perf.py costs), emulate / min_features /
    exclude (which Linear layers torchao converts and whether it may emulate)."""

    precision: Precision = "bf16"
    reduce_dtype: ReduceDtype = "fp32"
    fp8_all_gather: bool = True
    fp8_recipe: str = "tensorwise"
    tf32: bool = True
    fp8_emulate: bool = False
    fp8_min_features: int = 16
    fp8_exclude: Tuple[str, ...] = ("output", "router")
    # optim.name: adamw | muon (Muon keeps one fp32 momentum buffer per matrix instead of AdamW's two
    # moments: launcher/plan/estimate/memory.py model_state_memory).
    optimizer: str = "adamw"
    # The parameters optim.groups (or optim=muon's defaults) give Muon, compact: rows (first block,
    # last block, kind, rows, cols, matrices per block) of launcher/plan/decide/optim_groups.py
    # muon_matrices; () when no parameter gets Muon. The estimates follow them (memory: one
    # momentum buffer each; time: Newton-Schulz and the gathers to the owners: estimate/muon.py).
    muon_matrices: Tuple[Tuple[int, int, str, int, int, int], ...] = ()
    muon_ns_steps: int = 5  # optim.muon.ns_steps


@dataclass(frozen=True)
class BackendPlan:
    """Who implements what: the backend that owns each feature and the per-feature record, as
    the resolver decided (resolve.backend_fields; the engines and the estimators obey it)."""

    sharding_backend: BackendName = "native"  # native (FSDP2) | deepspeed (ZeRO); owns the model states
    offload_backend: BackendName = "native"  # native (FSDP2 CPUOffloadPolicy) | deepspeed (ZeRO-Offload)
    pp_backend: BackendName = "native"
    ac_backend: BackendName = "native"  # torch checkpoint | deepspeed.checkpointing
    fp8_impl: Fp8Impl = "off"
    # Context parallelism's implementation (backend.cp_impl resolved: off | allgather | ring;
    # launcher/plan/decide/cp_choice.py says why).
    cp_impl: str = "off"
    # The per-feature record (feature, choice) in launcher.plan.features.FEATURES order.
    choices: Tuple[Tuple[str, BackendChoice], ...] = ()


@dataclass(frozen=True)
class ResiliencePlan:
    """The node checks a rank runs, decided once from trainer.health_check / trainer.straggler_action
    (their `auto` resolved by resolve.resilience_plan); the rank obeys these booleans."""

    health_check: bool = False  # run the pre-flight health check before building the model
    exclude_stragglers: bool = False  # end the attempt naming a straggler's node (else only warn)


# Sub-records plan.json writes flat (its keys predate the records), in PLAN_KEY_ORDER.
FLAT_RECORDS = {"mesh": MeshPlan, "batch": RankBatchPlan, "memory": MemoryPlan, "numerics": NumericsPlan,
                "owners": BackendPlan, "deepspeed": DeepSpeedPlan,
                "resilience": ResiliencePlan}
# plan.json's layout keys in their order (as written before the records; MemoryPlan's fields were
# spread over the flat Layout). to_dict writes these first, any newer key after them.
PLAN_KEY_ORDER: Tuple[str, ...] = (
    "nodes", "gpus_per_node", "pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "sp", "vpp", "schedule",
    "pp_layers", "micro_batch_size", "microbatches", "seq_len", "zero_stage", "ac_mode", "ac_selective",
    "precision", "reduce_dtype", "fp8_all_gather", "offload_optimizer", "offload_params", "sharding_backend",
    "offload_backend", "pp_backend", "ac_backend", "fp8_impl", "reduce_bucket_size", "allgather_bucket_size",
    "zeropp_quantized_weights", "zeropp_quantized_gradients", "zeropp_hierarchical_partition",
    "hpz_partition_size", "accumulate_unsharded", "choices", "compile", "fp8_recipe", "document_mask", "tf32",
    "fp8_emulate", "fp8_min_features", "fp8_exclude", "offload_nvme_path", "offload_pin_memory",
    "health_check", "exclude_stragglers", "optimizer", "cp_impl", "experts_folded",
)


@dataclass(frozen=True)
class Layout:
    # Cluster (world size = nodes * gpus_per_node, checked equal to the product of the degrees).
    nodes: int = 1
    gpus_per_node: int = 8
    # The mesh degrees pp, dp_replicate, dp_shard, cp, tp, ep and their derived sizes (world_size,
    # dp): the one record of them (launcher/plan/degrees.py, which also gives the rank order).
    mesh: MeshPlan = field(default_factory=MeshPlan)
    sp: bool = False
    vpp: int = 1  # model chunks per pipeline rank
    schedule: Schedule = "1f1b"
    pp_layers: Tuple[int, ...] = ()
    # The per-rank batch (RankBatchPlan); its global sizes are the properties below (they need the mesh).
    batch: RankBatchPlan = field(default_factory=RankBatchPlan)
    # The memory knobs: ZeRO stage, activation checkpointing, offload (MemoryPlan).
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    # Precision, gradient-reduce dtype, TF32 and the fp8 options (NumericsPlan).
    numerics: NumericsPlan = field(default_factory=NumericsPlan)
    # Who implements what (the resolver's decision; BackendPlan).
    owners: BackendPlan = field(default_factory=BackendPlan)
    deepspeed: DeepSpeedPlan = field(default_factory=DeepSpeedPlan)
    # The node checks the ranks run: health check, straggler exclusion (ResiliencePlan).
    resilience: ResiliencePlan = field(default_factory=ResiliencePlan)
    # Speed-only knobs the planner costs (launcher/plan/estimate/perf.py): trainer.compile fuses each block's
    # elementwise ops; precision.fp8.recipe sets the float8 casting work.
    compile: bool = False
    # data.document_masking: how the runtime applies the block-causal mask (launcher/models/layers.py
    # document_attention_mask), which the planner costs: "none" (plain causal attention), "sdpa"
    # (CPU: SDPA with one [micro_batch, 1, s, s] mask per micro-batch), "flex" (CUDA: FlexAttention's
    # block mask, a few int32 per 128x128 block).
    document_mask: str = "none"
    # plan.moe_imbalance: the busiest expert-parallel rank's routed assignments over the mean (1 =
    # balanced), which scales that rank's expert GEMMs and all-to-all (launcher/plan/estimate/perf.py).
    moe_imbalance: float = 1.0
    # MoE under tensor parallelism: each TP rank routes only its own 1/tp of the tokens and the routed
    # experts are spread over ep ranks taken from dp_shard * cp * tp (docs/parallelism.md, "Expert
    # folding"); False: no MoE block meets TP. Decided by resolve.build_layout.
    experts_folded: bool = False

    # ------------------------------------------------------------------ derived, one formula each
    @property
    def global_batch_size(self) -> int:
        return self.batch.micro_batch_size * self.batch.microbatches * self.mesh.dp

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.batch.seq_len

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one micro-batch of one data-parallel rank, over all its context-parallel ranks."""
        return self.batch.micro_batch_size * self.batch.seq_len

    @property
    def rank_microbatch_tokens(self) -> float:
        """Tokens of one micro-batch that one GPU holds: context parallelism splits the sequence."""
        return self.microbatch_tokens / self.mesh.cp

    @property
    def pp_microbatches(self) -> int:
        """Pipeline micro-batches per step: THE rule (docs/parallelism.md) is that the schedule runs
        the gradient-accumulation micro-batches, each of trainer.micro_batch_size sequences."""
        return self.batch.microbatches

    @property
    def uses_deepspeed(self) -> bool:
        return self.owners.sharding_backend == "deepspeed"

    @property
    def offload_to_cpu(self) -> bool:
        return "cpu" in (self.memory.offload_optimizer, self.memory.offload_params)

    @property
    def fsdp_wraps(self) -> bool:
        """Whether native FSDP2 wraps the model: more than one sharding rank, or a single one
        that offloads to the CPU (FSDP2's CPUOffloadPolicy is what moves the states)."""
        if self.owners.sharding_backend != "native":
            return False
        return self.mesh.dp * self.mesh.cp > 1 or self.offload_to_cpu

    @property
    def fsdp_holds_unsharded(self) -> bool:
        """Whether FSDP2 keeps every unit unsharded, gradients unreduced, across the step's
        micro-batches: under torch's pipeline schedules (they do it themselves) or with
        accumulate_unsharded. Then it all-gathers and reduce-scatters once per step. Only when
        FSDP2 wraps the model: a pipeline without a sharding rank has no unsharded copy to hold."""
        if not self.fsdp_wraps or not self.memory.zero_stage:
            return False
        return self.mesh.pp > 1 or self.memory.accumulate_unsharded

    @property
    def act_bytes(self) -> int:
        """Bytes per activation element: fp8 training keeps bf16 activations between layers."""
        return 4 if self.numerics.precision == "fp32" else 2

    @property
    def fsdp_degree(self) -> int:
        """Ranks one parameter is sharded over (ZeRO partition size) for non-expert parameters.

        Native FSDP2 shards over dp_shard * cp and replicates over dp_replicate (HSDP);
        DeepSpeed partitions over every data-parallel rank (its ZeRO group is the whole DP group).
        """
        if self.memory.zero_stage == 0:
            return 1
        n = self.mesh.dp_shard * self.mesh.cp
        if self.owners.sharding_backend == "deepspeed":
            n *= self.mesh.dp_replicate
        return n

    @property
    def expert_ranks(self) -> int:
        """Ranks the expert-parallel groups are carved from: dp_shard * cp, times tp when the experts
        are folded over TP (launcher/parallel/device_mesh.py expert_meshes)."""
        return self.mesh.dp_shard * self.mesh.cp * (self.mesh.tp if self.experts_folded else 1)

    @property
    def moe_token_split(self) -> int:
        """Ranks over which one micro-batch's MoE tokens are divided: cp, times tp with folded experts
        (each TP rank routes its own slice; replicated, every TP rank routes them all)."""
        return self.mesh.cp * (self.mesh.tp if self.experts_folded else 1)

    @property
    def moe_tokens_per_rank(self) -> float:
        """Tokens one rank routes (and runs the router and shared experts on) per micro-batch."""
        return self.microbatch_tokens / self.moe_token_split

    @property
    def expert_fsdp_degree(self) -> int:
        """Expert weights are split over ep first; the remaining sharding ranks shard each expert
        (with folded experts the TP ranks are among them)."""
        if not self.memory.zero_stage:
            return 1
        n = self.fsdp_degree * (self.mesh.tp if self.experts_folded else 1)
        return max(1, n // self.mesh.ep)

    def fp8_config(self) -> Fp8Config:
        """The torchao conversion options (launcher/parallel/fp8.py) this layout resolved."""
        n = self.numerics
        return Fp8Config(recipe=n.fp8_recipe, emulate=n.fp8_emulate, all_gather=n.fp8_all_gather,
                         min_features=n.fp8_min_features, exclude=list(n.fp8_exclude))

    @property
    def backends(self) -> Dict[str, BackendChoice]:
        """feature -> BackendChoice (the plan's backend table)."""
        return dict(self.owners.choices)

    def value_at(self, path: str) -> Any:
        """The value at a field path of OVERRIDE_FIELDS ("mesh.tp", "sp", ...)."""
        return reduce(getattr, path.split("."), self)

    def overrides(self) -> Dict[str, Any]:
        """The `train` overrides that select this layout (dotted key -> value), read through
        OVERRIDE_FIELDS."""
        return {key: self.value_at(path) for key, path in OVERRIDE_FIELDS}

    # ------------------------------------------------------------------ plan.json
    def to_dict(self) -> Dict[str, Any]:
        """plan.json's ``layout``: the fields plus the derived values the runtime checks against.

        The FLAT_RECORDS (mesh, batch, memory, numerics, owners, DeepSpeed knobs) are written flat, in PLAN_KEY_ORDER
        (plan.json's keys predate the records)."""
        flat: Dict[str, Any] = {}
        for f in fields(self):
            if f.name in FLAT_RECORDS:
                flat.update(asdict(getattr(self, f.name)))
            else:
                flat[f.name] = getattr(self, f.name)
        d = {k: flat.pop(k) for k in PLAN_KEY_ORDER if k in flat}
        d.update(flat)
        d["pp_layers"] = list(self.pp_layers)
        d["fp8_exclude"] = list(self.numerics.fp8_exclude)
        d["muon_matrices"] = [list(row) for row in self.numerics.muon_matrices]
        d["choices"] = {name: asdict(c) for name, c in self.owners.choices}
        d["derived"] = {
            "world_size": self.mesh.world_size,
            "dp": self.mesh.dp,
            "global_batch_size": self.global_batch_size,
            "pp_microbatches": self.pp_microbatches,
            "fsdp_wraps": self.fsdp_wraps,
            "fsdp_holds_unsharded": self.fsdp_holds_unsharded,
        }
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "Layout":
        d = {k: v for k, v in d.items() if k != "derived"}
        d["choices"] = tuple((name, BackendChoice(**c)) for name, c in d.get("choices", {}).items())
        if "fp8_exclude" in d:
            d["fp8_exclude"] = tuple(d["fp8_exclude"])
        if "muon_matrices" in d:
            d["muon_matrices"] = tuple(tuple(row) for row in d["muon_matrices"])
        for name, record in FLAT_RECORDS.items():
            d[name] = record(**{f.name: d.pop(f.name) for f in fields(record) if f.name in d})
        d["pp_layers"] = tuple(d.get("pp_layers", ()))
        return cls(**d)


def accumulate_unsharded_blocker(lay: Layout) -> str:
    """Why FSDP2 cannot hold the step unsharded in this layout ("" when it can)."""
    if lay.batch.microbatches < 2:
        return "one micro-batch per step: nothing to accumulate"
    if lay.uses_deepspeed:
        return "DeepSpeed owns the sharding and accumulates gradients its own way"
    if lay.mesh.pp > 1:
        return ("torch's pipeline schedules already keep FSDP2 units unsharded and skip the "
                "gradient sync until the last backward of the step")
    if not lay.fsdp_wraps:
        return "FSDP2 does not wrap the model (a single data-parallel rank)"
    if lay.offload_to_cpu:
        return "offload to the CPU: holding unsharded states on the GPU would defeat it"
    return ""
