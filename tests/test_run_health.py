"""Real 2-rank runs that go wrong: a hang and a crash leave <run dir>/failure/ naming the culprit.

The misbehaviour comes from the rank runtime's debug hooks (launcher/resilience/debug_hooks.py),
passed to the ranks through cluster.env, so the code under test is the code that runs in a job.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from launcher.resilience.restarts import read_events
from tests.conftest import TRAIN, train_env

pytestmark = pytest.mark.multiprocess

HANG_S = 8  # trainer.hang_timeout_s of the hang test
EXIT_MARGIN_S = 60  # report grace (15 s) + torchrun's teardown, with room for a loaded machine


def _start(args, run_dir: Path) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [TRAIN, *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=train_env(run_dir.parent),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )


def _ranks_left(run_dir: Path) -> str:
    found = subprocess.run(["pgrep", "-f", "--", f"--run-dir {run_dir}"], capture_output=True, text=True)
    return found.stdout.strip()


def test_a_rank_stuck_before_a_collective_ends_the_job_with_stacks_and_names_it(run_dir):
    proc = _start(["+recipe=debug", "trainer.steps=40", "checkpoint.interval=2", f"trainer.hang_timeout_s={HANG_S}",
                   "+cluster.env.LAUNCHER_DEBUG_HANG=1:4"], run_dir)
    try:
        hook_line = "LAUNCHER_DEBUG_HANG: rank 1 sleeps forever before step 4"
        deadline = time.monotonic() + 240
        log1 = run_dir / "logs" / "rank_1.log"
        while not (log1.exists() and hook_line in log1.read_text()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "rank 1 never reached the hang"
            time.sleep(0.5)
        # From the moment rank 1 hangs: the watchdog's bound, then the reports' grace and teardown.
        code = proc.wait(timeout=HANG_S + EXIT_MARGIN_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read()
    assert code != 0, out
    for _ in range(20):  # the ranks are torchrun's children; give its teardown a moment
        if not _ranks_left(run_dir):
            break
        time.sleep(0.5)
    assert not _ranks_left(run_dir)
    failure = run_dir / "failure"
    summary = json.loads((failure / "summary.json").read_text())
    assert summary["what"] == "hang"
    assert summary["ranks_not_arrived"] == [1], summary
    assert summary["last_step"] == 3 and summary["last_checkpoint"].endswith("step_00000002"), summary
    assert f"see {failure / 'summary.json'}" in out
    # Every rank's Python stacks: the stuck one in the hook's sleep, the other inside a collective.
    assert "before_step" in (failure / "stacks_rank_1.txt").read_text()
    stack0 = (failure / "stacks_rank_0.txt").read_text()
    assert "before_step" not in stack0 and "train_step" in stack0
    assert sorted(summary["files"]["stacks"]) == ["failure/stacks_rank_0.txt", "failure/stacks_rank_1.txt"]
    # The flight recorder (TORCH_FR_BUFFER_SIZE, set by the launcher) recorded gloo's collectives.
    for rank in (0, 1):
        trace = json.loads((failure / f"fr_trace_rank_{rank}.json").read_text())
        assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"])


def _metrics(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _val_steps(records: list) -> dict:
    return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def _traces(run_dir: Path) -> dict:
    """{rank folder: sorted trace names}, each trace parsed as JSON (Chrome trace format)."""
    out = {}
    for folder in sorted((run_dir / "profile").iterdir()):
        out[folder.name] = sorted(p.name for p in folder.iterdir())
        for trace in folder.iterdir():
            assert "traceEvents" in json.loads(trace.read_text()), trace
    return out


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> Path:
    """MoE, dp=2, validation every 3 steps, rank 1's profile of steps 2-3, rank 1 slowed inside its forward."""
    run_dir = tmp_path_factory.mktemp("health") / "run"
    proc = _start(["+recipe=debug", "model=debug_moe", "trainer.steps=8", "trainer.log_every=1", "checkpoint.interval=0",
                   "trainer.val_every=3", "profile.enabled=true", "profile.steps=[2,3]", "profile.ranks=[1]",
                   "+cluster.env.LAUNCHER_DEBUG_SLOW_COMPUTE=1:200",
                   f"+cluster.env.LAUNCHER_DEBUG_NONFINITE=0:{NONFINITE_STEP}",
                   "trainer.spike_zscore=3", "trainer.spike_window=3"], run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    (run_dir / "train_output.txt").write_text(out)
    return run_dir


NONFINITE_STEP = 5  # two_rank_run: rank 0's forward returns NaN at this step (LAUNCHER_DEBUG_NONFINITE)


def test_a_step_with_nonfinite_gradients_on_one_rank_is_skipped_on_every_rank(two_rank_run):
    """The bitwise check that a skip leaves weights, AdamW state and LR untouched is
    tests/test_numerics.py's (one rank, in process); here: the decision is global and counted."""
    records = {r["step"]: r for r in _metrics(two_rank_run)}
    bad = records[NONFINITE_STEP]
    assert math.isnan(bad["loss"]) and not math.isfinite(bad["grad_norm"]), bad
    assert {s: r["health/skipped_steps"] for s, r in records.items()} == {
        s: int(s >= NONFINITE_STEP) for s in records}
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for s, r in records.items()
               if s != NONFINITE_STEP)
    # The LR schedule did not advance on the skipped step: the step after it uses the same LR.
    assert records[NONFINITE_STEP + 1]["lr"] == bad["lr"]
    # Loss spikes are looked for on every logged step (trainer.spike_zscore); this healthy curve has none.
    assert all(r["health/loss_spike"] == 0 for r in records.values())
    logs = "".join(p.read_text() for p in sorted(two_rank_run.rglob("rank_*.log")))
    for rank in (0, 1):
        assert f"step {NONFINITE_STEP} skipped: the gradient norm is not finite (rank {rank}" in logs


def test_max_skipped_steps_in_a_row_end_the_run_naming_step_rank_and_tensor(run_dir):
    proc = _start(["+recipe=debug", "trainer.steps=6", "trainer.log_every=1", "checkpoint.interval=0",
                   "trainer.max_skipped_steps=2", "+cluster.env.LAUNCHER_DEBUG_NONFINITE=1:3-4"], run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-4000:]
    summary = json.loads((run_dir / "failure" / "summary.json").read_text())
    assert summary["what"] == "nonfinite" and summary["step"] == 4 and summary["skipped_in_a_row"] == 2, summary
    assert summary["failed_ranks"] == [1] and summary["rank"] == 1, summary  # rank 1's own loss was NaN
    assert summary["first_nonfinite"] and summary["first_nonfinite"].endswith("weight"), summary
    assert "Fix:" in summary["error"]
    # The step that ends the run is in the summary; metrics.jsonl ends at the one before, skipped too.
    last = max(_metrics(run_dir), key=lambda r: r["step"])
    assert last["step"] == 3 and last["health/skipped_steps"] == 1 and math.isnan(last["loss"]), last


def test_validation_loss_is_logged_at_every_val_every_step(two_rank_run):
    records = _metrics(two_rank_run)
    val = _val_steps(records)
    assert sorted(val) == [3, 6], val
    for r in records:
        if "val_loss" in r:
            assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]))
    assert val[6] < val[3]  # the model learns the grammar the held-out text shares


def test_profiler_writes_chrome_traces_for_the_chosen_ranks_and_steps_only(two_rank_run):
    assert _traces(two_rank_run) == {"rank_1": ["step_2.json", "step_3.json"]}


def test_a_rank_slowed_in_its_compute_is_named_as_straggler(two_rank_run):
    records = _metrics(two_rank_run)
    assert all(r["slowest_rank"] == 1 for r in records[2:]), [r.get("slowest_rank") for r in records]
    assert all(r["step_time_min_s"] <= r["step_time_median_s"] <= r["step_time_max_s"] for r in records)
    out = (two_rank_run / "train_output.txt").read_text()
    assert "straggler: rank 1 on host " in out and "straggler: rank 0" not in out
    stragglers = json.loads((two_rank_run / "summary.json").read_text())["stragglers"]
    assert [w["rank"] for w in stragglers["warned"]] == [1]
    assert stragglers["slowest_hosts"][0]["rank"] == 1 and stragglers["slowest_hosts"][0]["host"]


def test_moe_expert_shares_are_logged_per_log_step(two_rank_run):
    records = _metrics(two_rank_run)
    for r in records:
        # debug_moe: 4 experts, top-2, so every expert's share is within (0, 1) and they cannot all be equal to 0.
        assert 0 <= r["moe/expert_share_min"] <= 0.25 <= r["moe/expert_share_max"] <= 1, r
        assert isinstance(r["moe/idle_experts"], int)
        # Load metrics (launcher/observe/moe_load.py) at every log step; debug_moe is dropless.
        assert r["moe/tokens_per_expert_cv"] >= 0 and r["moe/tokens_per_expert_max_over_mean"] >= 1, r
        assert r["moe/dropped_frac"] == 0.0 and r["moe/aux_loss"] > 0, r
        # The two aux-loss figures under names that say what each is, the older names kept: the
        # total over debug_moe's 3 MoE layers (last micro-batch) is about 3 x the per-layer mean.
        assert r["moe/aux_loss_total"] == r["moe_aux_loss"] and r["moe/aux_loss_per_layer"] == r["moe/aux_loss"], r
        assert r["moe_aux_loss"] == pytest.approx(3 * r["moe/aux_loss"], rel=0.3), r
        # Per MoE layer (debug_moe: blocks 1-3; block 0 dense): the values the mean above averages.
        # Its softmax router has no correction bias, so no bias spread.
        per_layer = [r[f"moe/layer{i}/tokens_per_expert_max_over_mean"] for i in (1, 2, 3)]
        assert all(1 <= x <= 4 / 2 for x in per_layer), r
        assert r["moe/tokens_per_expert_max_over_mean"] == pytest.approx(sum(per_layer) / 3), r
        assert not any(k.endswith("bias_spread") or k.startswith("moe/layer0/") for k in r), r


def test_pipeline_validation_and_a_rank_raising_oom_leaves_a_failure_summary_naming_it(two_rank_run, tmp_path):
    """pp=2: only the last stage computes the loss; rank 1 then raises an out-of-memory error and
    failure/summary.json names it, with the plan's memory prediction beside it (no CUDA snapshot on CPU)."""
    run_dir = tmp_path / "run"
    proc = _start(["+recipe=debug", "model=debug_moe", "trainer.steps=8", "parallel.pp=2", "trainer.log_every=1", "checkpoint.interval=0",
                   "trainer.val_every=3", "profile.enabled=true", "profile.steps=[2,2]",
                   "+cluster.env.LAUNCHER_DEBUG_OOM=1:7"], run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-4000:]
    val = _val_steps(_metrics(run_dir))
    assert sorted(val) == [3, 6], val
    # The same model, data and global batch as the dp=2 run: the same held-out loss.
    assert val[3] == pytest.approx(_val_steps(_metrics(two_rank_run))[3], abs=1e-4)
    # MoE load over both stages' layers, in one all-reduce: at each step (the same weights up to
    # rounding, the same global batch) the dp=2 run routed the same tokens. Steps 1 and 4 (the
    # first after validation) show that the stages have static shapes: torch's shape inference
    # would run one extra forward per stage there and count its tokens and aux loss too.
    pp_rows = {r["step"]: r for r in _metrics(run_dir)}
    dp_rows = {r["step"]: r for r in _metrics(two_rank_run)}
    # (Equal to every printed digit here; the tolerance leaves room for one routing flip by rounding.)
    for step in (1, 2, 4):
        for key in ("moe/tokens_per_expert_cv", "moe/tokens_per_expert_max_over_mean", "moe/aux_loss"):
            assert pp_rows[step][key] == pytest.approx(dp_rows[step][key], rel=1e-3), (
                step, key, pp_rows[step][key], dp_rows[step][key])
    assert all(r["moe/tokens_per_expert_cv"] >= 0 and r["moe/tokens_per_expert_max_over_mean"] >= 1 and
               r["moe/aux_loss"] > 0 and r["moe/dropped_frac"] == 0.0 for r in pp_rows.values())
    # Default profiled ranks: rank 0 and the last pipeline rank.
    assert _traces(run_dir) == {"rank_0": ["step_2.json"], "rank_1": ["step_2.json"]}
    summary = json.loads((run_dir / "failure" / "summary.json").read_text())
    assert summary["what"] == "oom" and summary["rank"] == 1 and summary["failed_ranks"] == [1], summary
    assert summary["error"].startswith("OutOfMemoryError: LAUNCHER_DEBUG_OOM") and summary["last_step"] == 6
    assert summary["files"]["tracebacks"] == ["failure/traceback_rank_1.txt"]
    assert summary["files"]["snapshots"] == ["failure/memory_prediction_rank_1.json"]
    prediction = json.loads((run_dir / "failure" / "memory_prediction_rank_1.json").read_text())
    assert prediction["step"] == 7 and prediction["predicted"] == json.loads((run_dir / "plan.json").read_text())["memory"]
    assert f"see {run_dir / 'failure' / 'summary.json'}" in out
    # Rank 0 then fails too (its peer is gone) and hands the first failure's summary to W&B's run summary
    # (MetricsLogger.summary, which also writes the run's summary.json).
    assert json.loads((run_dir / "summary.json").read_text())["failure"]["rank"] == 1


def test_first_failure_wins_and_each_kind_is_classified(tmp_path):
    """In-process: the summary of the first failing rank stays; later ranks' failures do not replace it."""
    import torch

    from launcher.resilience.failure import FailureBundle, StopWithoutCheckpoint

    first = FailureBundle(tmp_path, rank=1, world_size=2)
    first.progress.last_step = 5
    assert first.record_exception(RuntimeError("boom"), "Traceback...") is not None
    published = []  # rank 0's W&B run gets the first failure's summary, not its own consequence
    later = FailureBundle(tmp_path, rank=0, world_size=2, publishers=[published.append])
    assert later.record_exception(RuntimeError("Connection reset by peer"), "Traceback...") is None
    assert [(p["rank"], p["error"]) for p in published] == [(1, "RuntimeError: boom")]
    summary = json.loads((tmp_path / "failure" / "summary.json").read_text())
    assert (summary["rank"], summary["what"], summary["error"], summary["last_step"]) == (1, "exception", "RuntimeError: boom", 5)
    assert sorted(summary["files"]["tracebacks"]) == ["failure/traceback_rank_1.txt"]
    from launcher.resilience.failure import classify

    assert classify(torch.OutOfMemoryError("CUDA out of memory")) == "oom"
    assert classify(StopWithoutCheckpoint("stop requested")) == "signal"


def test_an_expert_that_gets_no_tokens_is_warned_about(caplog):
    """In-process, a real MoE layer whose router never picks expert 0: warned after IDLE_LOGS log steps."""
    import logging

    import torch
    from torch import nn

    from launcher.models.moe import MoE
    from launcher.observe.moe_health import IDLE_LOGS, MoEHealth

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.moe = MoE(dim=8, hidden=16, n_experts=4, top_k=1)

    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Linear(8, 8), "1": Block()})
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
        model.layers["1"].moe.router.weight[0].fill_(-100.0)  # positive inputs: expert 0 always scores lowest
    health = MoEHealth([model], n_layers=2, n_experts=4, rank=0, device=torch.device("cpu"))
    x = torch.randn(64, 8).abs()
    with caplog.at_level(logging.WARNING, logger="launcher.observe.moe_health"):
        for step in range(1, IDLE_LOGS + 1):
            model.layers["1"].moe(x)
            row = health.observe(step)
            assert row["moe/idle_experts"] == 1 and row["moe/expert_share_min"] == 0.0
    warnings = [r.getMessage() for r in caplog.records if "received no tokens" in r.getMessage()]
    assert warnings == [f"MoE layer 1: expert 0 received no tokens for {IDLE_LOGS} log steps in a row (step {IDLE_LOGS}); "
                        "check the router and its load balancing (model.aux_loss_coef)"]
    # A sigmoid router with a correction bias (DeepSeek-V3) is balanced by other keys: the hint names them.
    model.layers["1"].moe.e_score_correction_bias = torch.zeros(4)
    assert health._balancing_keys(1) == "model.bias_update_speed, model.aux_loss_alpha"


def test_moe_load_metrics_math_on_hand_made_counts():
    """cv and max/mean per layer, then the mean over the layers that routed tokens; dropped and aux."""
    import torch

    from launcher.observe.moe_load import KEYS, layer_metrics, load_metrics

    counts = torch.tensor([[3.0, 1.0], [2.0, 2.0], [0.0, 0.0]])  # the last layer: on no stage / dense
    got = load_metrics(counts, dropped=torch.tensor([1.0, 0.0, 0.0]), aux_sum=torch.tensor([0.02, 0.06, 0.0]),
                       aux_calls=torch.tensor([2.0, 2.0, 0.0]))
    assert tuple(got) == KEYS
    # [3, 1]: mean 2, population std 1 -> cv 0.5, max/mean 1.5; [2, 2]: cv 0, max/mean 1.
    assert got["moe/tokens_per_expert_cv"] == 0.25
    assert got["moe/tokens_per_expert_max_over_mean"] == 1.25
    assert got["moe/dropped_frac"] == 1 / 8
    assert got["moe/aux_loss"] == pytest.approx(0.02)  # mean of 0.02/2 and 0.06/2
    single = load_metrics(torch.tensor([[3.0, 1.0]]), torch.zeros(1), torch.ones(1), torch.ones(1))
    assert (single["moe/tokens_per_expert_cv"], single["moe/tokens_per_expert_max_over_mean"]) == (0.5, 1.5)
    assert load_metrics(torch.zeros(2, 2), torch.zeros(2), torch.zeros(2), torch.zeros(2)) == {}
    # Per layer: layer 2 routed nothing (no key); layers 0 and 1 hold a correction bias on 2 ranks.
    per_layer = layer_metrics(counts, bias_spread=torch.tensor([0.04, 0.0, 0.0], dtype=torch.float64), bias_holders=torch.tensor([2.0, 2.0, 0.0]))
    assert per_layer == {"moe/layer0/tokens_per_expert_max_over_mean": 1.5,
                         "moe/layer1/tokens_per_expert_max_over_mean": 1.0,
                         "moe/layer0/bias_spread": 0.02, "moe/layer1/bias_spread": 0.0, "moe/bias_spread": 0.01}
    assert "moe/bias_spread" not in layer_metrics(counts, torch.zeros(3), torch.zeros(3))  # no correction bias


def test_moe_health_reports_dropped_tokens_and_aux_loss_of_a_real_layer():
    """A real MoE layer with capacity 2 whose router sends all 8 tokens to expert 0: 6 of 8 dropped;
    the aux loss is the layer's own; a validation (no_grad) forward is not counted."""
    import torch
    from torch import nn

    from launcher.models.moe import MoE
    from launcher.observe.moe_health import MoEHealth

    torch.manual_seed(0)
    block = nn.Module()
    block.moe = MoE(dim=8, hidden=16, n_experts=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        block.moe.router.weight.zero_()
        block.moe.router.weight[0].fill_(1.0)
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": block})
    health = MoEHealth([model], n_layers=1, n_experts=4, rank=0, device=torch.device("cpu"))
    x = torch.rand(1, 8, 8) + 0.5  # positive inputs: expert 0 wins every token
    block.moe(x)
    aux = float(block.moe.last_aux_loss)
    with torch.no_grad():
        block.moe(torch.rand(1, 8, 8) + 0.5)
    row = health.observe(1)
    # counts [8, 0, 0, 0]: mean 2, std sqrt(12) -> cv sqrt(3); max/mean 4.
    assert row["moe/tokens_per_expert_cv"] == pytest.approx(3 ** 0.5)
    assert row["moe/tokens_per_expert_max_over_mean"] == 4.0
    assert row["moe/dropped_frac"] == 6 / 8
    assert row["moe/aux_loss"] == pytest.approx(aux) and aux > 0
    assert health.observe(2) == {}  # read and reset: nothing routed since


def test_a_straggler_with_straggler_action_exclude_ends_a_local_run_naming_its_node(run_dir):
    """trainer.straggler_action=exclude: rank 1, slowed in every forward, is over the factor at
    every log step; after trainer.straggler_checks=2 of them in a row (step 1, with its start-up
    costs, does not count) every rank stops with a `straggler` failure naming rank 1's node. A local
    run has no spare and no requeue: the run stops (`stop: unfit node`), nothing to exclude it from."""
    proc = _start(["+recipe=debug", "trainer.steps=12", "trainer.log_every=1", "checkpoint.interval=0",
                   "trainer.straggler_action=exclude", "trainer.straggler_checks=2", "cluster.max_restarts=1",
                   "+cluster.env.LAUNCHER_DEBUG_SLOW_COMPUTE=1:200"], run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode != 0, out[-4000:]
    summary = json.loads((run_dir / "failure" / "summary.json").read_text())
    host = summary["host"]
    assert (summary["what"], summary["rank"], summary["blamed_hosts"]) == ("straggler", 1, [host]), summary
    assert summary["last_step"] == 3, summary  # judged at steps 2 and 3: two checks in a row
    assert f"rank 1 on {host}" in summary["error"] and "x the other ranks' median" in summary["error"], summary
    assert "not restarting in place" in out and "(restart 1)" not in out
    # The verdict at step 3 ends the run inside that step's log collective, before its record.
    steps = [r["step"] for r in _metrics(run_dir)]
    assert steps == [1, 2], steps
    events = read_events(run_dir)
    failure = [e for e in events if e["event"] == "failure"]
    assert len(failure) == 1 and failure[0]["cause"]["what"] == "straggler", events
    assert failure[0]["action"] == "stop: unfit node" and failure[0]["cause"]["blamed_hosts"] == [host], events
    # A local run has no other node to move to: nothing is excluded, the run just stops.
    assert not [e for e in events if e["event"] == "exclude"], events


SPIKE_BATCH = 8  # test_a_loss_spike_rewinds: the data's global batch whose forward is made to spike


def test_a_loss_spike_rewinds_to_the_checkpoint_before_it_and_skips_its_batches(run_dir):
    """trainer.on_spike=rewind on 2 ranks: the data's batch 8 makes the loss spike at step 8; the
    ranks start again from step 6's checkpoint and skip batches 7-8, so steps 7-10 train batches
    9-12 and the spike does not come back; trainer.json's data position proves the skip."""
    proc = _start(["+recipe=debug", "trainer.steps=10", "trainer.log_every=1", "checkpoint.interval=3",
                   "trainer.spike_zscore=50", "trainer.spike_window=6", "trainer.on_spike=rewind",
                   f"+cluster.env.LAUNCHER_DEBUG_SPIKE={SPIKE_BATCH}"], run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir)
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["action"] == "rewind" and failure["cause"]["what"] == "spike", failure
    assert failure["cause"]["rewind"]["spike_step"] == SPIKE_BATCH
    rewound = next(e for e in events if e["event"] == "rewound")
    assert (rewound["from_step"], rewound["skipped_batches"], rewound["rewind"]) == (6, 2, 1), rewound
    assert next(e for e in events if e["event"] == "resumed")["step"] == 6
    assert "loss spike at step 8: rewinding (rewind 1 of 3)" in out
    # metrics.jsonl keeps the rewound timeline (the records after step 6 were replaced): no spike.
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 11))
    assert all(r["health/loss_spike"] == 0 for r in records), records
    assert max(r["loss"] for r in records if r["step"] > 6) < 2 * records[0]["loss"]
    rank0 = (run_dir / "logs" / "rank_0.log").read_text()
    detected = [line for line in rank0.splitlines() if "of the last" in line and "logged losses" in line]
    assert len(detected) == 1 and f"loss spike at step {SPIKE_BATCH}:" in detected[0], detected
    assert f"rewind 1 resumes from {run_dir / 'checkpoints' / 'step_00000006'} and skips 2" in rank0
    checkpoints = run_dir / "checkpoints"
    state, final = (json.loads((checkpoints / f"step_{s:08d}" / "trainer.json").read_text()) for s in (9, 10))
    per_step = final["samples_consumed"] - state["samples_consumed"]  # the global batch
    assert state["batches_skipped"] == 2 and state["rewinds_applied"] == 1, state
    assert state["samples_consumed"] == (9 + 2) * per_step, state


def test_the_hold_aid_waits_after_its_step_until_released_or_a_stop_is_requested(tmp_path, monkeypatch):
    """LAUNCHER_DEBUG_HOLD=S:PATH (the SLURM tests signal and kill runs with it): a rank passes
    every other step at once, marks itself held after step S, and goes on when PATH appears or
    when a stop request reaches it; a malformed value names the form."""
    import threading

    from launcher.resilience.debug_hooks import hold_after_step

    release = tmp_path / "release"
    monkeypatch.setenv("LAUNCHER_DEBUG_HOLD", f"3:{release}")
    hold_after_step(rank=1, step=2, stop_requested=lambda: None)
    assert not (tmp_path / "release.rank1").exists()

    requests = []  # the stop request arrives after the rank holds
    threading.Timer(0.3, requests.append, ("signal SIGUSR1",)).start()
    started = time.monotonic()
    hold_after_step(rank=1, step=3, stop_requested=lambda: requests[-1] if requests else None)
    assert (tmp_path / "release.rank1").exists() and time.monotonic() - started >= 0.3

    threading.Timer(0.3, release.touch).start()
    started = time.monotonic()
    hold_after_step(rank=0, step=3, stop_requested=lambda: None)
    assert (tmp_path / "release.rank0").exists() and time.monotonic() - started >= 0.3
    (tmp_path / "release.rank0").unlink()
    hold_after_step(rank=0, step=3, stop_requested=lambda: None)  # released already: a resumed run passes
    assert not (tmp_path / "release.rank0").exists()

    monkeypatch.setenv("LAUNCHER_DEBUG_HOLD", str(release))
    with pytest.raises(ValueError, match="expected STEP:PATH"):
        hold_after_step(rank=0, step=3, stop_requested=lambda: None)
