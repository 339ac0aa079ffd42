"""resolve(spec) -> Layout: every derived decision made once, written into plan.json."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import List, Tuple

import pytest

from launcher.config.errors import ConfigError
from launcher.config.loader import compose_spec
from launcher.plan.decide import rules
from launcher.plan.layout import FLAT_RECORDS, PLAN_KEY_ORDER, Layout
from launcher.plan.present.plan import Plan, build_plan
from launcher.plan.decide.resolve import check, derive_mesh, resolve, validate

REPO = Path(__file__).resolve().parents[1]


def test_dp_shard_is_inferred_once_and_everything_lands_in_the_layout():
    spec = compose_spec(["+recipe=llama70b", "cluster.nodes=4", "parallel.tp=8", "parallel.pp=4",
                         "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                         "trainer.micro_batch_size=1", "trainer.global_batch_size=64"])
    lay = resolve(spec)
    assert (lay.nodes, lay.gpus_per_node, lay.mesh.world_size) == (4, 8, 32)
    assert (lay.mesh.pp, lay.mesh.dp_replicate, lay.mesh.dp_shard, lay.mesh.cp, lay.mesh.tp) == (4, 1, 1, 1, 8)
    assert lay.batch.microbatches == 64 and lay.pp_microbatches == 64 and lay.global_batch_size == 64
    assert (lay.schedule, lay.vpp) == ("interleaved_1f1b", 2)
    assert lay.owners.sharding_backend == "native" and lay.fsdp_wraps is False  # one data-parallel rank
    assert lay.backends["pp"].impl.startswith("torch.distributed.pipelining")
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.mesh.pp = 2  # type: ignore[misc]


def test_the_issue_example_plans_the_micro_batches_it_runs():
    """llama70b pp=4 gpipe micro 4 global 16: one rule for planner and engine (the accumulation)."""
    spec = compose_spec(["+recipe=llama70b", "parallel.pp=4", "parallel.pp_schedule=gpipe",
                         "trainer.micro_batch_size=4", "trainer.global_batch_size=16", "action=plan"])
    plan = build_plan(spec, check(spec))
    lay = plan.layout
    accumulation = lay.global_batch_size // (lay.batch.micro_batch_size * lay.mesh.dp)
    assert lay.pp_microbatches == accumulation == plan.pipeline["microbatches"]
    # What the planner reports is what the schedule runs: (pp - 1) / m for gpipe.
    assert plan.pipeline["bubble_fraction"] == pytest.approx((lay.mesh.pp - 1) / lay.pp_microbatches)


def test_plan_json_holds_the_layout_and_round_trips(tmp_path):
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=4", "parallel.tp=2", "parallel.sp=true",
                         "offload.optimizer=cpu"])
    plan = build_plan(spec, check(spec))
    plan.save(tmp_path)
    d = json.loads((tmp_path / "plan.json").read_text())
    lay = d["layout"]
    assert (lay["tp"], lay["dp_shard"], lay["sp"]) == (2, 2, True)
    assert lay["derived"] == {"world_size": 4, "dp": 2, "global_batch_size": spec.trainer.global_batch_size,
                              "pp_microbatches": lay["microbatches"], "fsdp_wraps": True,
                              "fsdp_holds_unsharded": False}
    assert lay["offload_backend"] == "native" and lay["choices"]["offload_optimizer"]["impl"] == "FSDP2 CPUOffloadPolicy"
    # The mesh / batch / backends sections are views of the layout, and the layout is what is read back.
    assert d["mesh"]["dp_shard"] == lay["dp_shard"] and d["batch"]["grad_accum_steps"] == lay["microbatches"]
    back = Plan.load(tmp_path)
    assert back.layout == plan.layout and isinstance(back.layout, Layout)


def test_backend_rules_run_once_per_launch(monkeypatch):
    calls = []
    real = rules.backend_conflicts

    def counting(spec, mesh):
        calls.append(mesh)
        return real(spec, mesh)

    monkeypatch.setattr("launcher.plan.decide.resolve.backend_conflicts", counting)
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=2"])
    build_plan(spec, check(spec))  # what `train` does
    assert len(calls) == 1


def test_transformer_engine_is_refused_with_a_fix():
    spec = compose_spec(["+recipe=debug", "precision=fp8", "precision.fp8.emulate=true", "trainer.device=cpu",
                         "backend.fp8_impl=transformer_engine"])
    problems = validate(spec)
    assert any(p.startswith("fp8 vs backend.fp8_impl:") and "Fix: backend.fp8_impl=torchao" in p for p in problems)
    with pytest.raises(ConfigError):
        check(spec)


def test_conflicts_are_data():
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=4", "parallel.zero_stage=1", "parallel.tp=2"])
    mesh, _ = derive_mesh(spec.parallel, spec.cluster)
    conflicts, choices = rules.backend_conflicts(spec, mesh)
    assert choices is None and conflicts
    c = conflicts[0]
    assert (c.feature, c.other) == ("sharding", "tp") and c.fixes and c.reason
    assert c.text().startswith("sharding vs tp: ") and c.text().endswith(".") and "Fix: " in c.text()


def test_world_size_is_derived_in_one_place():
    """`nodes * gpus_per_node` is computed by launcher.config.schema.world_size (the planner's
    launcher.plan.decide.resolve.world_size is that function) and nowhere else."""
    found = []
    for path in (REPO / "launcher").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
                sides = {getattr(s, "attr", getattr(s, "id", None)) for s in (node.left, node.right)}
                if sides == {"nodes", "gpus_per_node"}:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert len(found) == 1 and found[0].startswith("launcher/config/schema.py"), found


DEGREES = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"}


def _product_names(node: ast.AST) -> List[str]:
    """The names (x or obj.x) multiplied in a chain a * b * c."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        return _product_names(node.left) + _product_names(node.right)
    return [getattr(node, "attr", getattr(node, "id", ""))]


def test_the_degrees_and_their_sizes_live_in_one_record():
    """The mesh degrees are declared only by MeshPlan (the plan's record, Layout.mesh) and by
    ParallelConfig (the user's input); world_size and dp are multiplied out only in plan/degrees.py.
    A class field named like a degree anywhere else is a second copy, unless it is typed `str`
    (backend.tp etc. name the backend of a feature, not a degree)."""
    fields, products = [], []
    for path in sorted((REPO / "launcher").rglob("*.py")) + sorted((REPO / "bench").rglob("*.py")):
        where = path.relative_to(REPO)
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for st in cls.body:
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.target.id in DEGREES
                        and ast.unparse(st.annotation) not in ("str", "'str'")):
                    fields.append(f"{where}:{st.lineno} {cls.name}.{st.target.id}")
        inner = {id(c) for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)
                 for c in (n.left, n.right)}
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and id(node) not in inner:
                names = set(_product_names(node))
                if {"dp_replicate", "dp_shard"} <= names or {"pp", "dp", "cp", "tp"} <= names:
                    products.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    owners = {"launcher/plan/degrees.py": "MeshPlan", "launcher/config/schema.py": "ParallelConfig"}
    stray = [f for f in fields if owners.get(f.split(":")[0]) != f.split()[1].split(".")[0]]
    assert not stray, stray
    assert len(fields) == 2 * len(DEGREES), fields  # MeshPlan's and ParallelConfig's, each declared once
    assert products and all(p.startswith("launcher/plan/degrees.py") for p in products), products
    assert len(products) == 2, products  # world_size and dp, once each


def test_each_sub_record_field_is_declared_only_in_its_record():
    """Layout's sub-records (FLAT_RECORDS: mesh, batch, deepspeed, ...) are the only home of their
    fields: Layout and the other plan records (plan/layout.py, plan/degrees.py) declare none of them,
    Layout holds each record under its name, typed by its class, and plan.json's flat keys name one
    field each and keep their names and order (PLAN_KEY_ORDER: the keys before the records)."""
    decls = {}  # class -> field names it declares
    for path in (REPO / "launcher/plan/layout.py", REPO / "launcher/plan/degrees.py"):
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            decls[cls.name] = {st.target.id: ast.unparse(st.annotation) for st in cls.body
                               if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)}
    for name, record in FLAT_RECORDS.items():
        assert decls["Layout"].get(name) == record.__name__, (name, decls["Layout"].get(name))
        for f in dataclasses.fields(record):
            owners = [cls for cls, names in decls.items() if f.name in names]
            assert owners == [record.__name__], f"{f.name} declared by {owners}, expected only {record.__name__}"
    flat = [k for k in Layout().to_dict() if k != "derived"]
    assert len(flat) == len(set(flat)) and Layout.from_dict(Layout().to_dict()) == Layout()
    assert flat[:len(PLAN_KEY_ORDER)] == list(PLAN_KEY_ORDER), flat


RANK_SIDE = ("runtime", "engines", "parallel", "rehearse")
# The config groups a rank must not read: their decisions are in plan.json's layout.
LAYOUT_OWNED_GROUPS = {"precision", "offload", "activation_checkpointing"}


def _is_layout(node: ast.AST) -> bool:
    """`layout`, `lay`, `x.layout`: how the rank side names its Layout."""
    return (isinstance(node, ast.Name) and node.id in ("layout", "lay")) or (
        isinstance(node, ast.Attribute) and node.attr == "layout")


def _is_layout_numerics(node: ast.AST) -> bool:
    """`<layout>.numerics`: the Layout's NumericsPlan, whose `precision` is a plain string."""
    return isinstance(node, ast.Attribute) and node.attr == "numerics" and _is_layout(node.value)


def _layout_owned_reads(tree: ast.AST) -> List[Tuple[int, str]]:
    """(line, code) of every read of the precision/offload/AC config groups: `x.precision` on
    anything but a Layout's numerics, any `x.precision.y` (the Layout's is a plain string, the config's a
    group), `x.offload` / `x.activation_checkpointing` (no Layout field has those names), the
    same through getattr(x, "..."), and the group types PrecisionConfig / OffloadConfig /
    ActivationCheckpointingConfig named at all."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr == "precision" and not _is_layout_numerics(node.value):
                found.append((node.lineno, ast.unparse(node)))
            elif node.attr in LAYOUT_OWNED_GROUPS - {"precision"}:
                found.append((node.lineno, ast.unparse(node)))
            elif isinstance(node.value, ast.Attribute) and node.value.attr == "precision":
                found.append((node.lineno, ast.unparse(node)))
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in LAYOUT_OWNED_GROUPS):
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Name, ast.alias)):
            name = node.id if isinstance(node, ast.Name) else node.name
            if name in ("PrecisionConfig", "OffloadConfig", "ActivationCheckpointingConfig"):
                found.append((node.lineno, name))
    return found


def test_precision_fp8_ac_and_offload_reach_the_rank_only_through_the_layout():
    """Nothing on the rank side (runtime/, engines/, parallel/, rehearse/) reads the precision,
    offload or activation_checkpointing groups of a JobConfig: the resolver copied what the rank
    needs into the Layout (numerics: precision, tf32, fp8_*; memory: offload_*, ac_*), which plan.json carries."""
    offenders = []
    for room in RANK_SIDE:
        for path in sorted((REPO / "launcher" / room).rglob("*.py")):
            offenders += [f"{path.relative_to(REPO)}:{line} {code}"
                          for line, code in _layout_owned_reads(ast.parse(path.read_text()))]
    assert not offenders, offenders
    # The check sees the reads it forbids (so a rename cannot quietly turn it off).
    probe = ast.parse("a = spec.precision.fp8\nb = job.precision\nc = getattr(spec, 'offload')\n"
                      "d = spec.activation_checkpointing.mode\ne = layout.numerics.precision\n"
                      "f = self.layout.numerics.precision\n")
    assert sorted(line for line, _ in _layout_owned_reads(probe)) == [1, 1, 2, 3, 4]


def test_runtime_and_engines_never_read_spec_parallel():
    """The ranks obey plan.json's layout: nothing under runtime/ or engines/ reads the parallel group."""
    offenders = []
    for room in ("runtime", "engines"):
        for path in (REPO / "launcher" / room).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr == "parallel":
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders


def test_cli_reuses_the_prechecked_layout(monkeypatch):
    """`train` checks every job before Hydra runs, then Hydra composes it again: the Layout of the
    pre-check is reused, so the backend rules run once per launch (device rules are re-run)."""
    from launcher import cli
    from launcher.config.loader import compose_spec as compose

    calls = []
    real = rules.backend_conflicts
    monkeypatch.setattr("launcher.plan.decide.resolve.backend_conflicts", lambda s, m: calls.append(m) or real(s, m))
    monkeypatch.setattr(cli, "_PRECHECKED", [])
    overrides = ["+recipe=debug", "cluster.gpus_per_node=2", "action=plan"]
    cli._precheck(overrides)
    spec = compose(overrides)
    spec = dataclasses.replace(spec, trainer=dataclasses.replace(spec.trainer, device="cpu"))  # decided later
    layout = cli._resolved(spec)
    assert len(calls) == 1 and layout == resolve(spec)


@pytest.mark.parametrize("recipe", ["debug", "llama8b", "llama70b", "llama405b", "mixtral8x7b", "qwen3_8b", "qwen3_30b_a3b", "deepseek_v3"])
def test_every_recipe_resolves_to_a_consistent_layout(recipe):
    """Each recipe's Layout: one world size, the batch arithmetic closes, and plan.json reads it back."""
    from launcher.config.store import available_recipes

    assert recipe in available_recipes()
    spec = compose_spec([f"+recipe={recipe}", "action=plan"])
    plan = build_plan(spec, check(spec))
    lay = plan.layout
    assert lay.mesh.world_size == spec.cluster.nodes * spec.cluster.gpus_per_node
    assert lay.global_batch_size == spec.trainer.global_batch_size
    assert lay.pp_microbatches == lay.batch.microbatches == plan.pipeline["microbatches"]
    assert lay.fsdp_wraps == (lay.owners.sharding_backend == "native" and (lay.mesh.dp * lay.mesh.cp > 1 or lay.offload_to_cpu))
    assert Plan.from_dict(json.loads(plan.to_json())).layout == lay


def test_the_node_checks_auto_is_decided_by_the_resolver_and_plan_json_carries_it():
    """trainer.health_check=auto (on with more than one node) and trainer.straggler_action=auto (exclude
    only with a spare node) are decided once, into Layout.resilience; plan.json writes the booleans
    last, and a plan.json written before them loads with both checks off."""
    def resilience(*overrides):
        r = resolve(compose_spec(["+recipe=debug", *overrides])).resilience
        return r.health_check, r.exclude_stragglers

    assert resilience() == (False, False)
    assert resilience("cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1") == (True, False)
    assert resilience("cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1",
                      "cluster.spare_nodes=1") == (True, True)
    assert resilience("trainer.health_check=on", "trainer.straggler_action=exclude") == (True, True)
    assert resilience("cluster=slurm", "cluster.nodes=2", "cluster.gpus_per_node=1", "cluster.spare_nodes=1",
                      "trainer.health_check=off", "trainer.straggler_action=warn") == (False, False)
    lay = resolve(compose_spec(["+recipe=debug", "trainer.health_check=on"]))
    d = lay.to_dict()
    keys = [k for k in d if k != "derived"]  # added after the six numerics/offload keys of the last session
    assert keys.index("health_check") - 1 == keys.index("offload_pin_memory") == keys.index("exclude_stragglers") - 2
    older = {k: v for k, v in d.items() if k not in ("health_check", "exclude_stragglers")}
    assert Layout.from_dict(older).resilience == Layout().resilience
    assert (Layout().resilience.health_check, Layout().resilience.exclude_stragglers) == (False, False)
