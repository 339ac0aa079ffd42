"""The backend rules: which implementation serves each active feature, and every conflict.

`resolve_backends(spec, mesh)` is called by the resolver (launcher/plan/decide/resolve.py) with the
mesh degrees it derived: nothing here derives a degree again. It

1. works out, per active feature, which backends can serve it for this config (the support
   table, launcher/plan/decide/support.py) and which one the user forced (``backend=...`` globally,
   ``backend.<feature>=...``);
2. intersects those sets to pick the owner: the first registered backend that serves
   (launcher/plan/features.py REGISTRY: native, then DeepSpeed), another one when a requested
   feature exists only there or the user asked for it;
3. reports every conflict at once as data (`Conflict`: feature, other side, reason, fixes),
   rendered one line each.

Nothing here names a backend except the implementation strings (`IMPLS`, a registry of one
function per backend): the decision iterates over the registry, support table and impls it is
given (the launcher's by default), and backend-specific facts are data on the backend's entry
(features.py BackendEntry) or its rows of the support table.

Pure Python (no torch import) so that ``action=plan`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from launcher.config.errors import ConfigError
from launcher.plan.features import (DEEPSPEED, FEATURE_BY_NAME, FEATURES, FP8_IMPLS, NATIVE, REGISTRY,
                                    BackendChoice, BackendEntry)
from launcher.plan.degrees import MeshPlan
from launcher.plan.decide.cp_choice import cp_description, cp_impl_problems
from launcher.plan.decide.support import SUPPORT, Need, Row, Switches, needs


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


# --------------------------------------------------------------------------- the owner decision


@dataclass(frozen=True)
class Decision:
    """Who owns the model states and why, with every active feature's `Need`."""

    owner: str
    why: str
    needs: Tuple[Need, ...]
    switches: Switches


class _Registry:
    """The backends one decision runs over (the global REGISTRY, or a test's copy)."""

    def __init__(self, entries: Sequence[BackendEntry]):
        self.entries = {b.name: b for b in entries}
        self.names = tuple(self.entries)

    def label(self, backend: str) -> str:
        return self.entries[backend].label

    def labels(self, backends: Set[str]) -> str:
        return " or ".join(self.label(b) for b in self.names if b in backends)

    def preferences(self) -> Tuple[str, ...]:
        return ("auto", *self.names)

    def coupled(self, ns: Sequence[Need]) -> List[Need]:
        """The needs the model-state owner must serve: coupled features, and any feature forced
        onto a backend whose implementation needs to own the model states."""
        return [n for n in ns if FEATURE_BY_NAME[n.feature].coupled
                or (n.forced is not None and self.entries[n.forced].owns_what_it_serves)]


_REGISTRY = _Registry(REGISTRY)


def _registry(registry: Sequence[BackendEntry]) -> _Registry:
    return _REGISTRY if registry is REGISTRY else _Registry(registry)


def decide(spec, mesh: MeshPlan, table: Sequence[Row] = SUPPORT,
           registry: Sequence[BackendEntry] = REGISTRY) -> Tuple[List[Conflict], Optional[Decision]]:
    """(conflicts, None), or ([], the owner decision) for `spec` over the backends of `registry`.

    `table` and `registry` default to the launcher's; a caller may pass extended copies.
    """
    reg = _registry(registry)
    s = Switches.read(spec, mesh)
    problems: List[Conflict] = []
    ns = needs(s, table, reg.names)
    _preferences(spec, ns, problems, reg)
    _self_conflicts(ns, s.zero, problems, reg)
    if not problems:
        _pair_conflicts(ns, problems, reg)
    _detail_conflicts(s, problems)
    if problems:
        return problems, None
    owner, why = _owner(ns, reg)
    return [], Decision(owner, why, tuple(ns), s)


def _preferences(spec, ns: List[Need], problems: List[Conflict], reg: _Registry) -> None:
    """Apply backend=... and backend.<feature>=... to the needs."""
    be = spec.backend
    prefs = reg.preferences()
    default = str(be.default or "auto")
    if default not in prefs:
        problems.append(Conflict("", "", f"backend={default} is not one of {', '.join(prefs)}", ("backend=auto",)))
        default = "auto"
    bad_keys = set()
    for key in dict.fromkeys(f.override for f in FEATURES):
        value = str(getattr(be, key, "") or "")
        if value and value not in prefs:
            problems.append(Conflict("", "", f"backend.{key}={value} is not one of {', '.join(prefs)} (or empty)",
                                     (f"backend.{key}=auto",)))
            bad_keys.add(key)
    for need in ns:
        key = FEATURE_BY_NAME[need.feature].override
        value = "" if key in bad_keys else str(getattr(be, key, "") or "")
        if value in reg.names:
            need.forced, need.forced_by = value, f"backend.{key}={value}"
        elif not value and default in reg.names:
            need.forced, need.forced_by = default, f"backend={default}"
    # A per-feature key is more specific than the global default: when one pins a model-state
    # feature to another backend, the features the default alone forced follow that owner
    # (`backend=native backend.sharding=deepspeed` means "DeepSpeed owns the model states").
    explicit = {n.forced for n in ns if n.forced_by.startswith("backend.") and FEATURE_BY_NAME[n.feature].coupled}
    if default in reg.names and len(explicit) == 1 and default not in explicit:
        for need in ns:
            if need.forced_by == f"backend={default}":
                need.forced, need.forced_by = None, ""


def _self_conflicts(ns: List[Need], zero: int, problems: List[Conflict], reg: _Registry) -> None:
    """A feature that no backend can serve, or that the user forced onto one that cannot."""
    for n in ns:
        ok = n.serving()
        if not ok:
            reasons = "; ".join(f"{reg.label(b)}: {n.blocked[b]}" for b in reg.names)
            problems.append(Conflict(n.feature, "sharding",
                                     f"{n.what} cannot run at parallel.zero_stage={zero} ({reasons})",
                                     tuple(n.stage_fix + n.fixes)))
        elif n.forced and n.forced not in ok:
            feature = FEATURE_BY_NAME[n.feature]
            if n.forced_by.startswith("backend="):
                fixes = ["backend=auto"] if feature.coupled else [f"backend.{feature.override}={b}" for b in ok]
            else:
                fixes = [f"backend.{feature.override}={b} (or drop {n.forced_by})" for b in ok]
            fixes = n.unblock.get(n.forced, []) + fixes + n.fixes
            problems.append(Conflict(n.feature, "backend", f"{n.what} with {n.forced_by}: {n.blocked[n.forced]}",
                                     tuple(fixes)))


def _pair_conflicts(ns: List[Need], problems: List[Conflict], reg: _Registry) -> None:
    """Features that each can run, but not on the same owner."""
    coupled = reg.coupled(ns)
    sets = [n.allowed() for n in coupled]
    for i, a in enumerate(coupled):
        for j in range(i + 1, len(coupled)):
            b, sa, sb = coupled[j], sets[i], sets[j]
            if not sa or not sb or sa & sb:
                continue
            problems.append(Conflict(
                a.feature, b.feature,
                f"{a.feature} needs {reg.labels(sa)} ({_why_only(a)}) "
                f"but {b.feature} needs {reg.labels(sb)} ({_why_only(b)}); one engine owns the model "
                f"states, so they cannot be mixed",
                (_fix_text(_drop(a)), _fix_text(_drop(b))), joiner=", or "))
    if problems or set(reg.names).intersection(*sets):
        return
    # With three or more backends every pair may share one while the whole group shares none.
    group = [n for n, ok in zip(coupled, sets) if ok != set(reg.names)]
    problems.append(Conflict(
        group[0].feature, ", ".join(n.feature for n in group[1:]),
        "no backend serves them all: " + "; ".join(
            f"{n.feature} needs {reg.labels(n.allowed())} ({_why_only(n)})" for n in group)
        + "; one engine owns the model states, so they cannot be mixed",
        tuple(_fix_text(_drop(n)) for n in group), joiner=", or "))


def _fix_text(fixes: List[str]) -> str:
    return " or ".join(dict.fromkeys(fixes))


def _only_forced(n: Need) -> bool:
    """The user forced this feature onto a backend while another one could serve it."""
    return bool(n.forced) and any(why is None for b, why in n.blocked.items() if b != n.forced)


def _why_only(n: Need) -> str:
    if _only_forced(n) and n.forced_by:
        return f"{n.forced_by} requested"
    allowed = n.allowed()
    return f"{n.what}: " + "; ".join(why for b, why in n.blocked.items() if b not in allowed and why)


def _drop(n: Need) -> List[str]:
    """Ways to lift a feature's single-backend demand."""
    if _only_forced(n):
        if n.forced_by.startswith("backend="):
            return ["backend=auto"]
        return [f"drop {n.forced_by}"]
    return n.fixes or ["change " + n.what]


def _owner(ns: List[Need], reg: _Registry) -> Tuple[str, str]:
    """The model-state owner and the reason. Call only when there are no conflicts.

    The owner is the first registered backend every coupled feature allows. The reason names what
    excluded the backends it was preferred over: all others when it is the only one left, else
    those registered before it.
    """
    coupled = [(n, n.allowed()) for n in reg.coupled(ns)]
    allowed = [b for b in reg.names if all(b in ok for _, ok in coupled)]
    owner = allowed[0]
    if len(allowed) == 1:
        excluded = [b for b in reg.names if b != owner]
    else:
        excluded = list(reg.names[:reg.names.index(owner)])
    forced, only = set(), []
    for n, ok in coupled:
        out = [b for b in excluded if b not in ok]
        if not out:
            continue
        whys = [n.blocked[b] for b in out if n.blocked[b]]
        if n.forced == owner and len(whys) < len(out):
            forced.add(n.forced_by)
        if whys:
            only.append(f"{n.what} ({'; '.join(dict.fromkeys(whys))})")
    parts = [", ".join(sorted(forced)) + " requested"] if forced else []
    if only:
        parts.append("; ".join(only))
    return owner, "; ".join(parts) or f"{reg.label(owner)} where it serves (backend=auto)"


# --------------------------------------------------------------------------- the resolver


def backend_conflicts(spec, mesh: MeshPlan, table: Sequence[Row] = SUPPORT,
                      registry: Sequence[BackendEntry] = REGISTRY, impls: Optional[Mapping[str, "Impls"]] = None,
                      ) -> Tuple[List[Conflict], Optional[Dict[str, BackendChoice]]]:
    """(conflicts, choices): every conflict as data, and the per-feature decision when there is none.

    `table`, `registry` and `impls` (backend -> its implementation strings) default to the
    launcher's SUPPORT, REGISTRY and IMPLS; a caller may pass extended copies (a third backend)."""
    problems, decision = decide(spec, mesh, table, registry)
    if decision is None:
        return problems, None
    reg = _registry(registry)
    choices = _choices(decision, reg, table, IMPLS if impls is None else impls)
    problems = _pipeline_checkpointing_conflicts(choices, decision.switches, reg, table)
    return (problems, None) if problems else ([], choices)


def _pipeline_checkpointing_conflicts(choices: Dict[str, BackendChoice], s: Switches, reg: _Registry,
                                      table: Sequence[Row]) -> List[Conflict]:
    """A backend whose pipeline engine recomputes through its own mechanism
    (BackendEntry.pipeline_recompute: DeepSpeed's activation_checkpoint_interval) ignores activation
    checkpointing resolved to another backend: refused, with the changes that let its own serve."""
    ac, pp = choices["activation_checkpointing"], choices["pp"]
    own = reg.entries[pp.backend].pipeline_recompute
    if not own or pp.impl == "off" or ac.impl == "off" or ac.backend == pp.backend:
        return []
    feature = FEATURE_BY_NAME["activation_checkpointing"]
    (row,) = [r for r in table if r.feature == feature.name]
    unblock = [u for refusal in row.refuses.get(pp.backend, ()) for u in refusal.unblock(s)]
    return [Conflict(
        feature.name, "pp",
        f"{reg.label(pp.backend)}'s pipeline engine checkpoints activations itself ({own}), "
        f"but activation checkpointing resolved to {reg.label(ac.backend)} {ac.impl} ({ac.reason})",
        (*unblock, f"drop backend.{feature.override}={ac.backend}"))]


def resolve_backends(spec, mesh: MeshPlan) -> Dict[str, BackendChoice]:
    """Per-feature backend decision for a validated spec and its derived mesh.

    Returns one BackendChoice per feature in FEATURES (impl "off" for features not in use).
    Raises BackendConflicts (a ConfigError) with one line per conflict.
    """
    conflicts, choices = backend_conflicts(spec, mesh)
    if conflicts:
        raise BackendConflicts(conflicts)
    return choices


def _detail_conflicts(s: Switches, problems: List[Conflict]) -> None:
    """Value-level rules that are not about which backend owns the model.

    They stay code, not support-table rows: they check a key's value against the mesh whoever
    serves it (the hpZ keys are DeepSpeed's own ZeRO++ knobs, one backend's fact; fp8_impl is what
    the runtime wires, not a backend)."""
    if s.fp8_impl not in FP8_IMPLS:
        problems.append(Conflict("", "", f"backend.fp8_impl={s.fp8_impl} is not one of {', '.join(FP8_IMPLS)}",
                                 ("backend.fp8_impl=auto",)))
    elif s.fp8_impl == "transformer_engine":
        # Never show a choice the runtime ignores: only torchao float8 is wired into the engines.
        problems.append(Conflict(
            "fp8", "backend.fp8_impl",
            "backend.fp8_impl=transformer_engine is not wired into this launcher's runtime (FP8 runs on "
            "torchao float8 only)", ("backend.fp8_impl=torchao", "backend.fp8_impl=auto")))
    for reason, fixes in cp_impl_problems(s.cp_impl, s.mesh.cp, s.device, s.document_masking, s.mtp):
        problems.append(Conflict("cp", "backend.cp_impl", reason, fixes))
    if s.hpz > 0 and s.mesh.dp % s.hpz:
        problems.append(Conflict(
            "zeropp", "sharding",
            f"backend.zeropp_hierarchical_partition={s.hpz} must divide the data-parallel size {s.mesh.dp}",
            (f"a divisor of {s.mesh.dp} such as the GPUs per node",)))
    if s.hpz > 0 and s.mesh.dp_replicate > 1 and s.hpz != s.mesh.dp_shard:
        problems.append(Conflict(
            "zeropp", "hsdp",
            f"parallel.dp_replicate={s.mesh.dp_replicate} maps to hpZ groups of dp_shard={s.mesh.dp_shard} "
            f"but backend.zeropp_hierarchical_partition={s.hpz}",
            (f"backend.zeropp_hierarchical_partition={s.mesh.dp_shard}", "0, or parallel.dp_replicate=1")))


def hpz_partition_size(s_hpz: int, dp_replicate: int, dp_shard: int) -> int:
    """ZeRO++ hpZ secondary partition size: the explicit key, else dp_shard when HSDP-style
    replicate groups are asked of DeepSpeed (1 = off)."""
    if s_hpz == 0 and dp_replicate > 1:
        return dp_shard
    return max(1, s_hpz)


# --------------------------------------------------------------------------- impl strings

# backend -> (switches, the "rides with" reason) -> {feature: (implementation, reason or None)};
# None: the feature rides with the owner (or, for sharding, the owner's reason).
Impls = Callable[[Switches, str], Dict[str, Tuple[str, Optional[str]]]]


def _native_impls(s: Switches, rides: str) -> Dict[str, Tuple[str, Optional[str]]]:
    z, offload = s.zero, ("FSDP2 CPUOffloadPolicy", f"{rides}; parameters, gradients and optimizer state move to "
                          "the CPU together; the optimizer step runs on the CPU. For optimizer-only offload set "
                          "backend.offload=deepspeed")
    return {
        "sharding": ("none (one data-parallel rank: nothing to shard)" if z in (0, 1) else
                     f"FSDP2 fully_shard (zero_stage={z}, reshard_after_forward={z == 3})", None),
        "hsdp": (f"FSDP2 HSDP mesh (dp_replicate={s.mesh.dp_replicate}, dp_shard={s.mesh.dp_shard})", None),
        "offload_optimizer": offload,
        "offload_params": offload,
        "precision": ("FSDP2 MixedPrecisionPolicy bf16" if _prec(s) == "bf16" else "fp32", None),
        "fp8": ("torchao float8 (convert_to_float8_training)", "torchao float8 composes with FSDP2 float8 all-gather"),
        # The reason is used when it runs inside another owner's engine ({owner}: that engine's label).
        "activation_checkpointing": (f"torch.utils.checkpoint per block ({_ac_mode(s)})",
                                     "native torch checkpointing runs inside the {owner} engine"),
        "tp": (f"DTensor tensor parallel (tp={s.mesh.tp}{', sequence parallel' if s.sp else ''})", "exists only natively"),
        "ep": (f"native expert parallel (ep={s.mesh.ep})", "exists only natively"),
        # Which implementation (and why) needs the layout's memory: resolve.decide_cp fills it in.
        "cp": (cp_description(s.mesh.cp), "exists only natively"),
        "pp": (f"torch.distributed.pipelining ({s.mesh.pp} stages, {s.pp_schedule})", None),
        "checkpoint": ("torch.distributed.checkpoint (DCP)", None),
    }


def _deepspeed_impls(s: Switches, rides: str) -> Dict[str, Tuple[str, Optional[str]]]:
    def offload(kind: str) -> Tuple[str, Optional[str]]:
        value = getattr(s, f"offload_{kind}")
        reason = None
        if value == "nvme":
            reason = "NVMe offload exists only in DeepSpeed (ZeRO-Infinity)"
        elif kind == "optimizer" and s.offload_params == "none":
            reason = f"{rides}; offloads optimizer state only, parameters stay on the device"
        return f"DeepSpeed {'offload_optimizer' if kind == 'optimizer' else 'offload_param'} device={value}", reason

    bf16 = _prec(s) == "bf16"
    zpp = [k for k, on in (("qwZ", s.qw), ("qgZ", s.qg), (f"hpZ={s.hpz}", s.hpz > 0)) if on]
    return {
        "sharding": (f"DeepSpeed ZeRO-{s.zero}", None),
        "hsdp": (f"ZeRO++ hpZ (zero_hpz_partition_size={s.mesh.dp_shard})", None),
        "offload_optimizer": offload("optimizer"),
        "offload_params": offload("params"),
        "zeropp": ("DeepSpeed ZeRO++ " + " + ".join(zpp), "ZeRO++ exists only in DeepSpeed"),
        "precision": ("DeepSpeed bf16 section (fp32 master weights)" if bf16 else "DeepSpeed fp32",
                      rides + "; note: DeepSpeed bf16 at ZeRO stage 0 drifts (no fp32 master)"
                      if bf16 and s.zero == 0 else None),
        "activation_checkpointing": (
            f"DeepSpeed PipelineModule activation_checkpoint_interval ({_ac_mode(s)})" if s.mesh.pp > 1
            else f"deepspeed.checkpointing.checkpoint per block ({_ac_mode(s)})", None),
        "pp": (f"DeepSpeed PipelineModule ({s.mesh.pp} stages, 1F1B)", None),
        "checkpoint": ("DeepSpeed engine.save_checkpoint (ZeRO partitioned)", None),
    }


# One implementation-strings function per registered backend (a registry, not a switch).
IMPLS: Dict[str, Impls] = {NATIVE: _native_impls, DEEPSPEED: _deepspeed_impls}


def _prec(s: Switches) -> str:
    return "bf16" if s.precision in ("bf16", "fp8") else s.precision  # fp8 trains on a bf16 base


def _ac_mode(s: Switches) -> str:
    return s.ac_mode if s.ac_mode == "full" else f"selective={s.ac_selective}"


def _choices(decision: Decision, reg: _Registry, table: Sequence[Row],
             impls: Mapping[str, Impls]) -> Dict[str, BackendChoice]:
    s, owner = decision.switches, decision.owner
    active = {n.feature: n for n in decision.needs}
    rides = f"rides with sharding ({reg.label(owner)} owns the model states)"
    owned = impls[owner](s, rides)
    out: Dict[str, BackendChoice] = {}
    for row in table:
        n = active.get(row.feature)
        if n is None:
            out[row.feature] = BackendChoice(row.off_backend or owner, "off", row.off(s))
        elif not FEATURE_BY_NAME[row.feature].coupled:
            out[row.feature] = _guest_choice(s, n, owner, rides, reg, impls)
        else:
            impl, reason = owned[row.feature]
            out[row.feature] = BackendChoice(owner, impl, decision.why if row.feature == "sharding" else reason or rides)
    return {f.name: out[f.name] for f in FEATURES}


def _guest_choice(s: Switches, n: Need, owner: str, rides: str, reg: _Registry,
                  impls: Mapping[str, Impls]) -> BackendChoice:
    """An uncoupled feature (activation checkpointing) may run on another backend than the owner: the
    forced one, or, where the owner's cannot serve it, the first that serves it inside any owner's engine."""
    backend = n.forced or owner
    if n.blocked[backend] is not None:
        backend = next(b for b in n.serving() if not reg.entries[b].owns_what_it_serves)
    impl, guest = impls[backend](s, rides)[n.feature]
    if n.forced_by and n.forced == backend:
        reason = f"{n.forced_by} requested"
    elif backend != owner:
        reason = f"{n.blocked[owner]}: {str(guest).format(owner=reg.label(owner))}"
    else:
        reason = rides
    return BackendChoice(backend, impl, reason)
