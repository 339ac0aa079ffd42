"""Checkpoint manager on a real (single-process) native engine: pruning never loses the good state,
abandoned timelines are moved aside, odd manifests are skipped, re-saves are atomic, one job per folder."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.checkpoint import manager as ckpt
from launcher.checkpoint.manager import CheckpointManager
from launcher.checkpoint.folder import CheckpointDirInUse, lock_checkpoint_dir, share_of, verify_checkpoint
from tests.conftest import run_train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine_and_batches(debug_engine):
    engine, batches, _ = debug_engine
    return engine, batches


def _manager(root: Path, keep: int = 3) -> CheckpointManager:
    return CheckpointManager(root, keep=keep, verify_checksums=True, rank=0, world_size=1)


def _save(manager: CheckpointManager, engine, step: int) -> Path:
    return manager.save(step, engine, {"samples_consumed": 2 * step, "world_size": 1})


def _names(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock")


def test_resumed_run_moves_a_newer_broken_timeline_aside_and_keeps_its_own(tmp_path, engine_and_batches):
    engine, batches = engine_and_batches
    root = tmp_path / "ckpt"
    manager = _manager(root, keep=1)
    engine.train_step(batches.for_step(1))
    _save(manager, engine, 2)
    # A newer checkpoint of an abandoned run, corrupted: resume must skip it...
    broken = root / "step_00000008"
    shutil.copytree(root / "step_00000002", broken)
    (broken / "trainer.json").write_text("{}")
    resumed = _manager(root, keep=1)
    assert resumed.select_resume("auto") == root / "step_00000002"
    resumed.load(root / "step_00000002", engine, seed=0)
    # ...and saving step 3 with keep=1 keeps step 3 itself; step 8 is moved aside, not deleted.
    engine.train_step(batches.for_step(3))
    _save(resumed, engine, 3)
    assert [p.name for p in resumed.checkpoints()] == ["step_00000003"]
    assert verify_checkpoint(root / "step_00000003") is None
    (aside,) = root.glob("abandoned_*")
    assert _names(aside) == ["ABANDONED.txt", "step_00000008"]


def test_resume_path_that_is_not_a_checkpoint_is_a_clear_error(tmp_path):
    manager = _manager(tmp_path / "ckpt", keep=1)
    with pytest.raises(ValueError) as err:
        manager.select_resume(str(tmp_path / "typo"))
    assert "not a folder" in str(err.value) and "Fix:" in str(err.value)


# --- item 4: a run that does not resume never deletes newer checkpoints -----------------------


def test_fresh_run_moves_the_old_timeline_aside_and_logs_it(tmp_path, engine_and_batches, caplog):
    engine, _ = engine_and_batches
    root = tmp_path / "ckpt"
    old = _manager(root, keep=3)
    for step in (2, 4, 6):
        _save(old, engine, step)
    fresh = _manager(root, keep=3)  # checkpoint.resume=none: nothing loaded, start step 0
    with caplog.at_level(logging.WARNING):
        _save(fresh, engine, 1)
    (aside,) = root.glob("abandoned_*")
    assert _names(root) == [aside.name, "step_00000001"]
    assert _names(aside) == ["ABANDONED.txt", "step_00000002", "step_00000004", "step_00000006"]
    for step in (2, 4, 6):
        assert verify_checkpoint(aside / f"step_{step:08d}") is None
    assert str(aside) in caplog.text and "step_00000006" in caplog.text
    # resume=auto now continues the new timeline; the old one stays resumable by path.
    assert _manager(root).select_resume("auto") == root / "step_00000001"
    assert _manager(root).select_resume(str(aside / "step_00000006")) == aside / "step_00000006"


def test_resume_from_an_older_path_moves_only_the_newer_checkpoints(tmp_path, engine_and_batches):
    engine, _ = engine_and_batches
    root = tmp_path / "ckpt"
    old = _manager(root, keep=3)
    for step in (2, 4, 6):
        _save(old, engine, step)
    again = _manager(root, keep=3)
    again.load(again.select_resume(str(root / "step_00000004")), engine, seed=0)  # checkpoint.resume=PATH
    _save(again, engine, 5)
    (aside,) = root.glob("abandoned_*")
    assert _names(aside) == ["ABANDONED.txt", "step_00000006"]
    assert [p.name for p in again.checkpoints()] == ["step_00000005", "step_00000004", "step_00000002"]


# --- item 6: manifests of the wrong shape are skipped, never a crash -----------------------------


BAD_MANIFESTS = {
    "list": [],
    "files null": {"files": None},
    "files list": {"files": []},
    "entry without size": {"files": {"trainer.json": {"crc32": 1}}},
    "entry without crc": {"files": {"trainer.json": {"size": "REAL"}}},  # right size: only the crc is missing
    "entry not an object": {"files": {"trainer.json": 7}},
    "path outside": {"files": {"../x": {"size": 1, "crc32": 1}, "trainer.json": {"size": 1, "crc32": 1}}},
}


@pytest.mark.parametrize("shape", sorted(BAD_MANIFESTS))
def test_manifest_of_the_wrong_shape_is_skipped_with_a_warning(tmp_path, engine_and_batches, caplog, shape):
    engine, _ = engine_and_batches
    root = tmp_path / "ckpt"
    manager = _manager(root, keep=3)
    for step in (2, 4):
        _save(manager, engine, step)
    real_size = (root / "step_00000004" / "trainer.json").stat().st_size
    bad = json.dumps(BAD_MANIFESTS[shape]).replace('"REAL"', str(real_size))
    (root / "step_00000004" / "manifest.json").write_text(bad)
    assert isinstance(verify_checkpoint(root / "step_00000004"), str)
    with caplog.at_level(logging.WARNING):
        assert _manager(root).select_resume("auto") == root / "step_00000002"  # resume selection
    assert "skipping checkpoint" in caplog.text and "step_00000004" in caplog.text
    # Pruning meets it as an older checkpoint: reported and removed, the save goes on.
    (root / "step_00000002" / "manifest.json").write_text(bad)
    _save(manager, engine, 6)
    assert "removing unusable checkpoint" in caplog.text
    assert [p.name for p in manager.checkpoints()] == ["step_00000006"]


# --- item 7: re-saving a step is atomic -----------------------------------------------------------


def test_resave_killed_between_moving_the_old_folder_and_the_rename_keeps_a_checkpoint(
    tmp_path, engine_and_batches, monkeypatch
):
    engine, batches = engine_and_batches
    root = tmp_path / "ckpt"
    manager = _manager(root, keep=1)
    _save(manager, engine, 2)
    real_replace = os.replace

    def killed_at_the_final_rename(src, dst):
        if Path(src).name.startswith(".incomplete_"):
            raise KeyboardInterrupt("killed between the two renames")
        return real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", killed_at_the_final_rename)
    with pytest.raises(KeyboardInterrupt):
        _save(manager, engine, 2)  # a re-save of step 2 (keep=1)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)

    restarted = _manager(root, keep=1)  # the next job
    assert restarted.select_resume("auto") == root / "step_00000002"
    assert verify_checkpoint(root / "step_00000002") is None
    restarted.load(root / "step_00000002", engine, seed=0)
    engine.train_step(batches.for_step(3))
    _save(restarted, engine, 3)
    assert _names(root) == ["step_00000003"]  # no leftovers, step 2 pruned by keep=1 only now
    assert _manager(root, keep=1).select_resume("auto") == root / "step_00000003"


def test_resave_killed_after_the_rename_drops_the_old_copy(tmp_path, engine_and_batches):
    engine, _ = engine_and_batches
    root = tmp_path / "ckpt"
    manager = _manager(root, keep=1)
    _save(manager, engine, 2)
    shutil.copytree(root / "step_00000002", root / ".replaced_step_00000002")  # the old copy left behind
    assert _manager(root, keep=1).select_resume("auto") == root / "step_00000002"
    assert _names(root) == ["step_00000002"]


# --- item 5: verification shares ---------------------------------------------------------------


def test_shares_cover_every_file_once_and_balance_bytes():
    files = [(f"engine/__{i}_0.distcp", 1000 + i) for i in range(8)] + [("trainer.json", 10), ("rng/rank_00000.pt", 50)]
    shares = [share_of(files, r, 4) for r in range(4)]
    assert sorted(n for s in shares for n in s) == sorted(n for n, _ in files)
    sizes = dict(files)
    loads = [sum(sizes[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())


# --- item 4: one job per checkpoint folder --------------------------------------------------------


HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from launcher.checkpoint.folder import lock_checkpoint_dir
    lock = lock_checkpoint_dir(Path(sys.argv[1]), Path(sys.argv[2]))
    print("locked", flush=True)
    time.sleep(float(sys.argv[3]))
    """
)


def hold_lock(root: Path, run_dir: Path, seconds: float = 600, slurm_job_id: str = "") -> subprocess.Popen:
    """A separate process that holds the folder lock (through the public function) until killed."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("SLURM_JOB_ID", None)
    if slurm_job_id:
        env["SLURM_JOB_ID"] = slurm_job_id
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(root), str(run_dir), str(seconds)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_holder_is_refused_naming_the_first_and_a_killed_holder_leaves_no_lock(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    root = tmp_path / "ckpt"
    holder = hold_lock(root, tmp_path / "run_a", slurm_job_id="4242")
    try:
        with pytest.raises(CheckpointDirInUse) as err:
            lock_checkpoint_dir(root, tmp_path / "run_b")
        text = str(err.value)
        for part in (f"pid {holder.pid}", "SLURM job 4242", str(tmp_path / "run_a"), "since ", "Fix:", "checkpoint.dir"):
            assert part in text, (part, text)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash or preemption: no clean-up
        holder.wait()
    lock = lock_checkpoint_dir(root, tmp_path / "run_b")
    assert json.loads((root / ".lock").read_text())["run_dir"] == str(tmp_path / "run_b")
    lock.release()


def test_requeued_job_with_the_same_slurm_id_waits_for_its_previous_incarnation(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    holder = hold_lock(root, tmp_path / "run", seconds=2, slurm_job_id="77")  # still exiting
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    lock = lock_checkpoint_dir(root, tmp_path / "run", same_job_wait_s=120)
    assert holder.wait() == 0
    lock.release()


# --- real 2-rank runs through `train` ----------------------------------------------------------

SAVE_EVERY_2 = ["+recipe=debug", "trainer.steps=6", "checkpoint.interval=2", "checkpoint.keep=3"]
VERIFIED = re.compile(r"rank (\d+) verified (\d+) of (\d+) files \((\d+) bytes, checksums on\) of (\S+)")


@pytest.mark.multiprocess
def test_fresh_run_keeps_the_old_timeline_and_every_rank_verifies_a_share_on_resume(tmp_path):
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    run_train(SAVE_EVERY_2, run_dir, check=True)
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000002", "step_00000004", "step_00000006"]

    # checkpoint.resume=none in the same run dir: a new timeline; the old one is moved aside, not deleted.
    run_train(["+recipe=debug", "trainer.steps=3", "checkpoint.interval=3", "checkpoint.resume=none"], run_dir, check=True)
    (aside,) = root.glob("abandoned_*")
    assert _names(aside) == ["ABANDONED.txt", "step_00000002", "step_00000004", "step_00000006"]
    for step in (2, 4, 6):
        assert verify_checkpoint(aside / f"step_{step:08d}") is None
    assert [p.name for p in sorted(root.glob("step_*"))] == ["step_00000003"]
    log = (run_dir / "logs" / "rank_0.log").read_text()
    assert f"aside to {aside}: step_00000002, step_00000004, step_00000006" in log

    # resume=auto continues the new timeline; both ranks verify a share of its files.
    run_train(["+recipe=debug", "trainer.steps=4", "checkpoint.interval=0"], run_dir, check=True)
    assert f"resumed from {root / 'step_00000003'}" in (run_dir / "logs" / "rank_0.log").read_text()
    shares = {}
    for rank in (0, 1):
        text = (run_dir / "logs" / f"rank_{rank}.log").read_text()
        found = [m for m in VERIFIED.finditer(text) if m.group(5) == str(root / "step_00000003")]
        assert len(found) == 1 and int(found[0].group(1)) == rank, text[-2000:]
        shares[rank] = (int(found[0].group(2)), int(found[0].group(3)), int(found[0].group(4)))
    total_files = len(json.loads((root / "step_00000003" / "manifest.json").read_text())["files"])
    assert all(count > 0 and nbytes > 0 for count, _, nbytes in shares.values()), shares
    assert shares[0][0] + shares[1][0] == shares[0][1] == shares[1][1] == total_files


@pytest.mark.multiprocess
def test_train_refuses_a_checkpoint_dir_another_job_holds(tmp_path):
    shared = tmp_path / "shared_checkpoints"
    other = tmp_path / "other_run"
    holder = hold_lock(shared, other)
    try:
        proc = run_train(["+recipe=debug", "trainer.steps=2", f"checkpoint.dir={shared}"], tmp_path / "run")
    finally:
        holder.kill()
        holder.wait()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "in use by another job" in out and f"pid {holder.pid}" in out and f"run dir {other}" in out, out[-3000:]
    assert "Fix:" in proc.stderr and "Traceback" not in out, out[-3000:]
    # Refused by `train` before torchrun started: no rank ran, nothing was written beside the lock file.
    assert not list((tmp_path / "run").glob("logs/rank_*.log")), out[-3000:]
    assert _names(shared) == []


def test_async_checkpoints_are_refused_for_deepspeed_with_a_fix():
    from launcher.plan.decide.resolve import validate

    problems = validate(compose_spec(["+recipe=debug", "backend=deepspeed", "checkpoint.async=true"]))
    assert len(problems) == 1 and problems[0].startswith("checkpoint.async=true") and "Fix: checkpoint.async=false" in problems[0]
    assert validate(compose_spec(["+recipe=debug", "checkpoint.async=true"])) == []  # native: accepted
