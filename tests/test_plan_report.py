"""`action=plan` output: the JSON schema, the text tables, the plots, and the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.present.plan import Plan, build_plan
from launcher.plan.present.report import render_plan

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("train"))
MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "other", "total", "capacity", "fits")


@pytest.fixture(scope="module")
def planned():
    spec = compose_spec(["+recipe=llama70b", "cluster.nodes=16"])
    return build_plan(spec), spec


def test_json_schema(planned):
    plan, spec = planned
    d = json.loads(render_plan(plan, spec, "json"))
    assert d["world_size"] == 128
    assert set(d["mesh"]) >= {"pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"}
    assert d["mesh"]["tp"] == 8 and d["mesh"]["dp_shard"] == 16
    assert d["params_total"] == 70_553_706_496
    for feature, choice in d["backends"].items():
        assert set(choice) >= {"backend", "impl", "reason"}, feature
    for key in MEMORY_KEYS:
        assert key in d["memory"], key
    assert isinstance(d["memory"]["fits"], bool)
    parts = sum(d["memory"][k] for k in ("params", "grads", "optimizer", "activations", "other"))
    assert d["memory"]["total"] == parts
    assert d["memory"]["capacity"] == 80 * 1024**3
    assert 0 <= d["pipeline"]["bubble_fraction"] < 1
    t = d["time"]
    assert t["step_s"] > 0 and t["tokens_per_s_per_gpu"] > 0 and 0 < t["mfu"] < 1
    # plan.json round-trips through Plan.from_dict (the runtime reads it back).
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again.memory["total"] == plan.memory["total"]


def test_text_has_every_section(planned):
    plan, spec = planned
    text = render_plan(plan, spec, "text")
    for needle in ("Mesh", "Backends", "Memory per GPU", "verdict: FITS", "Communication per step",
                   "intra-node", "Time per step", "tokens/s per GPU", "MFU"):
        assert needle in text, needle
    with pytest.raises(ValueError, match="plan.format"):
        render_plan(plan, spec, "yaml")


def test_memory_rows_say_what_exists_at_the_peak():
    # One micro-batch of llama3_8b on 8 GPUs: the peak is the loss's backward, before any gradient
    # is born. The grads row says so with the gradients held for the optimizer step, and "other"
    # lists only the parts it adds up (plan.json: memory.peak_phase, per_pp_rank's maxima).
    spec = compose_spec(["+recipe=llama8b", "trainer.global_batch_size=8"])
    plan = build_plan(spec)
    mem = plan.memory
    assert mem["peak_phase"] == "loss" and mem["grads"] == 0 < mem["detail"]["grads_held"]
    row = mem["per_pp_rank"][0]
    assert row["grads_held"] == mem["detail"]["grads_held"] and row["activations_max"] >= row["activations"]
    lines = {line.split()[0]: line for line in render_plan(plan, spec, "text").splitlines()
             if line.split() and line.split()[0] in ("grads", "other")}
    assert "none yet at this peak" in lines["grads"]
    assert "logits_transient" in lines["other"]
    assert not any(k in lines["other"] for k in ("grads_held", "backward_workspace", "recomputed_block"))


def test_verdict_says_at_risk_when_the_memory_band_reaches_past_the_gpu(planned):
    """The point estimate fits, the upper end of the measured band does not (llama3_8b, FSDP 4 x
    TP 2 on 64 GiB GPUs: 60.7 GiB planned, up to 70.2 GiB for 2D layouts): FITS, but AT RISK, with
    the numbers; a plan whose whole band fits says FITS alone."""
    spec = compose_spec(["model=llama3_8b", "cluster.gpus_per_node=8", "trainer.seq_len=8192",
                         "trainer.global_batch_size=64", "hardware.memory_gb=64", "parallel.dp_shard=4", "parallel.tp=2",
                         "parallel.sp=true", "parallel.zero_stage=3", "activation_checkpointing.mode=none",
                         "trainer.micro_batch_size=1"])
    plan = build_plan(spec)
    low, high = plan.memory["total_range"]
    assert plan.memory["fits"] and plan.memory["total"] <= 64 * 2**30 < high
    verdict = next(line for line in render_plan(plan, spec, "text").splitlines() if "verdict:" in line)
    assert verdict.strip().startswith("verdict: FITS with") and "but AT RISK" in verdict
    assert f"reach {high / 2**30:.2f} GiB, over the GPU's 64.00 GiB" in verdict
    fitting_plan, fitting_spec = planned
    assert fitting_plan.memory["total_range"][1] <= fitting_plan.memory["capacity"]
    assert "AT RISK" not in render_plan(fitting_plan, fitting_spec, "text")


def test_moe_under_tp_folds_experts_and_the_plan_costs_each_token_once():
    """Experts folded over TP (each TP rank routes its own 1/tp of the tokens): against the same
    layout replicated over TP, the plan gives each rank half the routed rows per expert, half the
    EP all-to-all bytes (spread over the ranks of dp_shard*cp*tp) and half the MoE activations, and
    no longer warns that the experts are computed on every TP rank."""
    import dataclasses

    from launcher.plan.estimate.memory import layer_activation_bytes
    from launcher.plan.estimate.params import model_shape, stage_params
    from launcher.plan.estimate.perf import estimate_comm, expert_rows

    spec = compose_spec(["+recipe=mixtral8x7b", "parallel.tp=2", "parallel.dp_shard=-1", "parallel.ep=8"])
    plan = build_plan(spec)
    folded = plan.layout
    assert folded.experts_folded and folded.mesh.tp == 2
    assert not any("replicated on every TP rank" in w for w in plan.warnings)
    replicated = dataclasses.replace(folded, experts_folded=False)
    shape = model_shape(spec.model)
    st = stage_params(shape, folded.mesh.pp)[0]
    hw = spec.hardware
    assert expert_rows(shape, folded) == expert_rows(shape, replicated) / 2
    assert layer_activation_bytes(shape, folded, True, "none") < layer_activation_bytes(shape, replicated, True, "none")

    def a2a(lay):
        cs = [c for c in estimate_comm(shape, lay, hw, st) if c.collective == "all_to_all"]
        return sum(c.bytes_per_step for c in cs), {c.group for c in cs}

    (fb, fg), (rb, rg) = a2a(folded), a2a(replicated)
    assert fb == pytest.approx(rb / 2) and fg == {"dp_shard*cp*tp"} and rg == {"dp_shard*cp"}


def test_does_not_fit_is_reported_with_fixes():
    spec = compose_spec(["+recipe=llama70b", "cluster.nodes=1", "parallel.zero_stage=0",
                         "trainer.global_batch_size=8", "activation_checkpointing=none"])
    plan = build_plan(spec)
    assert plan.memory["fits"] is False and plan.memory["margin"] < 0
    assert any("does not fit" in w and "Fix:" in w for w in plan.warnings)
    assert "DOES NOT FIT" in render_plan(plan, spec, "text")


def test_more_gpus_less_memory_per_gpu():
    small = build_plan(compose_spec(["+recipe=llama70b", "cluster.nodes=4", "trainer.global_batch_size=256"]))
    large = build_plan(compose_spec(["+recipe=llama70b", "cluster.nodes=32", "trainer.global_batch_size=256"]))
    assert large.memory["params"] < small.memory["params"]
    assert large.memory["optimizer"] == pytest.approx(small.memory["optimizer"] / 8, rel=1e-3)


def test_plots_are_pngs(planned, tmp_path):
    from launcher.plan.present.plots import save_plan_plots

    plan, spec = planned
    paths = save_plan_plots(plan, spec, tmp_path)
    assert [p.name for p in paths] == ["plan_memory.png", "plan_pipeline.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_charts_of_the_same_figures_are_kept_and_other_figures_redrawn(planned, tmp_path):
    """A relaunch into the run dir (resume, restart) keeps charts drawn from the same figures;
    another plan, or a chart gone missing, draws them again."""
    from launcher.plan.present.plots import save_plan_plots

    plan, spec = planned
    paths = save_plan_plots(plan, spec, tmp_path)
    for p in paths:
        p.write_bytes(b"kept")  # a redraw would overwrite it
    assert save_plan_plots(plan, spec, tmp_path) == paths and all(p.read_bytes() == b"kept" for p in paths)
    other = build_plan(compose_spec(["+recipe=llama70b", "cluster.nodes=8"]))
    save_plan_plots(other, spec, tmp_path)
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    paths[1].write_bytes(b"kept")
    paths[0].unlink()
    save_plan_plots(other, spec, tmp_path)
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_pipeline_schedule_blocks_show_the_bubble():
    from launcher.plan.present.plots import schedule_blocks

    p, m = 4, 8
    blocks = schedule_blocks(p, m, "1f1b")
    assert [len(r) for r in blocks] == [2 * m] * p  # every stage runs m forwards and m backwards
    end = max(s + (1 if k == "F" else 2) for r in blocks for k, _, _, s in r)
    assert (end - 3 * m) / (3 * m) == pytest.approx((p - 1) / m)  # (p-1)/m bubble
    first = blocks[0]
    assert [k for k, *_ in first[:4]] == ["F"] * 4  # warm-up on the first stage


def test_train_action_plan_json_command(tmp_path):
    proc = subprocess.run(
        [TRAIN, "+recipe=llama405b", "action=plan", "cluster.nodes=1024", "trainer.global_batch_size=2048",
         "plan.format=json", "plan.plots=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout)
    assert d["world_size"] == 8192 and d["params_total"] == 405_853_388_800


def test_token_budget_sets_the_steps_and_the_plan_gives_time_and_cost_with_ranges():
    """trainer.tokens decides trainer.steps (rounded up to whole steps); the plan prints the wall
    time, GPU-hours and dollars to it, each with the range the accuracy rows of this kind of
    layout give; without a price there is no dollar figure."""
    overrides = ["+recipe=llama70b", "cluster.nodes=16", "trainer.tokens=15000000000000"]
    spec = compose_spec(overrides + ["hardware.usd_per_gpu_hour=2.5"])
    per_step = spec.trainer.global_batch_size * spec.trainer.seq_len
    assert spec.trainer.steps == -(-15_000_000_000_000 // per_step) and spec.trainer.steps * per_step >= 15e12
    plan = build_plan(spec)
    d = json.loads(render_plan(plan, spec, "json"))
    b, t, mem = d["budget"], d["time"], d["memory"]
    assert set(b) >= {"tokens", "steps", "wall_s", "wall_s_range", "gpu_hours", "usd", "usd_range"}
    assert b["steps"] == spec.trainer.steps and b["tokens"] == spec.trainer.steps * per_step
    assert b["wall_s"] == pytest.approx(b["steps"] * t["step_s"])
    assert b["gpu_hours"] == pytest.approx(b["wall_s"] * 128 / 3600)
    assert b["usd"] == pytest.approx(b["gpu_hours"] * 2.5)
    # The ranges: the step time scaled by the fsdp+tp ("2d") band's predicted/measured ratios.
    from launcher.plan.estimate.bands import ratio_band

    lo, hi, measured = ratio_band("2d", "time")
    assert measured and t["band"]["kind"] == "2d"
    assert t["step_s_range"] == pytest.approx([t["step_s"] * lo, t["step_s"] * hi])
    assert b["wall_s_range"] == pytest.approx([b["steps"] * x for x in t["step_s_range"]])
    assert b["usd_range"] == pytest.approx([h * 2.5 for h in b["gpu_hours_range"]])
    assert b["usd_range"][0] < b["usd_range"][1]
    assert mem["total_range"][0] < mem["total_range"][1]
    text = render_plan(plan, spec, "text")
    assert f"{b['steps']:,} steps" in text and f"${b['usd']:,.0f}" in text and "GPU-hours" in text
    assert f"step                   {t['step_s']:.3f} ({t['step_s_range'][0]:.3f}-{t['step_s_range'][1]:.3f})" in text
    unpriced = compose_spec(overrides)
    assert build_plan(unpriced).budget["usd"] is None
    assert "set hardware.usd_per_gpu_hour for the cost" in render_plan(build_plan(unpriced), unpriced, "text")


def test_unmeasured_kinds_get_a_wider_band_and_say_so():
    """MoE layouts have measured step-time and memory rows (torchtitan's DeepSeek-V3 on 512 H100s
    published its peak): both bands are the rows'. A figure without rows (MoE memory before those
    rows: the table without it) gets a band wider than any measured one, and a kind without any
    row gets the widened band for both figures."""
    from launcher.plan.estimate.bands import BANDS, ratio_band

    spec = compose_spec(["+recipe=mixtral8x7b"])
    plan = build_plan(spec)
    assert plan.time["band"] == {**plan.time["band"], "kind": "moe", "measured": True, "memory_measured": True,
                                 "rows": BANDS["moe"]["rows"]}
    assert ratio_band("moe", "time")[:2] == BANDS["moe"]["time"]
    lo, hi, measured = ratio_band("moe", "memory")
    assert measured and lo <= BANDS["moe"]["memory"][0] and hi >= BANDS["moe"]["memory"][1]
    assert "memory: no measured moe row yet" not in render_plan(plan, spec, "text")
    no_moe_memory = {k: ({kk: vv for kk, vv in v.items() if kk != "memory"} if k == "moe" else v)
                     for k, v in BANDS.items()}
    lo, hi, measured = ratio_band("moe", "memory", no_moe_memory)
    measured_memory = [b["memory"] for b in no_moe_memory.values() if "memory" in b]
    assert not measured and lo < min(m[0] for m in measured_memory) and hi > max(m[1] for m in measured_memory)
    without_cp = {k: v for k, v in BANDS.items() if k != "cp"}
    lo, hi, measured = ratio_band("cp", "time", without_cp)
    assert not measured and lo < min(b["time"][0] for b in without_cp.values())
    assert hi > max(b["time"][1] for b in without_cp.values())


def test_planner_never_imports_torch():
    code = ("import sys; from launcher.config.loader import compose_spec; from launcher.plan.present.plan import build_plan; "
            "from launcher.plan.present.report import render_plan; from launcher.plan.present.search import search_layouts; "
            "s = compose_spec(['+recipe=llama405b', 'cluster.nodes=1024', 'trainer.global_batch_size=2048']); render_plan(build_plan(s), s, 'json'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
