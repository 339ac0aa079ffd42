"""`action=rehearse`: every recipe's ranks built at the real world size on a fake process group.

Each rehearsed rank is a real process of its own (forked from one server process that imported
torch once) running the real engine code (launcher/rehearse/rank.py) on fake tensors; nothing
is mocked. The comparison with real multi-process runs is in tests/test_parallel_layouts.py
(test_rehearsal_holds_what_the_real_ranks_hold).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec, save_spec
from launcher.rehearse.driver import rehearsal_problems, rehearse
from launcher.plan.present.plan import build_plan
from launcher.rehearse.ranks import rehearsal_ranks

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
ROW_KEYS = {"rank", "coords", "params_numel", "memory", "predicted", "error"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "peak"}

pytestmark = pytest.mark.multiprocess


def _rehearse(overrides, run_dir: Path, layout=None):
    spec = compose_spec(overrides)
    plan = build_plan(spec, layout)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    plan.save(run_dir)
    return spec, plan, rehearse(spec, plan, run_dir)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_rehearses_at_its_real_world_size(recipe, tmp_path):
    """The auto ranks of each recipe build at the recipe's own world size, and each holds exactly
    the parameter, gradient and optimizer-state bytes the plan predicts for it."""
    spec, plan, result = _rehearse([f"+recipe={recipe}", "action=rehearse", "rehearse.activations=false"], tmp_path)
    assert result["world_size"] == spec.cluster.nodes * spec.cluster.gpus_per_node == plan.world_size
    assert result["ok"], rehearsal_problems(result, plan.layout)
    lay = plan.layout
    ranks = [row["rank"] for row in result["ranks"]]
    assert ranks == rehearsal_ranks(lay, "auto")
    assert {row["coords"]["pp"] for row in result["ranks"]} == set(range(lay.mesh.pp)), "a pipeline rank was skipped"
    for row in result["ranks"]:
        assert set(row) == ROW_KEYS and set(row["memory"]) == MEMORY_KEYS
        held = {k: row["memory"][k] for k in ("params", "grads", "optimizer")}
        predicted = {k: row["predicted"][k] for k in ("params", "grads", "optimizer")}
        assert held == predicted, f"{recipe} rank {row['rank']} {row['coords']}: rehearsal {held} != plan {predicted}"
        assert row["params_numel"] * (2 if lay.numerics.precision == "fp32" else 1) > 0


def _tp_attention_overrides(family: str) -> list:
    from tests.deepspeed_harness.common import model_overrides
    from tests.parallel_harness.matrix import DEEPSEEK_V3

    if family == "deepseek_v3":  # MLA: wq_a, wkv_a, q_norm, kv_norm whole on every TP rank
        return ["model=debug_moe", *model_overrides(DEEPSEEK_V3)]
    return ["model.family=qwen3", "model.qk_norm=true"]  # per-head QK norms


@pytest.mark.parametrize("family,optimizer", [("deepseek_v3", "muon"), ("qwen3", "adamw")])
def test_attention_weights_tp_leaves_whole_are_planned_whole(family, optimizer, tmp_path):
    """Under tp=2 (FSDP over the other 2 of 4 ranks) each rank holds the attention weights its
    family's TP plan does not split (MLA's down-projections and latent norms, Qwen3's QK norms)
    whole: the plan's parameter, gradient and optimizer bytes for rank 0 are what the rehearsed
    rank holds (before the planner counted them, the plan was 14,528 B short per rank for this MLA
    and 128 B for the QK norms), with Muon on MLA's matrices (the momentum of a whole matrix is
    not divided by tp either)."""
    groups = ["optim.groups=[{match: '\\.attention\\.w', optimizer: muon}]"] if optimizer == "muon" else []
    spec, plan, result = _rehearse(["+recipe=debug", *_tp_attention_overrides(family), "cluster.gpus_per_node=4",
                                    "parallel.tp=2", "parallel.dp_shard=2", "action=rehearse", "rehearse.ranks=[0]",
                                    "rehearse.activations=false", *groups], tmp_path)
    assert plan.layout.mesh.tp == 2 and result["ok"], rehearsal_problems(result, plan.layout)
    assert bool(plan.layout.numerics.muon_matrices) == (optimizer == "muon")
    (row,) = result["ranks"]
    held = {k: row["memory"][k] for k in ("params", "grads", "optimizer")}
    predicted = {k: row["predicted"][k] for k in ("params", "grads", "optimizer")}
    assert held == predicted, f"{family} {optimizer}: rehearsal {held} != plan {predicted}"


@pytest.mark.parametrize("degrees", [["parallel.cp=2", "cluster.gpus_per_node=2"],
                                     ["parallel.cp=2", "parallel.pp=2", "cluster.gpus_per_node=4"]])
def test_context_parallel_rehearses_a_step_alone_and_under_pipelining(degrees, tmp_path):
    """All-gather CP's fake step: each rank's balanced slice is computed outside the fake tensors
    (its sizes depend on the rows' values), and under PP the schedule takes the rank's slices;
    every rank builds, steps and holds the plan's state bytes."""
    spec, plan, result = _rehearse(["+recipe=debug", *degrees, "action=rehearse"], tmp_path)
    assert plan.layout.owners.cp_impl == "allgather" and result["ok"], rehearsal_problems(result, plan.layout)
    assert {row["coords"]["pp"] for row in result["ranks"]} == set(range(plan.layout.mesh.pp))
    for row in result["ranks"]:
        held = {k: row["memory"][k] for k in ("params", "grads", "optimizer")}
        assert held == {k: row["predicted"][k] for k in ("params", "grads", "optimizer")}, row
        assert row["memory"]["activations"] > 0, row


def test_cli_rehearse_prints_rehearsal_json_with_a_measured_step(tmp_path):
    """`train +recipe=debug action=rehearse plan.format=json`: the JSON on stdout is rehearsal.json,
    with exactly the issue's keys, and the fake training step measured an activation peak."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=debug", "action=rehearse",
         "plan.format=json", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert printed == json.loads((run_dir / "rehearsal.json").read_text())
    assert set(printed) == {"world_size", "ranks", "ok"} and printed["ok"] and printed["world_size"] == 2
    for row in printed["ranks"]:
        assert set(row) == ROW_KEYS and set(row["memory"]) == MEMORY_KEYS and row["error"] is None
        mem = row["memory"]
        assert mem["activations"] > 0
        assert mem["peak"] >= mem["params"] + mem["grads"] + mem["activations"]
        assert set(row["predicted"]["relative_error"]) == MEMORY_KEYS


def test_a_layout_the_runtime_cannot_build_is_refused_naming_rank_module_and_fix(tmp_path):
    """A layout the resolver would refuse, written into plan.json as is (tp=4 with n_kv_heads=2):
    every rehearsed rank reports the tensor-parallel code's refusal, with its coordinates and a Fix."""
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=4"])
    from launcher.plan.decide.resolve import resolve

    good = resolve(spec)
    bad = dataclasses.replace(good, mesh=dataclasses.replace(good.mesh, dp_shard=1, tp=4))
    _, plan, result = _rehearse(["+recipe=debug", "cluster.gpus_per_node=4", "rehearse.activations=false"],
                                tmp_path, layout=bad)
    assert not result["ok"]
    assert [row["rank"] for row in result["ranks"]] == [0, 3]
    problems = rehearsal_problems(result, bad)
    assert len(problems) == 2, problems
    first = problems[0]
    assert first.startswith("rank 0 (mesh coords pp=0 dp_replicate=0 dp_shard=0 cp=0 tp=0; layout tp=4)"), first
    assert "launcher.parallel.tp" in first and "n_kv_heads=2 is not divisible by 4" in first, first
    assert "Fix: " in first and "Traceback" not in first, first
    assert problems[1].startswith("rank 3 (mesh coords pp=0 dp_replicate=0 dp_shard=0 cp=0 tp=3;"), problems[1]


def test_a_rank_past_the_time_limit_is_killed_and_reported_and_no_process_is_left(tmp_path, monkeypatch):
    """A rank still running at the time limit is killed and reported (its log named, the Fix says
    what to change); the ranks run as forks of one server process, which stays for the process's
    next rehearsal until stop_rank_server (the CLI calls it) ends it."""
    import multiprocessing.forkserver

    from launcher.rehearse import driver

    monkeypatch.setattr(driver, "RANK_TIMEOUT_S", 0.5)  # the fake step alone takes longer
    threads_before = os.environ.get("OMP_NUM_THREADS")
    _, plan, result = _rehearse(["+recipe=debug"], tmp_path)
    assert not result["ok"]
    for row in result["ranks"]:
        err = row["error"]
        assert err["type"] == "ProcessDied", err
        assert f"rank {row['rank']} was killed after the time limit" in err["message"], err
        assert str(tmp_path / "rehearsal" / f"rank_{row['rank']}.log") in err["message"], err
        assert "rehearse.activations=false" in err["fix"] and "0.5 s per rank" in err["fix"], err
        assert not (tmp_path / "rehearsal" / f"rank_{row['rank']}.json").exists(), "the rank was not killed"
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    assert server is not None, "the rank server should stay for the next rehearsal"
    driver.stop_rank_server()
    assert multiprocessing.forkserver._forkserver._forkserver_pid is None, "the rank server was left running"
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)
    assert os.environ.get("OMP_NUM_THREADS") == threads_before, "the ranks' environment leaked"


def test_trainer_rehearse_aborts_a_run_that_does_not_fit_before_launching(tmp_path):
    """`train ... trainer.rehearse=true` rehearses first; a layout whose rehearsed states exceed the
    GPU exits 2 naming the rank, and no rank is started (no logs/ in the run dir)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=debug", "trainer.rehearse=true",
         "rehearse.activations=false", "hardware.memory_gb=0.001", "logging.wandb.mode=disabled",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank 0 does not fit" in proc.stderr and "rank 1 does not fit" in proc.stderr, proc.stderr[-2000:]
    assert "Fix:" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads((run_dir / "rehearsal.json").read_text())["ok"]
    assert not (run_dir / "logs").exists(), "a rank was launched"


def test_auto_ranks_cover_every_pipeline_rank_and_the_last_coordinates():
    from launcher.plan.decide.resolve import resolve

    lay = resolve(compose_spec(["+recipe=llama405b", "cluster.nodes=1024"]))
    assert (lay.mesh.pp, lay.mesh.dp_shard, lay.mesh.tp, lay.mesh.world_size) == (8, 128, 8, 8192)
    assert rehearsal_ranks(lay, "auto") == [0, 7, 1016, 1024, 2048, 3072, 4096, 5120, 6144, 7168, 8191]
    assert rehearsal_ranks(lay, [5, 3, 5]) == [3, 5]


def test_bad_rehearse_settings_exit_2_with_a_fix(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=debug", "action=rehearse",
         "rehearse.workers=0", "rehearse.ranks=foo", "rehearse.device=cuda", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rehearse.ranks='foo' must be auto, all or a list" in proc.stderr
    assert "rehearse.workers=0 must be at least 1" in proc.stderr and "Traceback" not in proc.stderr
    assert "rehearse.device=cuda with rehearse.tensors=fake" in proc.stderr and "Fix: rehearse.tensors=real" in proc.stderr
    # Real tensors on a GPU this machine does not show: refused before any rank is built.
    no_gpu = dict(env, CUDA_VISIBLE_DEVICES="-1")
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=debug", "action=rehearse",
         "rehearse.device=cuda", "rehearse.tensors=real", f"hydra.run.dir={tmp_path / 'run_cuda'}"],
        cwd=tmp_path, env=no_gpu, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rehearse.device=cuda: this machine has no visible GPU (CUDA_VISIBLE_DEVICES=-1)" in proc.stderr, proc.stderr
    assert "Fix: " in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run_cuda" / "rehearsal").exists(), "a rank was built"
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=debug", "action=rehearse",
         "rehearse.ranks=[0,5]", f"hydra.run.dir={tmp_path / 'run2'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "names rank(s) [5] outside the world of 2 ranks" in proc.stderr, proc.stderr


def test_deepspeed_module_move_is_skipped_only_for_fake_tensors_already_in_place():
    """Why DeepSpeed's ZeRO 0-2 and pipeline engines could not be built on fake tensors, and the
    scoped fix (launcher.engines.deepspeed.fake_module_stays_put): torch's Module.to() swaps a
    FakeTensor parameter in place even when it is already on the device, and swap_tensors
    refuses a tensor with a weak reference (DeepSpeed's debug name map sets one per parameter).
    Inside the block the move is a no-op for that module only; any other move is refused;
    afterwards .to() is torch's again. Real tensors pass through untouched."""
    import weakref

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from launcher.engines.deepspeed import build_meta_model, fake_module_stays_put

    spec = compose_spec(["+recipe=debug"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_meta_model(spec.model).to_empty(device="cpu")
        finalizers = [weakref.finalize(p, lambda: None) for p in model.parameters()]  # as DeepSpeed's name map
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            model.to(torch.device("cpu"))
        with fake_module_stays_put(model, torch.device("cpu")):
            assert model.to(torch.device("cpu")) is model and model.to("cpu") is model
            with pytest.raises(RuntimeError, match="only a move to cpu"):
                model.to(torch.bfloat16)
        assert "to" not in model.__dict__
        with pytest.raises(RuntimeError, match="Couldn't swap"):
            model.to("cpu")
    for f in finalizers:
        f.detach()
    real = torch.nn.Linear(2, 2)
    with fake_module_stays_put(real, torch.device("cpu")):
        assert "to" not in real.__dict__ and real.to("cpu") is real


_COUNT_FORWARDS = r"""
import json, sys
from pathlib import Path
from launcher.config.loader import compose_spec
from launcher.models.transformer import Transformer
from launcher.plan.present.plan import build_plan
from launcher.runtime.entry import engine_options
from launcher.rehearse.rank import rehearse_rank

calls = []
forward = Transformer.forward
Transformer.forward = lambda self, *a, **k: calls.append(1) or forward(self, *a, **k)
spec = compose_spec(["+recipe=debug", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"])
plan = build_plan(spec, None)
report = rehearse_rank(spec.model, spec.optim, plan.layout, engine_options(spec, Path(sys.argv[1])), 1)
print(json.dumps({"forwards": len(calls), "microbatches": plan.layout.batch.microbatches, "memory": report["memory"]}))
"""


def test_the_fake_step_runs_one_tracked_step_and_no_untracked_forward(tmp_path):
    """Rank 1 of the debug model (FSDP2 over 2 fake ranks, 2 micro-batches): the optimizer states
    come from zero gradients, so the whole rehearsal runs the forward of the tracked step only
    (2 micro-batches), not a second, untracked step; the step's peak is still measured."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _COUNT_FORWARDS, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["microbatches"] == 2 and out["forwards"] == 2, out
    mem = out["memory"]
    assert mem["activations"] > 0 and mem["peak"] >= mem["params"] + mem["grads"] + mem["activations"]


def test_ranks_with_the_same_local_shapes_share_one_fake_step(tmp_path):
    """FSDP2 over 3 ranks of the debug model (dim 64, vocab 256: shards of 22, 22, 20 rows):
    ranks 0 and 1 hold the same local shapes, so rank 1 reports rank 0's fake step instead of
    running it again (one worker: rank 0 finishes first); rank 2's shards are smaller, so it
    runs its own. The shared figures equal those of rank 1 rehearsed alone."""
    overrides = ["+recipe=debug", "cluster.gpus_per_node=3", "parallel.dp_shard=3", "trainer.global_batch_size=6",
                 "action=rehearse", "rehearse.workers=1"]
    _, _, together = _rehearse(overrides + ["rehearse.ranks=all"], tmp_path / "all")
    _, _, alone = _rehearse(overrides + ["rehearse.ranks=[1]"], tmp_path / "alone")
    assert together["ok"] and alone["ok"]
    notes = {r: json.loads((tmp_path / "all" / "rehearsal" / f"rank_{r}.json").read_text())["notes"] for r in range(3)}
    assert any("fake step shared with rank 0" in n for n in notes[1]), notes[1]
    assert not any("shared" in n for n in notes[0] + notes[2]), (notes[0], notes[2])
    mem = {row["rank"]: row["memory"] for row in together["ranks"]}
    assert mem[1] == mem[0] == alone["ranks"][0]["memory"]
    assert mem[2]["params"] < mem[0]["params"], "rank 2's shards were expected to be the smaller ones"
    assert mem[2]["activations"] > 0


def _rank_row(rank: int, memory, planned, peak_comparable):
    from launcher.rehearse.ranks import relative_errors

    predicted = dict(planned, peak_comparable=peak_comparable,
                     peak_set_apart={"allocator_fragmentation": planned["peak"] - peak_comparable})
    predicted["relative_error"] = relative_errors(memory, predicted)
    coords = {"pp": 0, "dp_replicate": 0, "dp_shard": rank, "cp": 0, "tp": 0, "ep": 0}
    return {"rank": rank, "coords": coords, "params_numel": 10, "memory": memory, "predicted": predicted, "error": None}


def test_the_rehearsal_table_says_what_it_compares_and_names_each_gap_with_its_reason():
    """Each column is explained; the peak is compared with the plan's figure for the same quantity
    (its peak less what a fake step cannot hold); a gap over the threshold is marked with the
    reason known for it instead of `ok`; `ok` only when every figure is within it."""
    from launcher.observe.rehearsal_table import GAP_THRESHOLD, rehearsal_table
    from launcher.rehearse.driver import render_rehearsal

    gib = 1024 ** 3
    states = {"params": 4 * gib, "grads": 4 * gib, "optimizer": 8 * gib}
    planned = dict(states, activations=2 * gib, peak=70 * gib)
    gapped = {"world_size": 2, "ok": True, "ranks": [
        _rank_row(r, dict(states, activations=3 * gib, peak=20 * gib), planned, 19 * gib) for r in (0, 1)]}
    text = render_rehearsal(gapped)
    assert "rehearsed/planned" in text and "the plan's figure for the same quantity" in text
    assert "activations: " in text and "peak: every tensor byte" in text  # what each column is
    assert "3.00G/2.00G +50%!" in text and "20.00G/19.00G +5%" in text and "20.00G/70.00G" not in text
    assert f"gap over {GAP_THRESHOLD:.0%}: activations on rank(s) 0, 1 (+50%): the fake step runs the CPU's kernels" in text
    assert "allocator_fragmentation 51.00G" in text
    assert not text.splitlines()[-1].startswith("ok")
    cols, rows = rehearsal_table(gapped)
    assert rows[0][cols.index("peak_planned")] == 19 * gib and "activations +50%" in rows[0][-1]
    close = {"world_size": 1, "ok": True, "ranks": [_rank_row(0, dict(states, activations=2 * gib, peak=19 * gib),
                                                              planned, 19 * gib)]}
    assert render_rehearsal(close).splitlines()[-1] == f"ok: every rank built, every figure within {GAP_THRESHOLD:.0%} of the plan's"


def test_real_tensor_rehearsal_holds_the_fake_rehearsals_bytes_and_times_each_part(tmp_path):
    """`action=rehearse rehearse.tensors=real` on the CPU (rank 1 of the debug model, FSDP2 over 2
    fake ranks): the rank built with real tensors holds exactly the parameter, gradient and
    optimizer bytes the fake rehearsal reports; forward, backward and optimizer are timed (> 0)
    beside the plan's compute time for that rank; the peak is MemTracker's (no allocator on a
    CPU, and the report says so); rehearsal_summary.json is read by bench/planner_accuracy.py
    like a run's run_summary.json, on the compute basis. An optim.groups entry puts the FFN matrices
    under Muon (the rest stays AdamW): both rehearsals hold the bytes the plan counts for those
    groups (one momentum buffer per Muon element, two moments per AdamW one)."""
    from launcher.plan.estimate.params import model_shape
    from launcher.rehearse.driver import render_rehearsal
    from launcher.rehearse.real_report import REHEARSAL_SUMMARY_FILENAME
    from launcher.rehearse.ranks import predicted_time_for_rank

    base = ["+recipe=debug", "action=rehearse", "rehearse.ranks=[1]",
            "optim.groups=[{match: '\\.feed_forward\\.', optimizer: muon}]"]
    _, _, fake = _rehearse(base + ["rehearse.activations=false"], tmp_path / "fake")
    spec, plan, real = _rehearse(base + ["rehearse.tensors=real", "rehearse.timed_steps=1"], tmp_path / "real")
    assert fake["ok"] and real["ok"], (fake, real)
    (f_row,), (r_row,) = fake["ranks"], real["ranks"]
    held = lambda row: {k: row["memory"][k] for k in ("params", "grads", "optimizer")}  # noqa: E731
    assert held(r_row) == held(f_row) and r_row["params_numel"] == f_row["params_numel"], (r_row, f_row)
    assert held(f_row) == {k: f_row["predicted"][k] for k in ("params", "grads", "optimizer")}, f_row
    # the plan's Muon matrices are the groups' (3 FFN matrices in each of the 4 blocks), not optim=muon's defaults
    assert sum((last - first + 1) * n for first, last, _, _, _, n in plan.layout.numerics.muon_matrices) == 3 * 4
    measured = r_row["real"]
    assert {"forward", "backward", "optimizer"} <= set(measured["time_s"]), measured["time_s"]
    assert all(v > 0 for v in measured["time_s"].values()) and measured["compute_s"] > 0, measured
    assert measured["microbatches_run"] == measured["layout_microbatches"] == plan.layout.batch.microbatches
    planned = predicted_time_for_rank(model_shape(spec.model), plan.layout, spec.hardware, 1)
    assert measured["planned"]["compute_s"] == planned["compute_s"] > 0
    assert measured["ratio"]["compute"] == measured["compute_s"] / planned["compute_s"]
    assert measured["peak_allocated"] == r_row["memory"]["peak"] > sum(held(r_row).values())
    assert measured["peak_reserved"] is None and "MemTracker" in measured["memory_source"]
    assert real["real"]["device"] == "cpu" and not real["real"]["gpu_is_hardware"]
    table = render_rehearsal(real)
    assert "real tensors (measured on this CPU, not the plan's hardware=h100_sxm" in table, table
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import planner_accuracy
    finally:
        sys.path.remove(str(REPO / "bench"))
    summary = json.loads((tmp_path / "real" / REHEARSAL_SUMMARY_FILENAME).read_text())
    assert summary["source"] == "rehearsal" and summary["basis"] == "compute" and summary["device"] == "cpu"
    (row,) = [r for r in planner_accuracy.rows_from_runs([tmp_path / "real"]) if r.metric == "tps_per_gpu_compute"]
    assert row.value == summary["figures"]["tokens_per_s_per_gpu"]["measured"] > 0
    t = plan.time
    assert row.predicted == pytest.approx(t["tokens_per_step"] / plan.world_size / (t["compute_s"] + t["optimizer_s"]))


def test_real_tensor_rehearsal_refuses_another_gpu_and_a_rank_that_cannot_fit():
    """The checks before anything is built, on what the local GPU probe answers: a GPU that is not
    the plan's `hardware` (unless rehearse.allow_other_gpu=true), and a rank whose planned peak
    exceeds the GPU's memory, each with the figures and a Fix."""
    from launcher.plan.estimate.memory import GiB
    from launcher.rehearse.local_device import local_device_problems, rank_need_bytes

    spec = compose_spec(["+recipe=llama70b", "action=rehearse", "rehearse.tensors=real", "rehearse.device=cuda"])
    plan = build_plan(spec)
    a100 = {"device": "cuda", "gpu": "NVIDIA A100-SXM4-80GB", "memory_bytes": 80 * GiB, "visible": 1}
    (other,) = local_device_problems(spec, plan, [0], a100)
    assert "the local GPU is NVIDIA A100-SXM4-80GB (hardware=a100_80gb) but the plan is for hardware=h100_sxm" in other
    assert "Fix: hardware=a100_80gb (plan for this GPU), or rehearse.allow_other_gpu=true" in other
    allowed = dataclasses.replace(spec, rehearse=dataclasses.replace(spec.rehearse, allow_other_gpu=True))
    assert local_device_problems(allowed, plan, [0], a100) == []
    h100_small = {"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "memory_bytes": 16 * GiB, "visible": 1}
    (too_big,) = local_device_problems(spec, plan, [0], h100_small)
    need = rank_need_bytes(plan, 0, "cuda")
    assert need > 16 * GiB and f"rank 0 (pipeline rank 0) needs {need / GiB:.1f} GiB" in too_big, too_big
    assert "the local GPU (NVIDIA H100 80GB HBM3) has 16.0 GiB. Fix: " in too_big
