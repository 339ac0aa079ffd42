"""Backend resolver: which implementation (native PyTorch or DeepSpeed) serves each feature.

Decided once here and recorded in the Plan; the runtime obeys it and never re-decides.
Pure Python (no torch import) so that ``action=plan`` stays instant.

The one fact that shapes every rule: a single engine owns the model states. Either the
native stack (FSDP2 / DTensor / torch pipelining) wraps the model, or DeepSpeed's engine
does (``deepspeed.initialize``); the two cannot share a parameter. So the model-state
features (sharding, HSDP, offload, ZeRO++, mixed precision, checkpoint format, pipeline)
all ride with one owner, and the DTensor features (TP, CP, EP) and FP8 module swaps exist
only natively. The resolver therefore

1. works out, per active feature, which backends can serve it for this config and
   which one the user forced (``backend=...`` globally, ``backend.<feature>=...``);
2. intersects those sets to pick the owner: native where it serves, DeepSpeed when a
   requested feature exists only there or the user asked for it;
3. reports every conflict at once (one line each: both features, why, the fixes).

``python -m launcher.plan.backends --markdown`` renders the feature x backend matrix
(docs/backends.md) from the tables below: the docs cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from launcher.config.errors import ConfigError

NATIVE = "native"
DEEPSPEED = "deepspeed"
BACKENDS = (NATIVE, DEEPSPEED)
PREFERENCES = ("auto", NATIVE, DEEPSPEED)
FP8_IMPLS = ("auto", "torchao", "transformer_engine")


@dataclass
class BackendChoice:
    backend: str  # native | deepspeed
    impl: str  # e.g. "FSDP2 fully_shard", "DeepSpeed ZeRO-3"; "off" when the feature is not used
    reason: str


@dataclass(frozen=True)
class Feature:
    """One row of the feature x backend matrix."""

    name: str  # key in Plan.backends
    title: str
    switches: str  # config keys that turn it on
    override: str  # BackendConfig field that forces its backend
    native: str  # native implementation ("" = none)
    deepspeed: str  # DeepSpeed implementation ("" = none)
    notes: str
    coupled: bool = True  # must be served by the model-state owner


FEATURES: Tuple[Feature, ...] = (
    Feature(
        "sharding", "Data-parallel sharding (ZeRO 0-3)", "parallel.zero_stage", "sharding",
        "stage 2: FSDP2 `fully_shard(reshard_after_forward=False)`; stage 3: FSDP2 `fully_shard` "
        "(reshard after forward)",
        "`zero_optimization.stage` 0-3 in `deepspeed.initialize`",
        "ZeRO-1 (optimizer states only) exists only in DeepSpeed; ZeRO-0 (plain data parallel) runs on "
        "DeepSpeed because the native path implements FSDP2 only (parallel.zero_stage=2 is the closest native "
        "choice); with a single data-parallel rank every stage is served natively",
    ),
    Feature(
        "hsdp", "HSDP / hierarchical partitioning", "parallel.dp_replicate > 1", "sharding",
        "FSDP2 on a 2-D (dp_replicate, dp_shard) mesh: shard inside a group, replicate across",
        "ZeRO-3 only: ZeRO++ hpZ (`zero_hpz_partition_size` = dp_shard), a secondary parameter "
        "partition inside each group; optimizer states stay sharded over all dp ranks",
        "DeepSpeed ZeRO-1/2 have no replicate groups",
    ),
    Feature(
        "offload_optimizer", "Optimizer-state offload", "offload.optimizer=cpu|nvme", "offload",
        "cpu only: FSDP2 `CPUOffloadPolicy` - it moves parameters, gradients and optimizer state "
        "to the CPU together (the optimizer step runs on the CPU); needs zero_stage 2/3",
        "ZeRO-Offload `offload_optimizer` device cpu (stage 1-3) or nvme (ZeRO-Infinity, stage 3)",
        "NVMe offload exists only in DeepSpeed; optimizer-only offload (params stay on the GPU) "
        "only in DeepSpeed",
    ),
    Feature(
        "offload_params", "Parameter offload", "offload.params=cpu|nvme", "offload",
        "cpu only: FSDP2 `CPUOffloadPolicy` (parameters, gradients and optimizer state together)",
        "`offload_param` device cpu or nvme, ZeRO-3 only",
        "NVMe offload exists only in DeepSpeed",
    ),
    Feature(
        "zeropp", "ZeRO++ quantized communication / hpZ",
        "backend.zeropp_quantized_weights, backend.zeropp_quantized_gradients, "
        "backend.zeropp_hierarchical_partition", "sharding",
        "",
        "`zero_quantized_weights` (qwZ), `zero_quantized_gradients` (qgZ), "
        "`zero_hpz_partition_size` (hpZ); ZeRO-3 only",
        "DeepSpeed only",
    ),
    Feature(
        "precision", "BF16 mixed precision", "precision.name=bf16|fp32|fp8", "precision",
        "FSDP2 `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=precision.reduce_dtype)`, "
        "fp32 master weights",
        "`bf16.enabled` (bf16 params and grads, fp32 master weights in the ZeRO optimizer), "
        "`communication_data_type` from precision.reduce_dtype",
        "DeepSpeed bf16 at ZeRO stage 0 drifts (no fp32 master copy); prefer stage >= 1",
    ),
    Feature(
        "fp8", "FP8 training", "precision.name=fp8", "precision",
        "torchao `convert_to_float8_training` (float8 all-gather with FSDP2), or Transformer "
        "Engine when installed and `backend.fp8_impl=transformer_engine`",
        "",
        "refused with DeepSpeed: FP8 is a module swap that this launcher applies only on the "
        "native path",
    ),
    Feature(
        "activation_checkpointing", "Activation checkpointing",
        "activation_checkpointing.mode=selective|full", "activation_checkpointing",
        "`checkpoint_wrapper` per block (full), op-level selective (save matmuls), or every N-th block",
        "`deepspeed.checkpointing.checkpoint` per block (full or every N-th block) configured by the "
        "`activation_checkpointing` section; the pipeline engine uses `activation_checkpoint_interval`",
        "native torch checkpointing may run inside the DeepSpeed engine "
        "(`backend.activation_checkpointing=native`); op-level selective is native only",
        coupled=False,
    ),
    Feature(
        "tp", "Tensor (+ sequence) parallel", "parallel.tp > 1, parallel.sp", "tp",
        "DTensor `parallelize_module` (Colwise/Rowwise, SequenceParallel, loss parallel)",
        "",
        "the DeepSpeed engine cannot wrap DTensor parameters",
    ),
    Feature(
        "pp", "Pipeline parallel", "parallel.pp > 1", "pp",
        "`torch.distributed.pipelining` (all schedules in parallel.pp_schedule), composes with FSDP2",
        "`PipelineModule` + `PipelineEngine` (1F1B schedule), ZeRO <= 1 only",
        "DeepSpeed's pipeline engine refuses ZeRO 2/3, interleaved / zero-bubble schedules and "
        "explicit parallel.pp_layers",
    ),
    Feature(
        "ep", "Expert parallel", "parallel.ep > 1", "ep",
        "all-to-all token dispatch over the ep ranks of the mesh",
        "",
        "the launcher's MoE layers are native modules; DeepSpeed-MoE layers are not wired",
    ),
    Feature(
        "cp", "Context parallel", "parallel.cp > 1", "cp",
        "`torch.distributed.tensor.experimental.context_parallel` (ring attention; GPU only)",
        "",
        "DeepSpeed-Ulysses needs its own attention wrapper, not wired here",
    ),
    Feature(
        "checkpoint", "Checkpoint format", "checkpoint.*", "checkpoint",
        "torch.distributed.checkpoint (DCP), reshardable across world sizes",
        "`engine.save_checkpoint` / `load_checkpoint` (ZeRO partitioned files); "
        "consolidation with `zero_to_fp32`",
        "both export a consolidated fp32 / safetensors model",
    ),
)
FEATURE_BY_NAME: Dict[str, Feature] = {f.name: f for f in FEATURES}


def _label(backend: str) -> str:
    return "DeepSpeed" if backend == DEEPSPEED else "native"


# --------------------------------------------------------------------------- reading the spec


def _get(obj, dotted: str, default=None):
    """Attribute access that works on dataclasses and DictConfigs alike."""
    for part in dotted.split("."):
        if obj is None:
            return default
        obj = getattr(obj, part, None)
    return default if obj is None else obj


@dataclass
class _Switches:
    """The config values the resolver reads, in one place."""

    zero: int
    dp_replicate: int
    dp: Optional[int]  # data-parallel size (None when the degrees do not fit the world size)
    dp_shard: Optional[int]
    tp: int
    sp: bool
    pp: int
    pp_schedule: str
    pp_virtual_stages: int
    pp_layers: List[int]
    cp: int
    ep: int
    offload_optimizer: str
    offload_params: str
    precision: str
    ac_mode: str
    ac_selective: str
    qw: bool
    qg: bool
    hpz: int
    fp8_impl: str

    @classmethod
    def read(cls, spec) -> "_Switches":
        p = _get(spec, "parallel")
        world = int(_get(spec, "cluster.nodes", 1)) * int(_get(spec, "cluster.gpus_per_node", 1))
        pp, rep, cp, tp = (int(_get(p, k, 1)) for k in ("pp", "dp_replicate", "cp", "tp"))
        shard = int(_get(p, "dp_shard", -1))
        fixed = pp * rep * cp * tp
        if shard == -1 and fixed > 0 and world % fixed == 0:
            shard = world // fixed
        dp = rep * shard if shard > 0 else None
        return cls(
            zero=int(_get(p, "zero_stage", 3)),
            dp_replicate=rep,
            dp=dp,
            dp_shard=shard if shard > 0 else None,
            tp=tp,
            sp=bool(_get(p, "sp", False)),
            pp=pp,
            pp_schedule=str(_get(p, "pp_schedule", "1f1b")),
            pp_virtual_stages=int(_get(p, "pp_virtual_stages", 1)),
            pp_layers=list(_get(p, "pp_layers", []) or []),
            cp=cp,
            ep=int(_get(p, "ep", 1)),
            offload_optimizer=str(_get(spec, "offload.optimizer", "none")),
            offload_params=str(_get(spec, "offload.params", "none")),
            precision=str(_get(spec, "precision.name", "bf16")),
            ac_mode=str(_get(spec, "activation_checkpointing.mode", "none")),
            ac_selective=str(_get(spec, "activation_checkpointing.selective", "op")),
            qw=bool(_get(spec, "backend.zeropp_quantized_weights", False)),
            qg=bool(_get(spec, "backend.zeropp_quantized_gradients", False)),
            hpz=int(_get(spec, "backend.zeropp_hierarchical_partition", 0)),
            fp8_impl=str(_get(spec, "backend.fp8_impl", "auto")),
        )


# --------------------------------------------------------------------------- per-feature support


@dataclass
class _Need:
    """What one active feature asks of the owner."""

    feature: str
    what: str  # the switch that turns it on, e.g. "parallel.zero_stage=1"
    # backend -> None (can serve) or why it cannot
    blocked: Dict[str, Optional[str]] = field(default_factory=dict)
    fixes: List[str] = field(default_factory=list)  # ways to drop this feature's demand
    unblock: Dict[str, List[str]] = field(default_factory=dict)  # backend -> changes that let it serve
    forced: Optional[str] = None  # backend the user forced for this feature
    forced_by: str = ""  # the key that forced it

    def allowed(self) -> Set[str]:
        ok = {b for b in BACKENDS if self.blocked.get(b) is None}
        return ok & {self.forced} if self.forced else ok


def _ac_deepspeed_blocker(s: _Switches) -> Optional[str]:
    if s.ac_mode == "selective" and not s.ac_selective.isdigit():
        return ("DeepSpeed checkpointing has no op-level selective mode "
                f"(activation_checkpointing.selective={s.ac_selective})")
    return None


def _needs(s: _Switches) -> List[_Need]:
    """Every active feature with the backends that can serve it for these switches."""
    needs: List[_Need] = []
    z = s.zero

    # Sharding is always active: someone owns the model states.
    sharding = _Need("sharding", f"parallel.zero_stage={z}")
    shards = s.dp is None or s.dp * s.cp > 1  # with one data-parallel rank every stage is the same
    if z in (0, 1) and shards:
        sharding.blocked[NATIVE] = (
            "ZeRO-1 (optimizer-state sharding only) exists only in DeepSpeed; FSDP2 always shards gradients too"
            if z == 1 else
            "the native path implements FSDP2 (ZeRO-2/3) only; plain data parallel (ZeRO-0) runs on DeepSpeed")
        sharding.fixes = ["parallel.zero_stage=2 (FSDP2, params kept unsharded between forward and backward)"]
        sharding.unblock[NATIVE] = sharding.fixes
    needs.append(sharding)

    if s.dp_replicate > 1 and z > 0:
        n = _Need("hsdp", f"parallel.dp_replicate={s.dp_replicate}")
        if z != 3:
            n.blocked[DEEPSPEED] = f"DeepSpeed ZeRO-{z} has no replicate groups (hpZ needs ZeRO-3)"
            n.unblock[DEEPSPEED] = ["parallel.zero_stage=3"]
        n.fixes = ["parallel.dp_replicate=1 (shard over every data-parallel rank)"]
        needs.append(n)

    for kind, value in (("optimizer", s.offload_optimizer), ("params", s.offload_params)):
        if value == "none":
            continue
        n = _Need(f"offload_{kind}", f"offload.{kind}={value}")
        if value == "nvme":
            n.blocked[NATIVE] = "NVMe offload exists only in DeepSpeed (ZeRO-Infinity)"
            if z != 3:
                n.blocked[DEEPSPEED] = f"DeepSpeed NVMe offload needs parallel.zero_stage=3, got {z}"
            n.fixes = [f"offload.{kind}=cpu", f"offload.{kind}=none"]
        else:
            if z not in (2, 3):
                n.blocked[NATIVE] = f"FSDP2 CPUOffloadPolicy needs a sharded model (parallel.zero_stage 2 or 3), got {z}"
            if kind == "params" and z != 3:
                n.blocked[DEEPSPEED] = f"DeepSpeed offload_param needs parallel.zero_stage=3, got {z}"
            if kind == "optimizer" and z == 0:
                n.blocked[DEEPSPEED] = "ZeRO-Offload needs parallel.zero_stage >= 1"
            n.fixes = [f"offload.{kind}=none"]
        needs.append(n)

    zpp = [k for k, on in (("zeropp_quantized_weights", s.qw), ("zeropp_quantized_gradients", s.qg),
                           ("zeropp_hierarchical_partition", s.hpz > 0)) if on]
    if zpp:
        n = _Need("zeropp", ", ".join(f"backend.{k}" for k in zpp))
        n.blocked[NATIVE] = "ZeRO++ quantized / hierarchical communication exists only in DeepSpeed"
        if z != 3:
            n.blocked[DEEPSPEED] = f"ZeRO++ needs parallel.zero_stage=3, got {z}"
        n.fixes = [f"backend.{k}={'0' if k.endswith('partition') else 'false'}" for k in zpp]
        needs.append(n)

    needs.append(_Need("precision", f"precision.name={s.precision}"))
    if s.precision == "fp8":
        n = _Need("fp8", "precision.name=fp8")
        n.blocked[DEEPSPEED] = "FP8 is a native module swap (torchao / Transformer Engine); the DeepSpeed path refuses it"
        n.fixes = ["precision=bf16"]
        needs.append(n)

    if s.ac_mode != "none":
        n = _Need("activation_checkpointing", f"activation_checkpointing.mode={s.ac_mode}")
        n.blocked[DEEPSPEED] = _ac_deepspeed_blocker(s)
        n.unblock[DEEPSPEED] = ["activation_checkpointing.mode=full", "activation_checkpointing.selective=1 (every block)"]
        needs.append(n)

    for name, degree, why in (
        ("tp", s.tp, "tensor parallelism is native DTensor only; the DeepSpeed engine cannot wrap DTensor parameters"),
        ("ep", s.ep, "expert parallelism is implemented by the launcher's native MoE layers only"),
        ("cp", s.cp, "context parallelism is native only (DeepSpeed-Ulysses is not wired)"),
    ):
        if degree > 1:
            n = _Need(name, f"parallel.{name}={degree}")
            n.blocked[DEEPSPEED] = why
            n.fixes = [f"parallel.{name}=1"]
            needs.append(n)

    if s.pp > 1:
        n = _Need("pp", f"parallel.pp={s.pp}")
        ds_why = []
        if z > 1:
            ds_why.append(f"DeepSpeed's pipeline engine refuses ZeRO-{z} (needs zero_stage <= 1)")
        if s.pp_schedule != "1f1b":
            ds_why.append(f"DeepSpeed's pipeline engine runs only 1F1B (parallel.pp_schedule={s.pp_schedule})")
        if s.pp_virtual_stages != 1:
            ds_why.append(f"DeepSpeed's pipeline engine has no virtual stages (parallel.pp_virtual_stages={s.pp_virtual_stages})")
        if s.pp_layers:
            ds_why.append("DeepSpeed's pipeline engine partitions layers itself (parallel.pp_layers must be [])")
        n.blocked[DEEPSPEED] = "; ".join(ds_why) or None
        n.unblock[DEEPSPEED] = ([f"parallel.zero_stage={min(z, 1)}"] if z > 1 else []) + (
            ["parallel.pp_schedule=1f1b"] if s.pp_schedule != "1f1b" else []) + (
            ["parallel.pp_virtual_stages=1"] if s.pp_virtual_stages != 1 else []) + (
            ["parallel.pp_layers=[]"] if s.pp_layers else [])
        if n.unblock[DEEPSPEED]:
            n.unblock[DEEPSPEED] = [" ".join(n.unblock[DEEPSPEED])]
        n.fixes = ["parallel.pp=1"]
        needs.append(n)

    needs.append(_Need("checkpoint", "checkpoint format"))
    return needs


# --------------------------------------------------------------------------- the resolver


def _preferences(spec, needs: List[_Need], problems: List[str]) -> str:
    """Apply backend=... and backend.<feature>=... to the needs; returns the global default."""
    default = str(_get(spec, "backend.default", "auto") or "auto")
    if default not in PREFERENCES:
        problems.append(f"backend={default} is not one of {', '.join(PREFERENCES)}. Fix: backend=auto.")
        default = "auto"
    bad_keys = set()
    for key in dict.fromkeys(f.override for f in FEATURES):
        value = str(_get(spec, f"backend.{key}", "") or "")
        if value and value not in PREFERENCES:
            problems.append(f"backend.{key}={value} is not one of {', '.join(PREFERENCES)} (or empty). Fix: backend.{key}=auto.")
            bad_keys.add(key)
    for need in needs:
        key = FEATURE_BY_NAME[need.feature].override
        value = str(_get(spec, f"backend.{key}", "") or "")
        if key in bad_keys:
            value = ""
        if value in BACKENDS:
            need.forced, need.forced_by = value, f"backend.{key}={value}"
        elif not value and default in BACKENDS:
            need.forced, need.forced_by = default, f"backend={default}"
    # A per-feature key is more specific than the global default: when one pins a model-state
    # feature to the other backend, the features the default alone forced follow that owner
    # (`backend=native backend.sharding=deepspeed` means "DeepSpeed owns the model states").
    explicit = {n.forced for n in needs if n.forced_by.startswith("backend.") and FEATURE_BY_NAME[n.feature].coupled}
    if default in BACKENDS and explicit == {_other(default)}:
        for need in needs:
            if need.forced_by == f"backend={default}":
                need.forced, need.forced_by = None, ""
    return default


def _fix_text(fixes: List[str]) -> str:
    return " or ".join(dict.fromkeys(fixes))


def _self_conflicts(needs: List[_Need], zero: int, problems: List[str]) -> None:
    """A feature that no backend can serve, or that the user forced onto one that cannot."""
    for n in needs:
        ok = {b for b in BACKENDS if n.blocked.get(b) is None}
        if not ok:
            reasons = "; ".join(f"{_label(b)}: {n.blocked[b]}" for b in BACKENDS)
            problems.append(
                f"{n.feature} vs sharding: {n.what} cannot run at parallel.zero_stage={zero} ({reasons}). "
                f"Fix: {_fix_text(_stage_fixes(n) + n.fixes)}."
            )
        elif n.forced and n.forced not in ok:
            other = next(iter(ok))
            key = FEATURE_BY_NAME[n.feature].override
            if n.forced_by.startswith("backend="):
                fixes = ["backend=auto" if FEATURE_BY_NAME[n.feature].coupled else f"backend.{key}={other}"]
            else:
                fixes = [f"backend.{key}={other} (or drop {n.forced_by})"]
            fixes = n.unblock.get(n.forced, []) + fixes + n.fixes
            problems.append(f"{n.feature} vs backend: {n.what} with {n.forced_by}: {n.blocked[n.forced]}. Fix: {_fix_text(fixes)}.")


def _stage_fixes(n: _Need) -> List[str]:
    text = " ".join(str(v) for v in n.blocked.values() if v)
    if "zero_stage=3" in text or "ZeRO-3" in text:
        return ["parallel.zero_stage=3"]
    if "2 or 3" in text or ">= 1" in text:
        return ["parallel.zero_stage=2"]
    return []


def _pair_conflicts(needs: List[_Need], problems: List[str]) -> None:
    """Features that each can run, but not on the same owner."""
    coupled = [n for n in needs if FEATURE_BY_NAME[n.feature].coupled or n.forced == DEEPSPEED]
    for i, a in enumerate(coupled):
        for b in coupled[i + 1:]:
            sa, sb = a.allowed(), b.allowed()
            if not sa or not sb or sa & sb:
                continue
            problems.append(
                f"{a.feature} vs {b.feature}: {a.feature} needs {_label(next(iter(sa)))} ({_why_only(a, sa)}) "
                f"but {b.feature} needs {_label(next(iter(sb)))} ({_why_only(b, sb)}); one engine owns the model "
                f"states, so they cannot be mixed. Fix: {_fix_text(_drop(a))}, or {_fix_text(_drop(b))}."
            )


def _why_only(n: _Need, allowed: Set[str]) -> str:
    if n.forced and n.forced_by:
        other = DEEPSPEED if n.forced == NATIVE else NATIVE
        if n.blocked.get(other) is None:
            return f"{n.forced_by} requested"
    other = DEEPSPEED if NATIVE in allowed else NATIVE
    return f"{n.what}: {n.blocked.get(other)}"


def _drop(n: _Need) -> List[str]:
    """Ways to lift a feature's single-backend demand."""
    other = DEEPSPEED if n.forced == NATIVE else NATIVE
    if n.forced and n.blocked.get(other) is None:
        if n.forced_by.startswith("backend="):
            return ["backend=auto"]
        return [f"drop {n.forced_by}"]
    return n.fixes or ["change " + n.what]


def _owner(needs: List[_Need], default: str) -> Tuple[str, str]:
    """The model-state owner and the reason. Call only when there are no conflicts."""
    coupled = [n for n in needs if FEATURE_BY_NAME[n.feature].coupled or n.forced == DEEPSPEED]
    allowed = set(BACKENDS)
    for n in coupled:
        allowed &= n.allowed()
    if allowed == {NATIVE, DEEPSPEED}:
        return NATIVE, "native where it serves (backend=auto)"
    owner = next(iter(allowed))
    drivers = [n for n in coupled if n.allowed() == {owner}]
    forced = sorted({n.forced_by for n in drivers if n.forced == owner and n.blocked.get(_other(owner)) is None})
    only = [f"{n.what} ({n.blocked[_other(owner)]})" for n in drivers if n.blocked.get(_other(owner))]
    parts = []
    if forced:
        parts.append(", ".join(forced) + " requested")
    if only:
        parts.append("; ".join(only))
    return owner, "; ".join(parts) or "native where it serves (backend=auto)"


def _other(backend: str) -> str:
    return NATIVE if backend == DEEPSPEED else DEEPSPEED


def resolve_backends(spec) -> Dict[str, BackendChoice]:
    """Per-feature backend decision for a validated spec.

    Returns one BackendChoice per feature in FEATURES (impl "off" for features not in use).
    Raises ConfigError with one line per conflict (both features, why, fixes).
    """
    s = _Switches.read(spec)
    problems: List[str] = []
    needs = _needs(s)
    default = _preferences(spec, needs, problems)
    _self_conflicts(needs, s.zero, problems)
    if not problems:
        _pair_conflicts(needs, problems)
    _detail_conflicts(s, problems)
    if problems:
        raise ConfigError(problems)
    owner, why = _owner(needs, default)
    return _choices(s, needs, owner, why)


def _detail_conflicts(s: _Switches, problems: List[str]) -> None:
    """Value-level rules that are not about which backend owns the model."""
    if s.fp8_impl not in FP8_IMPLS:
        problems.append(f"backend.fp8_impl={s.fp8_impl} is not one of {', '.join(FP8_IMPLS)}. Fix: backend.fp8_impl=auto.")
    elif s.precision == "fp8" and s.fp8_impl == "transformer_engine" and not transformer_engine_available():
        problems.append(
            "fp8 vs backend.fp8_impl: backend.fp8_impl=transformer_engine but transformer_engine is not importable here. "
            "Fix: pip install transformer_engine[pytorch] on every node, or backend.fp8_impl=torchao."
        )
    if s.hpz > 0 and s.dp and s.dp % s.hpz:
        problems.append(
            f"zeropp vs sharding: backend.zeropp_hierarchical_partition={s.hpz} must divide the data-parallel size {s.dp}. "
            f"Fix: a divisor of {s.dp} such as the GPUs per node."
        )
    if s.hpz > 0 and s.dp_replicate > 1 and s.dp_shard and s.hpz != s.dp_shard:
        problems.append(
            f"zeropp vs hsdp: parallel.dp_replicate={s.dp_replicate} maps to hpZ groups of dp_shard={s.dp_shard} "
            f"but backend.zeropp_hierarchical_partition={s.hpz}. Fix: backend.zeropp_hierarchical_partition={s.dp_shard} "
            f"or 0, or parallel.dp_replicate=1."
        )


def transformer_engine_available() -> bool:
    """True when Transformer Engine can be imported (checked without importing it or torch)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------- impl strings


def _choices(s: _Switches, needs: List[_Need], owner: str, why: str) -> Dict[str, BackendChoice]:
    active = {n.feature: n for n in needs}
    ds = owner == DEEPSPEED
    rides = f"rides with sharding ({_label(owner)} owns the model states)"
    out: Dict[str, BackendChoice] = {}

    z = s.zero
    if ds:
        impl = f"DeepSpeed ZeRO-{z}"
    elif z in (0, 1):
        impl = "none (one data-parallel rank: nothing to shard)"
    else:
        impl = f"FSDP2 fully_shard (zero_stage={z}, reshard_after_forward={z == 3})"
    out["sharding"] = BackendChoice(owner, impl, why)

    def off(name: str, reason: str, backend: str = owner) -> None:
        out[name] = BackendChoice(backend, "off", reason)

    if "hsdp" in active:
        impl = (f"ZeRO++ hpZ (zero_hpz_partition_size={s.dp_shard})" if ds
                else f"FSDP2 HSDP mesh (dp_replicate={s.dp_replicate}, dp_shard={s.dp_shard})")
        out["hsdp"] = BackendChoice(owner, impl, rides)
    else:
        off("hsdp", "parallel.dp_replicate=1" if s.dp_replicate == 1 else "parallel.zero_stage=0 replicates everything")

    for kind in ("optimizer", "params"):
        name = f"offload_{kind}"
        value = getattr(s, name)
        if name not in active:
            off(name, f"offload.{kind}=none")
        elif ds:
            key = "offload_optimizer" if kind == "optimizer" else "offload_param"
            reason = rides
            if value == "nvme":
                reason = "NVMe offload exists only in DeepSpeed (ZeRO-Infinity)"
            elif kind == "optimizer" and s.offload_params == "none":
                reason = f"{rides}; offloads optimizer state only, parameters stay on the device"
            out[name] = BackendChoice(owner, f"DeepSpeed {key} device={value}", reason)
        else:
            also = "parameters, gradients and optimizer state move to the CPU together; the optimizer step runs on the CPU"
            out[name] = BackendChoice(
                owner, "FSDP2 CPUOffloadPolicy",
                f"{rides}; {also}. For optimizer-only offload set backend.offload=deepspeed",
            )

    if "zeropp" in active:
        parts = [k for k, on in (("qwZ", s.qw), ("qgZ", s.qg), (f"hpZ={s.hpz}", s.hpz > 0)) if on]
        out["zeropp"] = BackendChoice(DEEPSPEED, "DeepSpeed ZeRO++ " + " + ".join(parts),
                                      "ZeRO++ exists only in DeepSpeed")
    else:
        off("zeropp", "no ZeRO++ switch set")

    prec = "bf16" if s.precision in ("bf16", "fp8") else s.precision
    if ds:
        impl = "DeepSpeed bf16 section (fp32 master weights)" if prec == "bf16" else "DeepSpeed fp32"
        reason = rides + ("; note: DeepSpeed bf16 at ZeRO stage 0 drifts (no fp32 master)" if prec == "bf16" and z == 0 else "")
    else:
        impl = "FSDP2 MixedPrecisionPolicy bf16" if prec == "bf16" else "fp32"
        reason = rides
    out["precision"] = BackendChoice(owner, impl, reason)

    if "fp8" in active:
        te = s.fp8_impl == "transformer_engine"
        out["fp8"] = BackendChoice(
            NATIVE, "Transformer Engine" if te else "torchao float8 (convert_to_float8_training)",
            "backend.fp8_impl=transformer_engine" if te else "torchao float8 composes with FSDP2 float8 all-gather",
        )
    else:
        off("fp8", f"precision.name={s.precision}", NATIVE)

    ac = active.get("activation_checkpointing")
    if ac is None:
        off("activation_checkpointing", "activation_checkpointing.mode=none")
    else:
        backend = ac.forced or owner
        if backend == DEEPSPEED and ac.blocked.get(DEEPSPEED) is not None:
            backend = NATIVE
        mode = s.ac_mode if s.ac_mode == "full" else f"selective={s.ac_selective}"
        if backend == DEEPSPEED and s.pp > 1:
            impl = f"DeepSpeed PipelineModule activation_checkpoint_interval ({mode})"
        elif backend == DEEPSPEED:
            impl = f"deepspeed.checkpointing.checkpoint per block ({mode})"
        else:
            impl = f"torch.utils.checkpoint per block ({mode})"
        if ac.forced_by and ac.forced == backend:
            reason = f"{ac.forced_by} requested"
        elif backend != owner:
            reason = f"{ac.blocked.get(DEEPSPEED)}: native torch checkpointing runs inside the DeepSpeed engine"
        else:
            reason = rides
        out["activation_checkpointing"] = BackendChoice(backend, impl, reason)

    tp_impl = f"DTensor tensor parallel (tp={s.tp}{', sequence parallel' if s.sp else ''})"
    for name, degree, impl in (("tp", s.tp, tp_impl), ("ep", s.ep, f"native expert parallel (ep={s.ep})"),
                               ("cp", s.cp, f"native context parallel (cp={s.cp})")):
        if degree > 1:
            out[name] = BackendChoice(NATIVE, impl, "exists only natively")
        else:
            off(name, f"parallel.{name}=1", NATIVE)

    if s.pp > 1:
        impl = (f"DeepSpeed PipelineModule ({s.pp} stages, 1F1B)" if ds
                else f"torch.distributed.pipelining ({s.pp} stages, {s.pp_schedule})")
        out["pp"] = BackendChoice(owner, impl, rides)
    else:
        off("pp", "parallel.pp=1")

    out["checkpoint"] = BackendChoice(
        owner,
        "DeepSpeed engine.save_checkpoint (ZeRO partitioned)" if ds else "torch.distributed.checkpoint (DCP)",
        rides,
    )
    return {f.name: out[f.name] for f in FEATURES}


# --------------------------------------------------------------------------- rendering


def format_choices(choices: Dict[str, BackendChoice]) -> str:
    """Print-friendly table of a resolution: feature, backend, implementation, reason."""
    rows = [(name, c.backend, c.impl, c.reason) for name, c in choices.items() if c.impl != "off"]
    width = max((len(r[0]) for r in rows), default=8)
    lines = []
    for name, backend, impl, reason in rows:
        lines.append(f"{name:<{width}}  {backend:<9}  {impl}")
        lines.append(f"{'':<{width}}  {'':<9}  why: {reason}")
    return "\n".join(lines)


# Example configs rendered into the docs by running the resolver on them.
EXAMPLES: Tuple[Tuple[str, Dict[str, object]], ...] = (
    ("defaults (zero_stage=3, bf16)", {}),
    ("parallel.zero_stage=1", {"parallel.zero_stage": 1}),
    ("parallel.zero_stage=0 precision=bf16", {"parallel.zero_stage": 0}),
    ("offload.optimizer=cpu", {"offload.optimizer": "cpu"}),
    ("offload.optimizer=cpu backend.offload=deepspeed", {"offload.optimizer": "cpu", "backend.offload": "deepspeed"}),
    ("offload.optimizer=nvme offload.nvme_path=/nvme", {"offload.optimizer": "nvme", "offload.nvme_path": "/nvme"}),
    ("parallel.pp=2 parallel.zero_stage=1", {"parallel.pp": 2, "parallel.zero_stage": 1}),
    ("backend=deepspeed parallel.dp_replicate=2", {"backend.default": "deepspeed", "parallel.dp_replicate": 2}),
)
CONFLICT_EXAMPLES: Tuple[Tuple[str, Dict[str, object]], ...] = (
    ("parallel.zero_stage=1 parallel.tp=2", {"parallel.zero_stage": 1, "parallel.tp": 2}),
    ("backend=native parallel.zero_stage=1", {"backend.default": "native", "parallel.zero_stage": 1}),
    ("offload.optimizer=nvme offload.nvme_path=/nvme parallel.zero_stage=2",
     {"offload.optimizer": "nvme", "offload.nvme_path": "/nvme", "parallel.zero_stage": 2}),
    ("backend=deepspeed precision=fp8", {"backend.default": "deepspeed", "precision.name": "fp8"}),
    ("parallel.pp=2 parallel.zero_stage=3 backend=deepspeed",
     {"parallel.pp": 2, "parallel.zero_stage": 3, "backend.default": "deepspeed"}),
)


def example_spec(overrides: Dict[str, object], world_size: int = 8):
    """A default JobConfig on `world_size` local ranks with dotted-key overrides applied."""
    from launcher.config.schema import JobConfig

    spec = JobConfig()
    spec.cluster.gpus_per_node = world_size
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        obj = spec
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            raise KeyError(dotted)
        setattr(obj, last, value)
    return spec


def render_markdown() -> str:
    """docs/backends.md, generated from FEATURES, the resolver and the examples above."""
    out = [
        "# Backends: which implementation serves each feature",
        "",
        "<!-- Generated by `python -m launcher.plan.backends --markdown > docs/backends.md`; do not edit. -->",
        "",
        "One engine owns the model states: either the native PyTorch stack (FSDP2, DTensor, torch",
        "pipelining) or DeepSpeed's engine. Model-state features ride with that owner; DTensor features",
        "(TP, CP, EP) and FP8 exist only natively. Policy: native where it serves; DeepSpeed where a requested",
        "feature exists only there or the user asks (`backend=auto|native|deepspeed`, or per feature",
        "`backend.<key>=native|deepspeed`). Conflicts are reported before launch, one line each, with fixes.",
        "",
        "| feature | switched on by | override key | native | DeepSpeed | notes |",
        "|---|---|---|---|---|---|",
    ]
    for f in FEATURES:
        cells = [f.title + f" (`{f.name}`)", f"`{f.switches}`", f"`backend.{f.override}`",
                 f.native or "-", f.deepspeed or "-", f.notes + ("" if f.coupled else "; may differ from the owner")]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    out += ["", "## Resolved examples (8 ranks)", ""]
    for title, overrides in EXAMPLES:
        choices = resolve_backends(example_spec(overrides))
        out += [f"`{title}`", "", "| feature | backend | implementation | why |", "|---|---|---|---|"]
        for name, c in choices.items():
            if c.impl != "off":
                out.append(f"| {name} | {c.backend} | {c.impl} | {c.reason} |")
        out.append("")
    out += ["## Conflicts (reported before launch)", ""]
    for title, overrides in CONFLICT_EXAMPLES:
        try:
            resolve_backends(example_spec(overrides))
            lines = ["(no conflict)"]
        except ConfigError as err:
            lines = err.problems
        out += [f"`{title}`", "", "```"] + lines + ["```", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="feature x backend matrix")
    parser.add_argument("--markdown", action="store_true", help="print docs/backends.md")
    args = parser.parse_args(argv)
    if args.markdown:
        print(render_markdown(), end="")
    else:
        print(format_choices(resolve_backends(example_spec({}))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
