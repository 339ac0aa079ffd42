"""Which backend can serve each feature, and under which condition: the support table.

One `Row` per feature: when it is active, what switched it on, how to drop it, and per
backend the `Refusal`s (predicate on the config, reason, fixes) under which that backend
cannot serve it. A backend with no refusal for a row serves it whenever it is active. The
rules (launcher/plan/decide/rules.py) read this table for every registered backend
(launcher/plan/features.py REGISTRY): a new backend is a new key in the rows' `refuses`
maps, not new decision code.

Pure Python (no torch import) so that ``action=plan`` stays instant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from launcher.plan.features import DEEPSPEED, NATIVE
from launcher.plan.degrees import MeshPlan
from launcher.models.shape import mtp_layers_of


@dataclass(frozen=True)
class Switches:
    """The config values the rules read, with the mesh degrees the resolver derived."""

    zero: int
    mesh: MeshPlan  # the degrees (mesh.dp: the data-parallel size)
    sp: bool
    pp_schedule: str
    pp_virtual_stages: int
    pp_layers: Tuple[int, ...]
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
    cp_impl: str = "auto"  # backend.cp_impl as typed (cp_choice.choose_cp_impl resolves it)
    device: str = "auto"  # trainer.device
    mtp: bool = False  # model.mtp_layers > 0 (multi-token prediction)

    @classmethod
    def read(cls, spec, mesh: MeshPlan) -> "Switches":
        """The switches of `spec`, with the degrees of `mesh` (never derived again here)."""
        p, b = spec.parallel, spec.backend
        return cls(
            zero=int(p.zero_stage),
            mesh=mesh,
            sp=bool(p.sp),
            pp_schedule=str(p.pp_schedule),
            pp_virtual_stages=int(p.pp_virtual_stages),
            pp_layers=tuple(p.pp_layers or ()),
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
            cp_impl=str(getattr(b, "cp_impl", "auto")),
            device=str(spec.trainer.device),
            mtp=mtp_layers_of(spec.model) > 0,
        )


Pred = Callable[[Switches], bool]
Text = Callable[[Switches], str]
Texts = Callable[[Switches], Sequence[str]]


def _none(s: Switches) -> Sequence[str]:
    return ()


@dataclass(frozen=True)
class Refusal:
    """One condition under which a backend cannot serve a feature."""

    when: Pred
    why: Text
    # Alternatives that lift this refusal, shown when the user forced this backend.
    unblock: Texts = _none
    # The parallel.zero_stage that lifts it, shown when no backend can serve the feature.
    stage_fix: Texts = _none


@dataclass(frozen=True)
class Row:
    """One feature: when it is active, and per backend the refusals that keep it off that backend."""

    feature: str  # a name in launcher.plan.features.FEATURES
    active: Pred
    what: Text  # the switch that turns it on, e.g. "parallel.zero_stage=1"
    fixes: Texts  # ways to drop this feature's demand
    refuses: Mapping[str, Tuple[Refusal, ...]]  # backend -> refusals; absent: always serves
    off: Text  # the reason recorded while it is not in use
    # The backend recorded while it is off, for features implemented by one backend whatever the
    # owner (None: the model-state owner).
    off_backend: Optional[str] = None


@dataclass
class Need:
    """What one active feature asks of the owner, evaluated for every registered backend."""

    feature: str
    what: str
    blocked: Dict[str, Optional[str]]  # backend -> None (can serve) or why it cannot
    fixes: List[str]  # ways to drop this feature's demand
    unblock: Dict[str, List[str]]  # backend -> changes that let it serve
    stage_fix: List[str]  # the zero_stage that lets some backend serve it
    forced: Optional[str] = None  # backend the user forced for this feature
    forced_by: str = ""  # the key that forced it

    def serving(self) -> List[str]:
        """The backends that can serve it for this config, in registry order."""
        return [b for b, why in self.blocked.items() if why is None]

    def allowed(self) -> Set[str]:
        """The backends that may own it: those that can serve it, narrowed to the forced one."""
        ok = set(self.serving())
        return ok & {self.forced} if self.forced else ok


def needs(s: Switches, table: Sequence[Row], backends: Sequence[str]) -> List[Need]:
    """Every active feature of `table`, with what each backend in `backends` says about it."""
    out = []
    for row in table:
        if not row.active(s):
            continue
        blocked: Dict[str, Optional[str]] = dict.fromkeys(backends)  # None: serves
        unblock: Dict[str, List[str]] = {b: [] for b in backends}
        stage_fix: List[str] = []
        for b in backends:  # registry order: the order messages list the backends in
            fired = [r for r in row.refuses.get(b, ()) if r.when(s)]
            if not fired:
                continue
            blocked[b] = "; ".join(r.why(s) for r in fired)
            # Every fired refusal must be lifted: one change from each, in every combination.
            combos = [""]
            for r in fired:
                combos = [f"{c} {u}".strip() for c in combos for u in r.unblock(s)]
            unblock[b] = combos
            stage_fix += [f for r in fired for f in r.stage_fix(s)]
        out.append(Need(row.feature, row.what(s), blocked, list(row.fixes(s)), unblock, stage_fix))
    return out


# --------------------------------------------------------------------------- the table

_ZERO3 = ("parallel.zero_stage=3",)
_SHARD_FIX = "parallel.zero_stage=2 (FSDP2, params kept unsharded between forward and backward)"


def _shards_below_2(s: Switches) -> bool:
    # With one data-parallel rank every stage is the same: nothing is refused.
    return s.zero in (0, 1) and s.mesh.dp * s.mesh.cp > 1


def _zeropp_keys(s: Switches) -> List[str]:
    return [k for k, on in (("zeropp_quantized_weights", s.qw), ("zeropp_quantized_gradients", s.qg),
                            ("zeropp_hierarchical_partition", s.hpz > 0)) if on]


def _offload_row(kind: str) -> Row:
    value = lambda s: getattr(s, f"offload_{kind}")  # noqa: E731
    nvme = lambda s: value(s) == "nvme"  # noqa: E731
    cpu = lambda s: value(s) not in ("nvme", "none")  # noqa: E731
    if kind == "params":
        ds_cpu = Refusal(lambda s: cpu(s) and s.zero != 3,
                         lambda s: f"DeepSpeed offload_param needs parallel.zero_stage=3, got {s.zero}",
                         stage_fix=lambda s: _ZERO3)
    else:
        ds_cpu = Refusal(lambda s: cpu(s) and s.zero == 0, lambda s: "ZeRO-Offload needs parallel.zero_stage >= 1",
                         stage_fix=lambda s: ("parallel.zero_stage=2",))
    return Row(
        f"offload_{kind}", lambda s: value(s) != "none", lambda s: f"offload.{kind}={value(s)}",
        lambda s: [f"offload.{kind}=cpu", f"offload.{kind}=none"] if nvme(s) else [f"offload.{kind}=none"],
        {NATIVE: (Refusal(nvme, lambda s: "NVMe offload exists only in DeepSpeed (ZeRO-Infinity)"),
                  Refusal(lambda s: cpu(s) and s.zero not in (2, 3),
                          lambda s: "FSDP2 CPUOffloadPolicy needs a sharded model (parallel.zero_stage 2 or 3), "
                                    f"got {s.zero}")),
         DEEPSPEED: (Refusal(lambda s: nvme(s) and s.zero != 3,
                             lambda s: f"DeepSpeed NVMe offload needs parallel.zero_stage=3, got {s.zero}",
                             stage_fix=lambda s: _ZERO3),
                     ds_cpu)},
        off=lambda s: f"offload.{kind}=none")


def _native_only(name: str, why: str) -> Row:
    """A DTensor feature (tp, ep, cp): the DeepSpeed engine cannot hold it."""
    degree = lambda s: getattr(s.mesh, name)  # noqa: E731
    return Row(name, lambda s: degree(s) > 1, lambda s: f"parallel.{name}={degree(s)}",
               lambda s: [f"parallel.{name}=1"], {DEEPSPEED: (Refusal(lambda s: True, lambda s: why),)},
               off=lambda s: f"parallel.{name}=1", off_backend=NATIVE)


def _ds_pipeline(when: Pred, why: Text, unblock: Text) -> Refusal:
    return Refusal(when, why, unblock=lambda s: (unblock(s),))


# Row order is the order in which conflicts are reported.
SUPPORT: Tuple[Row, ...] = (
    # Sharding is always active: someone owns the model states.
    Row("sharding", lambda s: True, lambda s: f"parallel.zero_stage={s.zero}",
        lambda s: [_SHARD_FIX] if _shards_below_2(s) else [],
        {NATIVE: (Refusal(
            _shards_below_2,
            lambda s: "ZeRO-1 (optimizer-state sharding only) exists only in DeepSpeed; FSDP2 always shards "
                      "gradients too" if s.zero == 1 else
                      "the native path implements FSDP2 (ZeRO-2/3) only; plain data parallel (ZeRO-0) runs on DeepSpeed",
            unblock=lambda s: (_SHARD_FIX,)),)},
        off=lambda s: ""),
    Row("hsdp", lambda s: s.mesh.dp_replicate > 1 and s.zero > 0, lambda s: f"parallel.dp_replicate={s.mesh.dp_replicate}",
        lambda s: ["parallel.dp_replicate=1 (shard over every data-parallel rank)"],
        {DEEPSPEED: (Refusal(lambda s: s.zero != 3,
                             lambda s: f"DeepSpeed ZeRO-{s.zero} has no replicate groups (hpZ needs ZeRO-3)",
                             unblock=lambda s: _ZERO3),)},
        off=lambda s: ("parallel.dp_replicate=1" if s.mesh.dp_replicate == 1
                       else "parallel.zero_stage=0 replicates everything")),
    _offload_row("optimizer"),
    _offload_row("params"),
    Row("zeropp", lambda s: bool(_zeropp_keys(s)), lambda s: ", ".join(f"backend.{k}" for k in _zeropp_keys(s)),
        lambda s: [f"backend.{k}={'0' if k.endswith('partition') else 'false'}" for k in _zeropp_keys(s)],
        {NATIVE: (Refusal(lambda s: True,
                          lambda s: "ZeRO++ quantized / hierarchical communication exists only in DeepSpeed"),),
         DEEPSPEED: (Refusal(lambda s: s.zero != 3, lambda s: f"ZeRO++ needs parallel.zero_stage=3, got {s.zero}",
                             stage_fix=lambda s: _ZERO3),)},
        off=lambda s: "no ZeRO++ switch set"),
    Row("precision", lambda s: True, lambda s: f"precision.name={s.precision}", _none, {}, off=lambda s: ""),
    Row("fp8", lambda s: s.precision == "fp8", lambda s: "precision.name=fp8", lambda s: ["precision=bf16"],
        {DEEPSPEED: (Refusal(lambda s: True,
                             lambda s: "FP8 is a native module swap (torchao); the DeepSpeed path refuses it"),)},
        off=lambda s: f"precision.name={s.precision}", off_backend=NATIVE),
    Row("activation_checkpointing", lambda s: s.ac_mode != "none",
        lambda s: f"activation_checkpointing.mode={s.ac_mode}", _none,
        {DEEPSPEED: (Refusal(lambda s: s.ac_mode == "selective" and not s.ac_selective.isdigit(),
                             lambda s: "DeepSpeed checkpointing has no op-level selective mode "
                                       f"(activation_checkpointing.selective={s.ac_selective})",
                             unblock=lambda s: ("activation_checkpointing.mode=full",
                                                "activation_checkpointing.selective=1 (every block)")),)},
        off=lambda s: "activation_checkpointing.mode=none"),
    _native_only("tp", "tensor parallelism is native DTensor only; the DeepSpeed engine cannot wrap DTensor parameters"),
    _native_only("ep", "expert parallelism is implemented by the launcher's native MoE layers only"),
    _native_only("cp", "context parallelism is native only (DeepSpeed-Ulysses is not wired)"),
    Row("pp", lambda s: s.mesh.pp > 1, lambda s: f"parallel.pp={s.mesh.pp}", lambda s: ["parallel.pp=1"],
        {DEEPSPEED: (
            _ds_pipeline(lambda s: s.zero > 1,
                         lambda s: f"DeepSpeed's pipeline engine refuses ZeRO-{s.zero} (needs zero_stage <= 1)",
                         lambda s: f"parallel.zero_stage={min(s.zero, 1)}"),
            _ds_pipeline(lambda s: s.pp_schedule != "1f1b",
                         lambda s: f"DeepSpeed's pipeline engine runs only 1F1B (parallel.pp_schedule={s.pp_schedule})",
                         lambda s: "parallel.pp_schedule=1f1b"),
            _ds_pipeline(lambda s: s.pp_virtual_stages != 1,
                         lambda s: "DeepSpeed's pipeline engine has no virtual stages "
                                   f"(parallel.pp_virtual_stages={s.pp_virtual_stages})",
                         lambda s: "parallel.pp_virtual_stages=1"),
            _ds_pipeline(lambda s: bool(s.pp_layers),
                         lambda s: "DeepSpeed's pipeline engine partitions layers itself (parallel.pp_layers must be [])",
                         lambda s: "parallel.pp_layers=[]"),
            # Its stages pass one activation tuple; the launcher hands them no document ids/positions.
            _ds_pipeline(lambda s: s.document_masking,
                         lambda s: "DeepSpeed's pipeline engine takes no per-token document ids or positions "
                                   "(data.document_masking / data.reset_positions)",
                         lambda s: "data.document_masking=false data.reset_positions=false"),
        )},
        off=lambda s: "parallel.pp=1"),
    Row("checkpoint", lambda s: True, lambda s: "checkpoint format", _none, {}, off=lambda s: ""),
)
