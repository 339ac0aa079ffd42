"""`action=search`: every returned layout is valid (the real validator), fits, and is ranked."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.config.loader import compose_spec
from launcher.config.schema import get_dotted
from launcher.plan.layout import Layout, MemoryPlan, OVERRIDE_FIELDS, RankBatchPlan
from launcher.plan.degrees import MeshPlan
from launcher.plan.decide.resolve import validate
from launcher.plan.present.plan import build_plan
from launcher.plan.present.report import render_search
from launcher.plan.present.search import candidate_spec, search_layouts


def _apply(spec, overrides: str):
    """Apply a candidate's `key=value` overrides to a spec, as the command line would."""
    for item in overrides.split():
        key, value = item.split("=", 1)
        group, field = key.split(".")
        sub = getattr(spec, group)
        current = getattr(sub, field)
        if isinstance(current, bool):
            parsed = value == "true"
        elif isinstance(current, int):
            parsed = int(value)
        else:
            parsed = value
        spec = dataclasses.replace(spec, **{group: dataclasses.replace(sub, **{field: parsed})})
    return spec


@pytest.fixture(scope="module")
def llama70b():
    spec = compose_spec(["+recipe=llama70b", "cluster.nodes=32", "action=search"])
    stats = {}
    return spec, search_layouts(spec, limit=15, stats=stats), stats


def test_results_are_valid_fit_and_ranked(llama70b):
    spec, cands, stats = llama70b
    assert len(cands) == 15
    assert stats["meshes"] > 100 and stats["states_too_big"] > 0  # it really enumerated and pruned
    # Ranked by tokens/s, after every layout whose whole memory band fits (none here is at risk).
    order = [(c.memory_at_risk, -c.tokens_per_s_per_gpu) for c in cands]
    assert order == sorted(order)
    for c in cands:
        chosen = _apply(spec, c.train_overrides)
        assert validate(chosen) == [], c.train_overrides
        assert chosen == candidate_spec(spec, c.layout)
        assert c.memory["total"] <= c.capacity
        # The plan of the chosen layout agrees with the search's estimate.
        plan = build_plan(chosen)
        assert plan.memory["fits"]
        # One layout <-> overrides map (OVERRIDE_FIELDS): the spec holds the layout's values at
        # the table's keys, and resolving it gives the same layout values back.
        assert {key: get_dotted(chosen, key) for key, _ in OVERRIDE_FIELDS} == c.layout.overrides()
        assert plan.layout.overrides() == c.layout.overrides() and plan.layout.nodes == c.layout.nodes
        assert plan.layout.mesh == c.layout.mesh
        assert plan.time["tokens_per_s_per_gpu"] == pytest.approx(c.tokens_per_s_per_gpu, rel=1e-6)


def test_search_respects_the_global_batch(llama70b):
    spec, cands, _ = llama70b
    for c in cands:
        lay = c.layout
        assert lay.batch.micro_batch_size * lay.batch.microbatches * lay.mesh.dp == spec.trainer.global_batch_size


def test_moe_search_uses_expert_parallel():
    spec = compose_spec(["+recipe=mixtral8x7b", "cluster.nodes=4", "action=search"])
    cands = search_layouts(spec, limit=10)
    assert cands, "no layout found for mixtral on 32 GPUs"
    assert any(c.layout.mesh.ep > 1 for c in cands)
    for c in cands:
        assert validate(candidate_spec(spec, c.layout)) == []


def test_nothing_fits_gives_an_actionable_message():
    spec = compose_spec(["model=llama3_405b", "cluster.nodes=1", "cluster.gpus_per_node=8",
                         "trainer.seq_len=8192", "trainer.global_batch_size=8", "action=search"])
    assert search_layouts(spec, limit=5) == []
    text = render_search([], spec, "text", 10)
    assert "no valid layout fits" in text and "Fix" in text


def test_render_search_text_and_json(llama70b):
    spec, cands, _ = llama70b
    text = render_search(cands, spec, "text", 5)
    assert text.count("train parallel.") == 5
    d = json.loads(render_search(cands, spec, "json", 3))
    assert d["world_size"] == 256 and len(d["candidates"]) == 3
    assert d["candidates"][0]["overrides"].startswith("parallel.")


def test_problem_outside_the_layout_is_raised_not_hidden():
    from launcher.config.errors import ConfigError

    # The recipe reads token shards; action=run needs data.path, which no layout can fix.
    spec = compose_spec(["+recipe=llama70b", "cluster.nodes=32", "action=run"])
    with pytest.raises(ConfigError, match="data.path"):
        search_layouts(spec, limit=5)


# ----------------------------------------------------------------------------- plan.objective

OBJECTIVE_ARGS = ["model=llama3_8b", "cluster.gpus_per_node=8", "plan.search_nodes=[1,2,4]", "trainer.seq_len=8192",
                  "trainer.global_batch_size=64", "trainer.tokens=1000000000000", "hardware.usd_per_gpu_hour=2.5",
                  "action=search"]
# What each objective's table column holds (from the candidate's own budget), best first = ascending.
OBJECTIVE_COLUMN = {
    "throughput": lambda c: -c.tokens_per_s_per_gpu,
    "time": lambda c: c.budget["wall_s"],
    "cost": lambda c: c.budget["usd"],
}


@pytest.fixture(scope="module")
def by_objective():
    out = {}
    for objective in OBJECTIVE_COLUMN:
        spec = compose_spec(OBJECTIVE_ARGS + [f"plan.objective={objective}"])
        out[objective] = (spec, search_layouts(spec, limit=8))
    return out


def test_each_objective_ranks_by_its_own_column(by_objective):
    for objective, (spec, cands) in by_objective.items():
        assert len(cands) == 8, objective
        column = [(c.memory_at_risk, OBJECTIVE_COLUMN[objective](c)) for c in cands]
        assert column == sorted(column), objective
        # The figures are the plan's: the chosen layout planned alone gives the same budget.
        for c in cands[:2]:
            chosen = _apply(spec, c.train_overrides)
            assert validate(chosen) == [], c.train_overrides
            b = build_plan(chosen).budget
            assert b["tokens"] >= spec.trainer.tokens
            for key in ("steps", "wall_s", "gpu_hours", "usd"):
                assert b[key] == pytest.approx(c.budget[key], rel=1e-6), (objective, key)


def test_more_gpus_finish_sooner_but_cost_more(by_objective):
    """Across node counts the orders must differ: the fastest layout to the budget uses more GPUs
    than the cheapest one, and pays for them."""
    cheapest, fastest = by_objective["cost"][1][0], by_objective["time"][1][0]
    assert fastest.layout.mesh.world_size > cheapest.layout.mesh.world_size
    assert fastest.budget["wall_s"] < cheapest.budget["wall_s"]
    assert fastest.budget["usd"] > cheapest.budget["usd"]
    order = {o: [c.train_overrides for c in cands] for o, (_, cands) in by_objective.items()}
    assert order["time"] != order["cost"]
    assert {c.layout.nodes for _, cands in by_objective.values() for c in cands} > {1}
    for o, (_, cands) in by_objective.items():
        assert all(f"cluster.nodes={c.layout.nodes}" in c.train_overrides for c in cands), o


def test_objective_column_in_the_table(by_objective):
    for objective, head in (("time", "wall h"), ("cost", "USD")):
        spec, cands = by_objective[objective]
        text = render_search(cands, spec, "text", 3)
        assert f"plan.objective={objective}" in text and head in text.splitlines()[1]
        d = json.loads(render_search(cands, spec, "json", 3))
        assert d["objective"] == objective and d["candidates"][0]["budget"]["wall_s"] > 0
    spec, cands = by_objective["cost"]
    best = cands[0].budget
    assert f"{best['usd']:,.0f} ({best['usd_range'][0]:,.0f}-{best['usd_range'][1]:,.0f})" in render_search(
        cands, spec, "text", 1)


# llama3_8b on 8 GPUs of 64 GiB: the fastest layouts' point estimates fit (with the 5 % headroom)
# but their memory bands' upper ends do not (2026-11-27: 60.7 GiB, band up to 70.2 GiB).
AT_RISK_ARGS = ["model=llama3_8b", "cluster.gpus_per_node=8", "trainer.seq_len=8192", "trainer.global_batch_size=64",
                "hardware.memory_gb=64", "trainer.tokens=1000000000000", "hardware.usd_per_gpu_hour=2.5",
                "action=search"]


@pytest.mark.parametrize("objective", list(OBJECTIVE_COLUMN))
def test_a_layout_that_may_run_out_of_memory_ranks_after_every_one_that_fits(objective):
    """A layout whose point estimate fits but whose memory band's upper end exceeds the GPU is kept,
    marked "at risk" (text and JSON), and ranked after every layout whose whole band fits, even
    when plan.objective alone would rank it first."""
    spec = compose_spec(AT_RISK_ARGS + [f"plan.objective={objective}"])
    gpu = 64 * 2**30
    cands = search_layouts(spec, limit=200)
    risky = [c for c in cands if c.memory_at_risk]
    safe = [c for c in cands if not c.memory_at_risk]
    assert risky and safe
    assert cands == safe + risky  # every fitting band first
    for group in (safe, risky):
        column = [OBJECTIVE_COLUMN[objective](c) for c in group]
        assert column == sorted(column), objective
    # Without the band the objective would have put an at-risk layout first.
    best_by_objective = min(cands, key=OBJECTIVE_COLUMN[objective])
    assert best_by_objective.memory_at_risk
    assert OBJECTIVE_COLUMN[objective](best_by_objective) < OBJECTIVE_COLUMN[objective](cands[0])
    for c in risky:
        assert c.gpu_capacity == gpu and c.fits == "at risk"
        assert c.memory["total"] <= c.capacity < gpu < c.memory_total_range[1]
    for c in safe:
        assert c.fits == "yes" and c.memory_total_range[1] <= gpu
    # The mark in the table and in the JSON.
    shown = safe[:2] + risky[:2]
    text = render_search(shown, spec, "text", 4)
    rows = [line.split() for line in text.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ", "4 ")]
    assert [r[0] for r in rows] == ["1", "2", "3", "4"]
    assert ["at risk" in " ".join(r) for r in rows] == [False, False, True, True]
    assert "fits" in text.splitlines()[1] and all("yes" in r for r in rows[:2])
    assert "at risk (#3, #4): the upper end of the memory range exceeds the GPU's 64.0 GiB" in text
    d = json.loads(render_search(shown, spec, "json", 4))
    assert [c["fits"] for c in d["candidates"]] == ["yes", "yes", "at risk", "at risk"]
    assert all(c["gpu_capacity"] == gpu for c in d["candidates"])
    assert d["candidates"][2]["memory_total_range"][1] > gpu >= d["candidates"][2]["memory"]["total"]


def test_objective_values_are_checked_before_the_search():
    problems = validate(compose_spec(["model=llama3_8b", "action=search", "plan.objective=money"]))
    assert any("plan.objective='money'" in p and "throughput, cost, time" in p and "Fix" in p for p in problems)
    # Cost needs a price: refused before any layout is enumerated, naming the key to set.
    problems = validate(compose_spec(["model=llama3_8b", "action=search", "plan.objective=cost"]))
    assert any("Fix: hardware.usd_per_gpu_hour=" in p for p in problems)
    assert validate(compose_spec(["model=llama3_8b", "action=search", "plan.objective=time"])) == []


def test_the_override_map_writes_every_layout_key_into_the_spec():
    """candidate_spec writes each OVERRIDE_FIELDS value (and the node count) into a copy of the
    spec, and Layout.overrides() reads the same values: a layout whose every table value differs
    from the recipe's comes back whole, and the user's spec is left as it was."""
    spec = compose_spec(["+recipe=debug"])
    before = {key: get_dotted(spec, key) for key, _ in OVERRIDE_FIELDS}
    lay = Layout(
        mesh=MeshPlan(pp=2, dp_replicate=2, dp_shard=3, cp=2, tp=2, ep=3),
        sp=True,
        vpp=2,
        schedule="zbv",
        memory=MemoryPlan(zero_stage=1, ac_mode="full"),
        batch=RankBatchPlan(micro_batch_size=5),
        nodes=7,
    )
    assert all(before[key] != lay.value_at(path) for key, path in OVERRIDE_FIELDS), before
    chosen = candidate_spec(spec, lay)
    assert {key: get_dotted(chosen, key) for key, _ in OVERRIDE_FIELDS} == lay.overrides()
    assert {key: lay.value_at(path) for key, path in OVERRIDE_FIELDS} == lay.overrides()
    assert chosen.cluster.nodes == 7 and (chosen.parallel.pp_layers, chosen.parallel.microbatches) == ([], -1)
    assert {key: get_dotted(spec, key) for key, _ in OVERRIDE_FIELDS} == before


def test_context_parallel_with_pipelining_is_searched_for_long_rows_only():
    """CP x PP candidates (all-gather CP under a pipeline schedule) are in the search where each CP
    rank keeps at least CP_WITH_PP_MIN_TOKENS of a row, and left out below it (the search's size)."""
    from launcher.plan.present.search import CP_WITH_PP_MIN_TOKENS, mesh_options

    def pairs(seq_len: int) -> set:
        spec = compose_spec(["+recipe=llama70b", "cluster.nodes=32", "action=search", f"trainer.seq_len={seq_len}",
                             f"model.max_seq_len={seq_len}"])
        return {(cp, pp) for _, cp, pp, *_ in mesh_options(spec) if cp > 1 and pp > 1}

    long = pairs(131072)
    assert (16, 2) in long and all(131072 // cp >= CP_WITH_PP_MIN_TOKENS for cp, _ in long)
    assert pairs(8192) == set()
