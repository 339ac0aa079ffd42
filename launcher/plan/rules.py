"""The backend rules: which implementation serves each active feature, and every conflict.

`resolve_backends(spec, mesh)` is called by the resolver (launcher/plan/resolve.py) with the
mesh degrees it derived: nothing here derives a degree again. It

1. works out, per active feature, which backends can serve it for this config and
   which one the user forced (``backend=...`` globally, ``backend.<feature>=...``);
2. intersects those sets to pick the owner: native where it serves, DeepSpeed when a
   requested feature exists only there or the user asked for it;
3. reports every conflict at once as data (`Conflict`: feature, other side, reason, fixes),
   rendered one line each.

Pure Python (no torch import) so that ``action=plan`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

from launcher.config.errors import ConfigError
from launcher.plan.features import (BACKENDS, DEEPSPEED, FEATURE_BY_NAME, FEATURES, FP8_IMPLS, NATIVE,
                                    PREFERENCES, BackendChoice)
from launcher.plan.mesh import MeshPlan


def _label(backend: str) -> str:
    return "DeepSpeed" if backend == DEEPSPEED else "native"


@dataclass(frozen=True)
class Conflict:
    """One problem the resolver found, as data: `text()` renders the one line users see."""

    feature: str  # the feature that cannot be served as configured
    other: str  # what it conflicts with: another feature, "sharding", "backend", or a key
    reason: str
    fixes: Tuple[str, ...]  # alternatives, any one of which resolves the conflict
    joiner: str = " or "

    def text(self) -> str:
        fixes = self.joiner.join(dict.fromkeys(self.fixes))
        head = f"{self.feature} vs {self.other}: " if self.other else ""
        return f"{head}{self.reason}. Fix: {fixes}."


class BackendConflicts(ConfigError):
    """ConfigError whose problems are `Conflict`s (kept as data in `.conflicts`)."""

    def __init__(self, conflicts: List[Conflict]):
        self.conflicts = list(conflicts)
        super().__init__([c.text() for c in self.conflicts])

# --------------------------------------------------------------------------- reading the spec


@dataclass(frozen=True)
class _Switches:
    """The config values the rules read, with the mesh degrees the resolver derived."""

    zero: int
    dp_replicate: int
    dp: int  # data-parallel size
    dp_shard: int
    tp: int
    sp: bool
    pp: int
    pp_schedule: str
    pp_virtual_stages: int
    pp_layers: Tuple[int, ...]
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
    document_masking: bool  # data.document_masking or data.reset_positions (ids/positions per token)

    @classmethod
    def read(cls, spec, mesh: MeshPlan) -> "_Switches":
        p, b = spec.parallel, spec.backend
        return cls(
            zero=int(p.zero_stage),
            dp_replicate=mesh.dp_replicate,
            dp=mesh.dp,
            dp_shard=mesh.dp_shard,
            tp=mesh.tp,
            sp=bool(p.sp),
            pp=mesh.pp,
            pp_schedule=str(p.pp_schedule),
            pp_virtual_stages=int(p.pp_virtual_stages),
            pp_layers=tuple(p.pp_layers or ()),
            cp=mesh.cp,
            ep=mesh.ep,
            offload_optimizer=str(spec.offload.optimizer),
            offload_params=str(spec.offload.params),
            precision=str(spec.precision.name),
            ac_mode=str(spec.activation_checkpointing.mode),
            ac_selective=str(spec.activation_checkpointing.selective),
            qw=bool(b.zeropp_quantized_weights),
            qg=bool(b.zeropp_quantized_gradients),
            hpz=int(b.zeropp_hierarchical_partition),
            fp8_impl=str(b.fp8_impl),
            document_masking=bool(getattr(spec.data, "document_masking", False)
                                  or getattr(spec.data, "reset_positions", False)),
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
    stage_fix: List[str] = field(default_factory=list)  # the zero_stage that lets some backend serve it

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
    shards = s.dp * s.cp > 1  # with one data-parallel rank every stage is the same
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
                n.stage_fix = ["parallel.zero_stage=3"]
            n.fixes = [f"offload.{kind}=cpu", f"offload.{kind}=none"]
        else:
            if z not in (2, 3):
                n.blocked[NATIVE] = f"FSDP2 CPUOffloadPolicy needs a sharded model (parallel.zero_stage 2 or 3), got {z}"
            if kind == "params" and z != 3:
                n.blocked[DEEPSPEED] = f"DeepSpeed offload_param needs parallel.zero_stage=3, got {z}"
                n.stage_fix = ["parallel.zero_stage=3"]
            if kind == "optimizer" and z == 0:
                n.blocked[DEEPSPEED] = "ZeRO-Offload needs parallel.zero_stage >= 1"
                n.stage_fix = ["parallel.zero_stage=2"]
            n.fixes = [f"offload.{kind}=none"]
        needs.append(n)

    zpp = [k for k, on in (("zeropp_quantized_weights", s.qw), ("zeropp_quantized_gradients", s.qg),
                           ("zeropp_hierarchical_partition", s.hpz > 0)) if on]
    if zpp:
        n = _Need("zeropp", ", ".join(f"backend.{k}" for k in zpp))
        n.blocked[NATIVE] = "ZeRO++ quantized / hierarchical communication exists only in DeepSpeed"
        if z != 3:
            n.blocked[DEEPSPEED] = f"ZeRO++ needs parallel.zero_stage=3, got {z}"
            n.stage_fix = ["parallel.zero_stage=3"]
        n.fixes = [f"backend.{k}={'0' if k.endswith('partition') else 'false'}" for k in zpp]
        needs.append(n)

    needs.append(_Need("precision", f"precision.name={s.precision}"))
    if s.precision == "fp8":
        n = _Need("fp8", "precision.name=fp8")
        n.blocked[DEEPSPEED] = "FP8 is a native module swap (torchao); the DeepSpeed path refuses it"
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
        if s.document_masking:
            # Its stages pass one activation tuple; the launcher hands them no document ids/positions.
            ds_why.append("DeepSpeed's pipeline engine takes no per-token document ids or positions "
                          "(data.document_masking / data.reset_positions)")
        n.blocked[DEEPSPEED] = "; ".join(ds_why) or None
        n.unblock[DEEPSPEED] = ([f"parallel.zero_stage={min(z, 1)}"] if z > 1 else []) + (
            ["parallel.pp_schedule=1f1b"] if s.pp_schedule != "1f1b" else []) + (
            ["parallel.pp_virtual_stages=1"] if s.pp_virtual_stages != 1 else []) + (
            ["parallel.pp_layers=[]"] if s.pp_layers else []) + (
            ["data.document_masking=false data.reset_positions=false"] if s.document_masking else [])
        if n.unblock[DEEPSPEED]:
            n.unblock[DEEPSPEED] = [" ".join(n.unblock[DEEPSPEED])]
        n.fixes = ["parallel.pp=1"]
        needs.append(n)

    needs.append(_Need("checkpoint", "checkpoint format"))
    return needs


# --------------------------------------------------------------------------- the resolver


def _preferences(spec, needs: List[_Need], problems: List[Conflict]) -> str:
    """Apply backend=... and backend.<feature>=... to the needs; returns the global default."""
    be = spec.backend
    default = str(be.default or "auto")
    if default not in PREFERENCES:
        problems.append(Conflict("", "", f"backend={default} is not one of {', '.join(PREFERENCES)}",
                                 ("backend=auto",)))
        default = "auto"
    bad_keys = set()
    for key in dict.fromkeys(f.override for f in FEATURES):
        value = str(getattr(be, key, "") or "")
        if value and value not in PREFERENCES:
            problems.append(Conflict("", "", f"backend.{key}={value} is not one of {', '.join(PREFERENCES)} (or empty)",
                                     (f"backend.{key}=auto",)))
            bad_keys.add(key)
    for need in needs:
        key = FEATURE_BY_NAME[need.feature].override
        value = str(getattr(be, key, "") or "")
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


def _self_conflicts(needs: List[_Need], zero: int, problems: List[Conflict]) -> None:
    """A feature that no backend can serve, or that the user forced onto one that cannot."""
    for n in needs:
        ok = {b for b in BACKENDS if n.blocked.get(b) is None}
        if not ok:
            reasons = "; ".join(f"{_label(b)}: {n.blocked[b]}" for b in BACKENDS)
            problems.append(Conflict(n.feature, "sharding",
                                     f"{n.what} cannot run at parallel.zero_stage={zero} ({reasons})",
                                     tuple(n.stage_fix + n.fixes)))
        elif n.forced and n.forced not in ok:
            other = next(iter(ok))
            key = FEATURE_BY_NAME[n.feature].override
            if n.forced_by.startswith("backend="):
                fixes = ["backend=auto" if FEATURE_BY_NAME[n.feature].coupled else f"backend.{key}={other}"]
            else:
                fixes = [f"backend.{key}={other} (or drop {n.forced_by})"]
            fixes = n.unblock.get(n.forced, []) + fixes + n.fixes
            problems.append(Conflict(n.feature, "backend", f"{n.what} with {n.forced_by}: {n.blocked[n.forced]}",
                                     tuple(fixes)))


def _pair_conflicts(needs: List[_Need], problems: List[Conflict]) -> None:
    """Features that each can run, but not on the same owner."""
    coupled = [n for n in needs if FEATURE_BY_NAME[n.feature].coupled or n.forced == DEEPSPEED]
    for i, a in enumerate(coupled):
        for b in coupled[i + 1:]:
            sa, sb = a.allowed(), b.allowed()
            if not sa or not sb or sa & sb:
                continue
            problems.append(Conflict(
                a.feature, b.feature,
                f"{a.feature} needs {_label(next(iter(sa)))} ({_why_only(a, sa)}) "
                f"but {b.feature} needs {_label(next(iter(sb)))} ({_why_only(b, sb)}); one engine owns the model "
                f"states, so they cannot be mixed",
                (_fix_text(_drop(a)), _fix_text(_drop(b))), joiner=", or "))


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


def backend_conflicts(spec, mesh: MeshPlan) -> Tuple[List[Conflict], Optional[Dict[str, BackendChoice]]]:
    """(conflicts, choices): every conflict as data, and the per-feature decision when there is none."""
    s = _Switches.read(spec, mesh)
    problems: List[Conflict] = []
    needs = _needs(s)
    default = _preferences(spec, needs, problems)
    _self_conflicts(needs, s.zero, problems)
    if not problems:
        _pair_conflicts(needs, problems)
    _detail_conflicts(s, problems)
    if problems:
        return problems, None
    owner, why = _owner(needs, default)
    choices = _choices(s, needs, owner, why)
    problems = _pipeline_checkpointing_conflicts(s, choices)
    return (problems, None) if problems else ([], choices)


def _pipeline_checkpointing_conflicts(s: _Switches, choices: Dict[str, BackendChoice]) -> List[Conflict]:
    """DeepSpeed's pipeline engine recomputes through its own activation_checkpoint_interval:
    torch checkpointing chosen for AC would be a choice that engine ignores."""
    ac, pp = choices["activation_checkpointing"], choices["pp"]
    if pp.backend != DEEPSPEED or pp.impl == "off" or ac.impl == "off" or ac.backend == DEEPSPEED:
        return []
    return [Conflict(
        "activation_checkpointing", "pp",
        f"DeepSpeed's pipeline engine checkpoints activations itself (activation_checkpoint_interval), "
        f"but activation checkpointing resolved to native torch checkpointing ({ac.reason})",
        ("activation_checkpointing.mode=full", "activation_checkpointing.selective=1 (every block)",
         "drop backend.activation_checkpointing=native"))]


def resolve_backends(spec, mesh: MeshPlan) -> Dict[str, BackendChoice]:
    """Per-feature backend decision for a validated spec and its derived mesh.

    Returns one BackendChoice per feature in FEATURES (impl "off" for features not in use).
    Raises BackendConflicts (a ConfigError) with one line per conflict.
    """
    conflicts, choices = backend_conflicts(spec, mesh)
    if conflicts:
        raise BackendConflicts(conflicts)
    return choices


def _detail_conflicts(s: _Switches, problems: List[Conflict]) -> None:
    """Value-level rules that are not about which backend owns the model."""
    if s.fp8_impl not in FP8_IMPLS:
        problems.append(Conflict("", "", f"backend.fp8_impl={s.fp8_impl} is not one of {', '.join(FP8_IMPLS)}",
                                 ("backend.fp8_impl=auto",)))
    elif s.fp8_impl == "transformer_engine":
        # Never show a choice the runtime ignores: only torchao float8 is wired into the engines.
        problems.append(Conflict(
            "fp8", "backend.fp8_impl",
            "backend.fp8_impl=transformer_engine is not wired into this launcher's runtime (FP8 runs on "
            "torchao float8 only)", ("backend.fp8_impl=torchao", "backend.fp8_impl=auto")))
    if s.hpz > 0 and s.dp % s.hpz:
        problems.append(Conflict(
            "zeropp", "sharding",
            f"backend.zeropp_hierarchical_partition={s.hpz} must divide the data-parallel size {s.dp}",
            (f"a divisor of {s.dp} such as the GPUs per node",)))
    if s.hpz > 0 and s.dp_replicate > 1 and s.hpz != s.dp_shard:
        problems.append(Conflict(
            "zeropp", "hsdp",
            f"parallel.dp_replicate={s.dp_replicate} maps to hpZ groups of dp_shard={s.dp_shard} "
            f"but backend.zeropp_hierarchical_partition={s.hpz}",
            (f"backend.zeropp_hierarchical_partition={s.dp_shard}", "0, or parallel.dp_replicate=1")))


def hpz_partition_size(s_hpz: int, dp_replicate: int, dp_shard: int) -> int:
    """ZeRO++ hpZ secondary partition size: the explicit key, else dp_shard when HSDP-style
    replicate groups are asked of DeepSpeed (1 = off)."""
    if s_hpz == 0 and dp_replicate > 1:
        return dp_shard
    return max(1, s_hpz)


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
        out["fp8"] = BackendChoice(NATIVE, "torchao float8 (convert_to_float8_training)",
                                   "torchao float8 composes with FSDP2 float8 all-gather")
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
