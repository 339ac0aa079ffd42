"""`action=search`: every returned layout is valid (the real validator), fits, and is ranked."""

from __future__ import annotations

import dataclasses
import json

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.resolve import validate
from launcher.plan.plan import build_plan
from launcher.plan.report import render_search
from launcher.plan.search import candidate_spec, search_layouts


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
    tps = [c.tokens_per_s_per_gpu for c in cands]
    assert tps == sorted(tps, reverse=True)
    for c in cands:
        chosen = _apply(spec, c.train_overrides)
        assert validate(chosen) == [], c.train_overrides
        assert chosen == candidate_spec(spec, c.layout)
        assert c.memory["total"] <= c.capacity
        # The plan of the chosen layout agrees with the search's estimate.
        plan = build_plan(chosen)
        assert plan.memory["fits"]
        assert plan.time["tokens_per_s_per_gpu"] == pytest.approx(c.tokens_per_s_per_gpu, rel=1e-6)


def test_search_respects_the_global_batch(llama70b):
    spec, cands, _ = llama70b
    for c in cands:
        lay = c.layout
        assert lay.micro_batch_size * lay.microbatches * lay.dp == spec.trainer.global_batch_size


def test_moe_search_uses_expert_parallel():
    spec = compose_spec(["+recipe=mixtral8x7b", "cluster.nodes=4", "action=search"])
    cands = search_layouts(spec, limit=10)
    assert cands, "no layout found for mixtral on 32 GPUs"
    assert any(c.layout.ep > 1 for c in cands)
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
