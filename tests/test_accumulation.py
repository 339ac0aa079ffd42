"""FSDP2 gradient accumulation held unsharded (parallel.accumulate_unsharded).

Measured: the all-gathers and reduce-scatters of one step in a real 2-rank gloo run
(tests/accumulation_harness/count_collectives.py); resolved: the Layout field, its rules and
its plan.json round trip; planned: memory.py and perf.py follow the field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.errors import ConfigError
from launcher.config.loader import compose_spec
from launcher.plan.layout import Layout, MemoryPlan, NumericsPlan, RankBatchPlan
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.memory import estimate_memory
from launcher.plan.estimate.params import model_shape, stage_params
from launcher.plan.estimate.perf import estimate_comm
from launcher.plan.present.plan import Plan, build_plan
from launcher.plan.decide.resolve import check, resolve, resolve_accumulate_unsharded

REPO = Path(__file__).resolve().parents[1]
HW = compose_spec([]).hardware
SHAPE = model_shape(compose_spec(["model=llama3_8b"]).model)


# ----------------------------------------------------------------------------- measured


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("accum") / "counts.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TMPDIR=str(out.parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "accumulation_harness" / "count_collectives.py"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_unsharded_accumulation_communicates_once_per_step(counts, zero_stage):
    two, four = counts[f"zero{zero_stage}_true_2"], counts[f"zero{zero_stage}_true_4"]
    for kind in ("all_gather", "reduce_scatter"):
        assert two[kind] == four[kind] > 0, (kind, two, four)
    # One of each per FSDP unit (4 blocks + root of the debug model).
    assert two["all_gather"] == two["reduce_scatter"] == 5


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_sharded_accumulation_communicates_per_micro_batch(counts, zero_stage):
    two, four = counts[f"zero{zero_stage}_false_2"], counts[f"zero{zero_stage}_false_4"]
    for kind in ("all_gather", "reduce_scatter"):
        assert four[kind] == 2 * two[kind] > counts[f"zero{zero_stage}_true_2"][kind], (kind, two, four)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_losses_do_not_depend_on_holding_unsharded(counts, zero_stage):
    for micro in (2, 4):
        held, sharded = counts[f"zero{zero_stage}_true_{micro}"], counts[f"zero{zero_stage}_false_{micro}"]
        assert held["loss"] == pytest.approx(sharded["loss"], rel=1e-6)


# ----------------------------------------------------------------------------- resolved


def _spec(*overrides: str):
    return compose_spec(["+recipe=debug", "cluster.gpus_per_node=2", "trainer.device=cpu",
                         "trainer.micro_batch_size=1", "trainer.global_batch_size=8", *overrides])


@pytest.mark.parametrize("value,expected", [("true", True), ("false", False), ("auto", True)])
def test_the_key_resolves_into_the_layout(value, expected):
    lay = resolve(_spec(f"parallel.accumulate_unsharded={value}"))
    assert lay.batch.microbatches == 4 and lay.memory.accumulate_unsharded is expected
    assert lay.fsdp_holds_unsharded is expected


def test_auto_keeps_sharded_accumulation_when_it_does_not_fit():
    # The debug model on 2 ranks: about 6.1 MB per GPU sharded, 6.9 MB held unsharded (fp32;
    # 0.0062 GiB = 6.66 MB).
    spec = _spec("parallel.accumulate_unsharded=auto", "hardware.memory_gb=0.0062", "hardware.reserved_gb=0")
    lay = resolve(spec)
    held, why = resolve_accumulate_unsharded(spec, lay)
    assert lay.memory.accumulate_unsharded is False and held is False and "hardware.memory_gb=0.0062" in why
    roomy = _spec("parallel.accumulate_unsharded=auto", "hardware.memory_gb=0.0075", "hardware.reserved_gb=0")
    assert resolve(roomy).memory.accumulate_unsharded is True


@pytest.mark.parametrize("overrides,reason", [
    (["trainer.global_batch_size=2"], "one micro-batch"),
    (["cluster.gpus_per_node=4", "parallel.pp=2", "parallel.pp_schedule=gpipe"], "pipeline schedules"),
    (["backend.sharding=deepspeed"], "DeepSpeed"),
    (["offload.optimizer=cpu"], "offload"),
])
def test_layouts_that_cannot_hold_unsharded_resolve_false_and_say_why(overrides, reason):
    spec = _spec("parallel.accumulate_unsharded=true", *overrides)
    lay = resolve(spec)
    held, why = resolve_accumulate_unsharded(spec, lay)
    assert lay.memory.accumulate_unsharded is False and held is False and reason in why


def test_bad_choice_is_one_line_with_a_fix():
    with pytest.raises(ConfigError) as err:
        check(_spec("parallel.accumulate_unsharded=sometimes"))
    lines = [p for p in err.value.problems if "accumulate_unsharded" in p]
    assert len(lines) == 1 and "Fix:" in lines[0] and "'sometimes'" in lines[0]


def test_the_field_round_trips_through_plan_json(tmp_path):
    spec = _spec("parallel.accumulate_unsharded=true", "action=plan")
    plan = build_plan(spec, check(spec))
    plan.save(tmp_path)
    d = json.loads((tmp_path / "plan.json").read_text())["layout"]
    assert d["accumulate_unsharded"] is True and d["derived"]["fsdp_holds_unsharded"] is True
    back = Plan.load(tmp_path).layout
    assert back == plan.layout and back.memory.accumulate_unsharded is True


# ----------------------------------------------------------------------------- planned


BASE = Layout(mesh=MeshPlan(dp_shard=8), batch=RankBatchPlan(microbatches=8), numerics=NumericsPlan(precision="bf16"), gpus_per_node=8, memory=MemoryPlan(zero_stage=3))


def _fsdp_comm(lay: Layout) -> dict:
    st = stage_params(SHAPE, 1)[0]
    out: dict = {}
    for c in estimate_comm(SHAPE, lay, HW, st):
        if "param all-gather" in c.name or "grad reduce-scatter" in c.name:
            kind = "all_gather" if "all-gather" in c.name else "reduce_scatter"
            out[kind] = out.get(kind, 0.0) + c.bytes_per_step
    return out


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_comm_is_counted_once_per_step_when_held(zero_stage):
    sharded = dataclasses.replace(BASE, memory=dataclasses.replace(BASE.memory, zero_stage=zero_stage))
    held = dataclasses.replace(sharded, memory=dataclasses.replace(sharded.memory, accumulate_unsharded=True))
    one_mb = dataclasses.replace(sharded, batch=dataclasses.replace(sharded.batch, microbatches=1))
    # Held: what a single micro-batch costs, whatever the accumulation; else once per micro-batch.
    assert _fsdp_comm(held)["reduce_scatter"] == pytest.approx(_fsdp_comm(one_mb)["reduce_scatter"])
    assert _fsdp_comm(sharded)["reduce_scatter"] == pytest.approx(8 * _fsdp_comm(one_mb)["reduce_scatter"])
    gathers_per_mb = 2 if zero_stage == 3 else 1  # ZeRO-3 gathers again for the backward
    assert _fsdp_comm(sharded)["all_gather"] == pytest.approx(8 * _fsdp_comm(held)["all_gather"] * gathers_per_mb)


def test_memory_holds_unsharded_params_and_grads_when_held():
    sharded, held = BASE, dataclasses.replace(BASE, memory=dataclasses.replace(BASE.memory, accumulate_unsharded=True))
    m_sharded, m_held = estimate_memory(SHAPE, sharded)[0], estimate_memory(SHAPE, held)[0]
    local = SHAPE.total  # tp = ep = pp = 1: every parameter of the model, unsharded
    assert m_held.detail["unsharded_params"] == pytest.approx(local * 2, rel=1e-6)  # bf16
    # FSDP2 accumulates the gradients it does not reduce yet in reduce_dtype (fp32 here).
    assert m_held.detail["unsharded_grads"] == pytest.approx(local * 4, rel=1e-6)
    assert m_sharded.detail["unsharded_params"] < m_held.detail["unsharded_params"] / 4  # 2 units of 32 blocks
    assert m_held.total > m_sharded.total
    # Sharded states (the fp32 master, m, v) are the same either way.
    assert (m_held.params, m_held.optimizer) == (m_sharded.params, m_sharded.optimizer)


def test_the_plan_says_why_true_was_not_applied():
    spec = _spec("parallel.accumulate_unsharded=true", "backend.sharding=deepspeed", "action=plan")
    plan = build_plan(spec, check(spec))
    notes = [w for w in plan.warnings if "accumulate_unsharded" in w]
    assert len(notes) == 1 and "DeepSpeed" in notes[0] and "Fix:" in notes[0]
    quiet = _spec("parallel.accumulate_unsharded=true", "action=plan")
    assert not [w for w in build_plan(quiet, check(quiet)).warnings if "accumulate_unsharded" in w]


def test_search_plans_what_the_resolver_will_run():
    """The search evaluates each candidate with accumulate_unsharded as the resolver resolves it."""
    from launcher.plan.present.search import candidate_spec, search_layouts

    spec = compose_spec(["model=llama_1b", "cluster.nodes=2", "cluster.gpus_per_node=8",
                         "trainer.seq_len=4096", "trainer.global_batch_size=512", "action=search"])
    cands = search_layouts(spec, limit=10)
    assert any(c.layout.memory.accumulate_unsharded for c in cands)
    for c in cands:
        assert resolve(candidate_spec(spec, c.layout)).memory.accumulate_unsharded == c.layout.memory.accumulate_unsharded
