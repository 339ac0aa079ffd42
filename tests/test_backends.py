"""The per-feature backend resolver: exhaustive switch combinations, policy, messages, docs."""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.errors import ConfigError
from launcher.config.loader import compose_spec
from launcher.plan.decide import rules
from launcher.plan.features import REGISTRY, BackendEntry
from launcher.plan.decide.resolve import derive_mesh, validate
from launcher.plan.decide.support import SUPPORT, Refusal
from launcher.plan.decide.backends import (
    BACKENDS,
    FEATURES,
    example_spec,
    format_choices,
    render_markdown,
    resolve_backends,
)

REPO = Path(__file__).resolve().parents[1]
COUPLED = [f.name for f in FEATURES if f.coupled]


def _resolve(overrides, world_size=8):
    """(choices, None) or (None, problems); any other exception fails the test."""
    try:
        return resolve_backends(example_spec(overrides, world_size=world_size)), None
    except ConfigError as err:
        return None, err.problems


def _check_outcome(overrides, choices, problems):
    """Invariants every resolution must satisfy, whichever way it went."""
    if problems is not None:
        assert problems, f"{overrides}: ConfigError without problems"
        for line in problems:
            assert "\n" not in line and "Fix:" in line, f"{overrides}: unclear line {line!r}"
            assert " vs " in line or " is not one of " in line, f"{overrides}: line does not name both sides: {line!r}"
        return
    assert [*choices] == [f.name for f in FEATURES]
    owner = choices["sharding"].backend
    for name, c in choices.items():
        assert c.backend in BACKENDS and c.impl and c.reason, (overrides, name, c)
        if name in COUPLED and c.impl != "off" and name not in ("fp8", "tp", "ep", "cp", "zeropp"):
            assert c.backend == owner, f"{overrides}: {name} on {c.backend} but sharding on {owner}"
    get = lambda k, d: overrides.get(k, d)  # noqa: E731
    zero = get("parallel.zero_stage", 3)
    if owner == "deepspeed":
        for dim in ("parallel.tp", "parallel.ep", "parallel.cp"):
            assert get(dim, 1) == 1, f"{overrides}: DeepSpeed owner with {dim} > 1"
        assert get("precision.name", "bf16") != "fp8"
        assert get("parallel.pp", 1) == 1 or zero <= 1, f"{overrides}: DeepSpeed pipeline with ZeRO-{zero}"
        explicit = [k for k, v in overrides.items() if k.startswith("backend.") and v == "deepspeed"]
        assert get("backend.default", "auto") != "native" or explicit, overrides
    else:
        assert zero >= 2 or _single_dp(overrides), f"{overrides}: ZeRO-{zero} served natively"
        assert "nvme" not in (get("offload.optimizer", "none"), get("offload.params", "none"))
        assert not get("backend.zeropp_quantized_weights", False)
        explicit = [k for k, v in overrides.items() if k.startswith("backend.") and v == "native"]
        assert get("backend.default", "auto") != "deepspeed" or explicit, overrides
    if "nvme" in (get("offload.optimizer", "none"), get("offload.params", "none")):
        assert owner == "deepspeed" and zero == 3


def _single_dp(overrides) -> bool:
    degrees = [overrides.get(f"parallel.{d}", 1) for d in ("tp", "pp", "dp_replicate", "cp")]
    return 8 // math.prod(degrees) * overrides.get("parallel.dp_replicate", 1) * overrides.get("parallel.cp", 1) == 1


MODEL_STATE_SWITCHES = {
    "backend.default": ["auto", "native", "deepspeed"],
    "parallel.zero_stage": [0, 1, 2, 3],
    "offload.optimizer": ["none", "cpu", "nvme"],
    "offload.params": ["none", "cpu", "nvme"],
    "precision.name": ["fp32", "bf16", "fp8"],
    "backend.zeropp_quantized_weights": [False, True],
    "backend.sharding": ["", "native", "deepspeed"],
    "backend.offload": ["", "native", "deepspeed"],
}

PARALLEL_SWITCHES = {
    "backend.default": ["auto", "native", "deepspeed"],
    "parallel.zero_stage": [0, 1, 2, 3],
    "parallel.tp": [1, 2],
    "parallel.pp": [1, 2],
    "parallel.dp_replicate": [1, 2],
    "parallel.ep": [1, 2],
    "parallel.cp": [1, 2],
    "activation_checkpointing.mode": ["none", "full", "selective"],
    "parallel.pp_schedule": ["1f1b", "gpipe"],
    "backend.activation_checkpointing": ["", "native", "deepspeed"],
}


@pytest.mark.parametrize("switches", [MODEL_STATE_SWITCHES, PARALLEL_SWITCHES], ids=["model_state", "parallel"])
def test_every_combination_gives_a_plan_or_clear_errors(switches):
    keys = list(switches)
    outcomes = {"plan": 0, "conflict": 0}
    for values in itertools.product(*switches.values()):
        overrides = dict(zip(keys, values))
        if "nvme" in (overrides.get("offload.optimizer"), overrides.get("offload.params")):
            overrides["offload.nvme_path"] = "/nvme"
        # 16 ranks: every combination of the degrees (at most 2*2*2*2) fits the world, so each
        # outcome is about backends, not about the mesh (which the resolver checks first).
        choices, problems = _resolve(overrides, world_size=16)
        _check_outcome(overrides, choices, problems)
        outcomes["plan" if choices else "conflict"] += 1
    # Both outcomes occur in volume: the enumeration exercises the policy, not one branch.
    assert outcomes["plan"] > 100 and outcomes["conflict"] > 100, outcomes


def test_auto_prefers_native_where_it_serves():
    c = resolve_backends(example_spec({}))
    assert c["sharding"].backend == "native" and "FSDP2" in c["sharding"].impl
    assert c["checkpoint"].impl.startswith("torch.distributed.checkpoint")
    # Native implements FSDP2 (ZeRO-2/3) only: plain data parallel runs on DeepSpeed ...
    c = resolve_backends(example_spec({"parallel.zero_stage": 0}))
    assert c["sharding"].backend == "deepspeed" and "ZeRO-0" in c["sharding"].reason
    # ... unless there is a single data-parallel rank (nothing to shard, e.g. TP only).
    c = resolve_backends(example_spec({"parallel.zero_stage": 0, "parallel.tp": 8}))
    assert c["sharding"].backend == "native" and c["tp"].backend == "native"


def test_zero1_routes_to_deepspeed_and_native_force_conflicts():
    c = resolve_backends(example_spec({"parallel.zero_stage": 1}))
    assert c["sharding"].backend == "deepspeed" and "ZeRO-1" in c["sharding"].reason
    with pytest.raises(ConfigError) as err:
        resolve_backends(example_spec({"parallel.zero_stage": 1, "backend.sharding": "native"}))
    (line,) = err.value.problems
    assert "backend.sharding=native" in line and "parallel.zero_stage=2" in line and "backend.sharding=deepspeed" in line


def test_nvme_offload_routes_to_deepspeed_with_reason():
    spec = compose_spec(["offload=nvme", "offload.nvme_path=/tmp/nvme", "parallel.zero_stage=3", "+recipe=debug"])
    assert validate(spec) == []
    c = resolve_backends(spec)
    assert c["sharding"].backend == "deepspeed"
    assert c["offload_optimizer"].impl == "DeepSpeed offload_optimizer device=nvme"
    assert "NVMe offload exists only in DeepSpeed" in c["sharding"].reason
    assert "NVMe offload exists only in DeepSpeed" in format_choices(c)


def test_nvme_below_zero3_is_one_line_naming_both_features():
    problems = _resolve({"offload.optimizer": "nvme", "offload.nvme_path": "/n", "parallel.zero_stage": 2})[1]
    assert problems == [
        "offload_optimizer vs sharding: offload.optimizer=nvme cannot run at parallel.zero_stage=2 "
        "(native: NVMe offload exists only in DeepSpeed (ZeRO-Infinity); DeepSpeed: DeepSpeed NVMe offload needs "
        "parallel.zero_stage=3, got 2). Fix: parallel.zero_stage=3 or offload.optimizer=cpu or offload.optimizer=none."
    ]


def test_cpu_offload_native_says_fsdp2_moves_everything():
    c = resolve_backends(example_spec({"offload.optimizer": "cpu"}))
    assert c["offload_optimizer"].backend == "native"
    assert "parameters, gradients and optimizer state" in c["offload_optimizer"].reason
    c = resolve_backends(example_spec({"offload.optimizer": "cpu", "backend.offload": "deepspeed"}))
    assert c["sharding"].backend == "deepspeed" and "backend.offload=deepspeed requested" in c["sharding"].reason
    assert "optimizer state only" in c["offload_optimizer"].reason


def test_deepspeed_with_native_tensor_parallel_conflicts():
    problems = _resolve({"backend.sharding": "deepspeed", "parallel.tp": 2})[1]
    assert len(problems) == 1 and problems[0].startswith("sharding vs tp:")
    assert "drop backend.sharding=deepspeed" in problems[0] and "parallel.tp=1" in problems[0]
    problems = _resolve({"parallel.zero_stage": 1, "parallel.tp": 2, "parallel.ep": 2})[1]
    assert [p.split(":")[0] for p in problems] == ["sharding vs tp", "sharding vs ep"]


def test_pipeline_rules():
    c = resolve_backends(example_spec({"parallel.pp": 2, "parallel.zero_stage": 1}))
    assert c["pp"].backend == "deepspeed" and "PipelineModule" in c["pp"].impl
    c = resolve_backends(example_spec({"parallel.pp": 2, "parallel.zero_stage": 3}))
    assert c["pp"].backend == "native" and "pipelining" in c["pp"].impl
    problems = _resolve({"parallel.pp": 2, "parallel.zero_stage": 2, "backend.default": "deepspeed"})[1]
    assert len(problems) == 1 and "refuses ZeRO-2" in problems[0] and "parallel.zero_stage=1" in problems[0]


def test_fp8_and_precision():
    c = resolve_backends(example_spec({"precision.name": "fp8"}))
    assert c["fp8"].backend == "native" and "torchao" in c["fp8"].impl
    problems = _resolve({"precision.name": "fp8", "parallel.zero_stage": 1})[1]
    assert problems and problems[0].startswith("sharding vs fp8:")
    c = resolve_backends(example_spec({"backend.default": "deepspeed", "parallel.zero_stage": 0}))
    assert "drifts" in c["precision"].reason
    # The runtime implements torchao float8 only: Transformer Engine is refused whether or not it
    # is installed, so the plan never shows a choice the engines would ignore.
    for precision in ("fp8", "bf16"):
        problems = _resolve({"precision.name": precision, "backend.fp8_impl": "transformer_engine"})[1]
        assert problems == [
            "fp8 vs backend.fp8_impl: backend.fp8_impl=transformer_engine is not wired into this launcher's runtime "
            "(FP8 runs on torchao float8 only). Fix: backend.fp8_impl=torchao or backend.fp8_impl=auto."
        ]


def test_hsdp_and_zeropp():
    c = resolve_backends(example_spec({"backend.default": "deepspeed", "parallel.dp_replicate": 2}))
    assert c["hsdp"].impl == "ZeRO++ hpZ (zero_hpz_partition_size=4)"
    problems = _resolve({"parallel.zero_stage": 1, "parallel.dp_replicate": 2})[1]
    assert problems and problems[0].startswith("sharding vs hsdp:")
    c = resolve_backends(example_spec({"backend.zeropp_quantized_gradients": True}))
    assert c["sharding"].backend == "deepspeed" and "qgZ" in c["zeropp"].impl
    problems = _resolve({"backend.zeropp_hierarchical_partition": 3})[1]
    assert problems and "must divide the data-parallel size 8" in problems[0]


def test_activation_checkpointing_inside_deepspeed():
    c = resolve_backends(example_spec({"parallel.zero_stage": 1, "activation_checkpointing.mode": "full"}))
    assert c["activation_checkpointing"].backend == "deepspeed"
    c = resolve_backends(example_spec({"parallel.zero_stage": 1, "activation_checkpointing.mode": "selective"}))
    assert c["activation_checkpointing"].backend == "native" and "op-level" in c["activation_checkpointing"].reason
    # Asking for DeepSpeed's checkpointing asks for the DeepSpeed engine...
    c = resolve_backends(example_spec({"activation_checkpointing.mode": "full", "backend.activation_checkpointing": "deepspeed"}))
    assert c["sharding"].backend == "deepspeed" and "backend.activation_checkpointing=deepspeed" in c["sharding"].reason
    # ... which cannot hold a tensor-parallel model.
    problems = _resolve({"activation_checkpointing.mode": "full", "backend.activation_checkpointing": "deepspeed",
                         "parallel.tp": 2})[1]
    assert problems and problems[0].startswith("activation_checkpointing vs tp:"), problems


def test_bad_preference_values_are_reported():
    problems = _resolve({"backend.default": "megatron", "backend.tp": "fsdp"})[1]
    assert len(problems) == 2 and "backend=megatron" in problems[0] and "backend.tp=fsdp" in problems[1]


def test_docs_match_the_code():
    committed = (REPO / "docs" / "backends.md").read_text()
    assert committed == render_markdown(), (
        "docs/backends.md is stale. Fix: python -m launcher.plan.decide.backends --markdown > docs/backends.md"
    )


def test_resolver_imports_no_torch():
    code = "import sys, launcher.plan.decide.backends; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_per_feature_key_beats_the_global_default():
    c = resolve_backends(example_spec({"backend.default": "native", "backend.sharding": "deepspeed"}))
    assert c["sharding"].backend == "deepspeed" and c["checkpoint"].backend == "deepspeed"
    c = resolve_backends(example_spec({"backend.default": "deepspeed", "backend.sharding": "native", "parallel.tp": 2}))
    assert c["sharding"].backend == "native" and c["tp"].backend == "native"
    problems = _resolve({"backend.default": "native", "parallel.zero_stage": 1, "parallel.tp": 2})[1]
    assert len(problems) == 1 and problems[0].startswith("sharding vs backend:")


def test_deepspeed_pipeline_refuses_torch_checkpointing_it_would_ignore():
    base = {"parallel.pp": 2, "parallel.zero_stage": 1}  # ZeRO-1: DeepSpeed owns the model and the pipeline
    choices, problems = _resolve({**base, "activation_checkpointing.mode": "full"})
    assert problems is None and choices["activation_checkpointing"].impl.startswith("DeepSpeed PipelineModule")
    for extra in ({"activation_checkpointing.mode": "full", "backend.activation_checkpointing": "native"},
                  {"activation_checkpointing.mode": "selective"}):  # op-level selective is torch only
        choices, problems = _resolve({**base, **extra})
        assert choices is None and len(problems) == 1, (extra, problems)
        assert problems[0].startswith("activation_checkpointing vs pp: DeepSpeed's pipeline engine checkpoints")
        assert "Fix: activation_checkpointing.mode=full" in problems[0]


# --------------------------------------------------------------------------- a third backend

THIRD = "megatron"  # hypothetical: registered only in the copies below, never in the launcher


def _third_backend(refuses):
    """The launcher's support table and registry plus a third backend that serves every feature
    except under `refuses` ({feature: (Refusal, ...)}). Copies: the globals stay as they are."""
    registry = (*REGISTRY, BackendEntry(THIRD, "Megatron", owns_what_it_serves=True))
    table = tuple(dataclasses.replace(row, refuses={**row.refuses, THIRD: refuses.get(row.feature, ())})
                  for row in SUPPORT)
    return table, registry


def _decide(overrides, *table_and_registry):
    spec = example_spec(overrides)
    mesh, problems = derive_mesh(spec.parallel, spec.cluster)
    assert mesh is not None, problems
    return rules.decide(spec, mesh, *table_and_registry)


def test_a_third_backend_is_a_row_entry_not_new_decision_code():
    no_ring = Refusal(lambda s: True, lambda s: "Megatron has no ring attention here")
    bf16_only = Refusal(lambda s: s.precision == "fp32", lambda s: "Megatron trains in bf16 only")
    third = _third_backend({"cp": (no_ring,), "precision": (bf16_only,)})
    zero1_tp = {"parallel.zero_stage": 1, "parallel.tp": 2}

    # Native refuses ZeRO-1 and DeepSpeed refuses TP: with two backends nobody owns both ...
    problems, decision = _decide(zero1_tp)
    assert decision is None and problems[0].feature == "sharding" and problems[0].other == "tp"
    # ... the third serves both, so it owns the model states, and the reason names both exclusions.
    problems, decision = _decide(zero1_tp, *third)
    assert problems == [] and decision.owner == THIRD
    assert "parallel.zero_stage=1 (ZeRO-1 (optimizer-state sharding only) exists only in DeepSpeed" in decision.why
    assert "parallel.tp=2 (tensor parallelism is native DTensor only" in decision.why
    # Where the first registered backend serves, it still wins (registry order is the preference).
    assert _decide({}, *third)[1].owner == "native"
    assert _decide({"backend.default": THIRD}, *third)[1].why == f"backend={THIRD} requested"

    # Two features whose backend sets are disjoint: the line lists every backend each one allows.
    problems, _ = _decide({**zero1_tp, "parallel.cp": 2}, *third)
    (line,) = [p.text() for p in problems]
    assert line.startswith("sharding vs cp: sharding needs DeepSpeed or Megatron (parallel.zero_stage=1: ")
    assert ("but cp needs native (parallel.cp=2: context parallelism is native only (DeepSpeed-Ulysses is not "
            "wired); Megatron has no ring attention here)") in line

    # Forced onto the third backend where it refuses: the fix names the backend that serves.
    problems, _ = _decide({"parallel.cp": 2, "backend.cp": THIRD}, *third)
    assert [p.text() for p in problems] == [
        f"cp vs backend: parallel.cp=2 with backend.cp={THIRD}: Megatron has no ring attention here. "
        f"Fix: backend.cp=native (or drop backend.cp={THIRD}) or parallel.cp=1."]

    # Every pair shares a backend but the three share none: one conflict naming the whole group.
    problems, decision = _decide({**zero1_tp, "precision.name": "fp32"}, *third)
    assert decision is None and len(problems) == 1
    assert problems[0].feature == "sharding" and problems[0].other == "precision, tp"
    assert "no backend serves them all" in problems[0].reason and "Megatron trains in bf16 only" in problems[0].reason

    # The launcher's registry never saw the third backend.
    assert THIRD not in BACKENDS and _decide(zero1_tp)[1] is None
    assert _resolve({"backend.default": THIRD})[1][0].startswith(f"backend={THIRD} is not one of auto, native, deepspeed")


def _third_impls(s, rides):
    """The third backend's implementation strings: one per feature it can serve."""
    return {name: (f"Megatron {name}", None) for name in [f.name for f in FEATURES]}


def _resolve_third(overrides, *table_and_registry):
    spec = example_spec(overrides)
    mesh, problems = derive_mesh(spec.parallel, spec.cluster)
    assert mesh is not None, problems
    return rules.backend_conflicts(spec, mesh, *table_and_registry, impls={**rules.IMPLS, THIRD: _third_impls})


def test_a_third_backend_resolves_end_to_end_from_data():
    """Registry entry, support rows and an impls function: the full resolution (choices, implementation
    strings, the pipeline rule) serves the third backend with no new decision code."""
    no_ring = Refusal(lambda s: True, lambda s: "Megatron has no ring attention here")
    table, registry = _third_backend({"cp": (no_ring,)})

    # Forced: it owns every active feature, with its own implementation strings.
    conflicts, choices = _resolve_third({"backend.default": THIRD, "parallel.tp": 2}, table, registry)
    assert conflicts == [] and choices["sharding"].backend == THIRD and choices["tp"].impl == "Megatron tp"
    assert choices["sharding"].reason.startswith(f"backend={THIRD} requested")
    # Where it cannot serve a feature, a forced choice is refused with the backend that can.
    conflicts, choices = _resolve_third({"backend.default": THIRD, "parallel.cp": 2}, table, registry)
    assert choices is None and [c.text() for c in conflicts] == [
        f"cp vs backend: parallel.cp=2 with backend={THIRD}: Megatron has no ring attention here. "
        f"Fix: backend=auto or parallel.cp=1."]

    # A pipeline engine that recomputes by itself is a flag on the entry: the rule follows the data.
    recomputing = tuple(dataclasses.replace(b, pipeline_recompute="its own recompute") if b.name == THIRD else b
                        for b in registry)
    pp_ac = {"backend.default": THIRD, "parallel.pp": 2, "activation_checkpointing.mode": "full",
             "backend.activation_checkpointing": "native"}
    assert _resolve_third(pp_ac, table, registry)[0] == []
    conflicts, choices = _resolve_third(pp_ac, table, recomputing)
    assert choices is None and [c.feature for c in conflicts] == ["activation_checkpointing"]
    assert conflicts[0].text().startswith("activation_checkpointing vs pp: Megatron's pipeline engine checkpoints "
                                          "activations itself (its own recompute), but activation checkpointing "
                                          "resolved to native torch.utils.checkpoint per block (full)")
    assert conflicts[0].fixes == ("drop backend.activation_checkpointing=native",)
