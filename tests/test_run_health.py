"""Real 2-rank runs that go wrong: a hang and a crash leave <run dir>/failure/ naming the culprit.

The misbehaviour comes from the rank runtime's debug hooks (launcher/runtime/debug_hooks.py),
passed to the ranks through cluster.env, so the code under test is the code that runs in a job.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

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
