"""The development cluster and the rendered script on it, with real jobs.

These jobs do not train: cluster.python points at a small program (/bin/true, /bin/false,
or a shell stand-in that follows the rank side of the stop contract), so they take seconds.
Training end to end on SLURM is in test_slurm_train.py.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.launch import slurm
from launcher.plan.present.plan import build_plan
from slurm_cluster import DEV_CLUSTER, JOB_NODES, NODES, SlurmCluster, dev_cluster_up, slurm_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.slurm

SECRET = "s3cr3t-VALUE-9c41"


def submit_job(tmp_path: Path, monkeypatch, *overrides: str, **cluster_fields) -> tuple:
    """Render and submit the debug recipe as a SLURM job from tmp_path; returns (job_id, run_dir)."""
    spec = compose_spec(["+recipe=debug", "cluster=slurm", "cluster.exclusive=false", "cluster.rdzv_port=0", *overrides])
    if cluster_fields:
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, **cluster_fields))
    run_dir = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    assert slurm.submit(spec, build_plan(spec), run_dir) == 0
    info = (run_dir / slurm.JOB_INFO_NAME).read_text()
    job_id = info.split('"job_id": "')[1].split('"')[0]
    return job_id, run_dir


def main_log(run_dir: Path, job_id: str) -> str:
    return (run_dir / "logs" / f"slurm-{job_id}.out").read_text()


def test_dev_cluster_up_is_idempotent_and_runs_a_job(slurm_cluster: SlurmCluster, tmp_path):
    t0 = time.monotonic()
    up = dev_cluster_up()
    assert up.returncode == 0 and "already up" in up.stderr, up.stderr
    assert time.monotonic() - t0 < 30  # already up: no install, no restart (about 0.1 s idle)
    status = subprocess.run(["bash", str(DEV_CLUSTER), "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout
    for daemon in ("munged", "slurmctld", "slurmd"):
        assert f"{daemon}" in status.stdout and "stopped" not in status.stdout
    # One slurmd per node, each with its own address and port, every node usable.
    nodes = [f"n{i}" for i in range(1, NODES + 1)]
    for i, node in enumerate(nodes, start=1):
        assert re.search(rf"node {node} 127\.0\.1\.{i} port {7820 + i}: (idle|mixed|alloc)", status.stdout), status.stdout
    # A job across all nodes runs one task on each; the host name is the same, SLURMD_NODENAME is not.
    out2 = tmp_path / "nodes.out"
    job_id = slurm_cluster.sbatch_wrap(
        "srun bash -c 'echo $SLURMD_NODENAME $(hostname)'", f"--nodes={NODES}", "--ntasks-per-node=1", f"--output={out2}"
    )
    info = slurm_cluster.wait(job_id, timeout=60)
    assert info.state == "COMPLETED" and info.rc == 0, out2.read_text()
    lines = sorted(out2.read_text().split("\n")[:-1])
    assert [line.split()[0] for line in lines] == nodes, lines
    assert len({line.split()[1] for line in lines}) == 1, lines
    out = tmp_path / "hello.out"
    job_id = slurm_cluster.sbatch_wrap("echo hello from $SLURM_JOB_ID", f"--output={out}")
    info = slurm_cluster.wait(job_id, timeout=60)
    assert info.state == "COMPLETED" and info.rc == 0
    assert out.read_text().strip() == f"hello from {job_id}"


def test_metacharacters_and_secrets_in_a_real_job(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    value = f"x $(touch {marker}); `touch {marker}` 'single' \"double\" ; echo # end"
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    job_name = f"name $(touch {marker}); 'q'"
    job_id, run_dir = submit_job(
        tmp_path, monkeypatch, "cluster.python=/bin/true",
        job_name=job_name,
        env={"NASTY": value},
        sbatch_args=[f"--comment=c $(touch {marker}) \"q\" #x"],
        setup=['printf %s "$NASTY" > "$RUN_DIR/nasty.txt"', 'printf %s "${#WANDB_API_KEY}" > "$RUN_DIR/secret_len.txt"'],
    )
    info = slurm_cluster.wait(job_id, timeout=90)
    assert info.state == "COMPLETED", main_log(run_dir, job_id)
    assert (run_dir / "nasty.txt").read_text() == value
    assert not marker.exists()
    name = slurm_cluster.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%j|%k"]).stdout.strip()
    assert name == f"{slurm.sanitize_job_name(job_name)}|c $(touch {marker}) \"q\" #x"
    assert name.startswith("name-touch-")
    # The secret reached the job (its length) but no file of the run holds its value.
    assert (run_dir / "secret_len.txt").read_text() == str(len(SECRET))
    assert "secret WANDB_API_KEY is set (value not shown)" in main_log(run_dir, job_id)
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path


def test_failing_ranks_fail_the_job_and_their_error_is_in_the_main_log(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    job_id, run_dir = submit_job(
        tmp_path, monkeypatch, "cluster.python=/bin/false",
        # What a crashing rank leaves behind, written after the job started.
        setup=['printf "step 3\\nTraceback (most recent call last):\\nRuntimeError: rank 1 exploded\\n" > "$LOG_DIR/rank_1.log"',
               'printf "step 3 ok\\n" > "$LOG_DIR/rank_0.log"'],
    )
    info = slurm_cluster.wait(job_id, timeout=90)
    log = main_log(run_dir, job_id)
    assert info.state == "FAILED" and info.rc == 1, (info, log)
    assert "the ranks failed (srun exit 1)" in log
    assert "rank_1.log (last 30 lines)" in log and "RuntimeError: rank 1 exploded" in log
    assert "rank_0.log" not in log  # the healthy rank is not shown when a failing one is found


# Follows the rank side of the stop contract (launcher/runtime/signals.py) without training:
# "trains" until control/stop appears, then writes control/stopped and exits 0; a requeued
# run (SLURM_RESTART_COUNT=1) records that it ran and finishes.
# Submitting asks cluster.python which torch it runs (launcher/compat.py: `python -c CODE`):
# the stand-in is no Python and says so at once, so the job is built for the torch floor.
STAND_IN_RANKS = r"""#!/bin/bash
[[ "$1" == "-c" ]] && exit 1
run_dir="${@: -1}"
echo "run ${SLURM_RESTART_COUNT:-0}" >> "$run_dir/runs.txt"
if [[ "${SLURM_RESTART_COUNT:-0}" -ge 1 ]]; then exit 0; fi
for i in $(seq 1 600); do
  if [[ -e "$run_dir/control/stop" ]]; then
    printf '{"step": %d, "reason": "stop file"}' "$i" > "$run_dir/control/stopped"
    exit 0
  fi
  sleep 0.1
done
exit 7
"""


def submit_stand_in(slurm_cluster: SlurmCluster, tmp_path: Path, monkeypatch, *overrides: str) -> tuple:
    """Submit a job whose ranks are the stand-in script; wait until they run. Returns (job_id, run_dir)."""
    ranks = tmp_path / "ranks.sh"
    ranks.write_text(STAND_IN_RANKS)
    ranks.chmod(0o755)
    job_id, run_dir = submit_job(tmp_path, monkeypatch, f"cluster.python={ranks}", *overrides)
    deadline = time.monotonic() + 60
    while not (run_dir / "runs.txt").exists():
        assert time.monotonic() < deadline, f"job {job_id} never started: {slurm_cluster.job(job_id)}"
        time.sleep(0.2)
    return job_id, run_dir


def test_usr1_requeues_the_job_and_the_rerun_starts_clean(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    job_id, run_dir = submit_stand_in(slurm_cluster, tmp_path, monkeypatch, "cluster.max_requeues=1")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    info = slurm_cluster.wait(job_id, timeout=120, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    log = main_log(run_dir, job_id)
    assert info.state == "COMPLETED" and info.restarts == 1, (info, log)
    assert "received SIGUSR1" in log and "requeueing job" in log
    assert "job %s restart 1 (max 1)" % job_id in log
    assert (run_dir / "runs.txt").read_text() == "run 0\nrun 1\n"
    assert not (run_dir / "control" / "stop").exists() and not (run_dir / "control" / "stopped").exists()


def test_no_requeue_left_exits_3_and_says_how_to_resume(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    job_id, run_dir = submit_stand_in(slurm_cluster, tmp_path, monkeypatch, "cluster.max_requeues=0")
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", job_id])
    info = slurm_cluster.wait(job_id, timeout=60)
    log = main_log(run_dir, job_id)
    assert info.state == "FAILED" and info.rc == 3 and info.restarts == 0, (info, log)
    assert "not requeued: cluster.max_requeues=0 reached" in log
    # The path is printed shell-quoted (bash's ${VAR@Q}), so it can be pasted even with odd characters.
    assert f"Resume with: sbatch '{run_dir / 'job.sbatch'}'" in log


def test_failing_setup_line_fails_the_job(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    job_id, run_dir = submit_job(tmp_path, monkeypatch, "cluster.python=/bin/true", setup=["true", "false", "touch ran-on"])
    info = slurm_cluster.wait(job_id, timeout=60)
    log = main_log(run_dir, job_id)
    assert info.state == "FAILED" and info.rc == 1, (info, log)
    assert "a cluster.setup line failed (exit 1)" in log
    assert not (tmp_path / "ran-on").exists() and "srun exited" not in log


def test_time_limit_warning_signal_requeues_the_job(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    # --signal=B:USR1@58 with a 1-minute limit: SLURM warns the batch script within ~2-30 s.
    ranks = tmp_path / "ranks.sh"
    ranks.write_text(STAND_IN_RANKS)
    ranks.chmod(0o755)
    job_id, run_dir = submit_job(
        tmp_path, monkeypatch, f"cluster.python={ranks}", "cluster.max_requeues=1",
        "cluster.time=00:01:00", "cluster.signal_seconds=58",
    )
    info = slurm_cluster.wait(job_id, timeout=150, states={"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    log = main_log(run_dir, job_id)
    assert info.state == "COMPLETED" and info.restarts == 1, (info, log)
    assert "received SIGUSR1" in log and "requeueing job" in log
    assert (run_dir / "runs.txt").read_text() == "run 0\nrun 1\n"


# Records what the ranks would see: variables exported by cluster.setup and the rendezvous.
ENV_PROBE_RANKS = r"""#!/bin/bash
run_dir="${@: -1}"
printf '%s|%s|%s' "${PYTHONPATH-<unset>}" "${FROM_SETUP-<unset>}" "$PET_RDZV_ENDPOINT" > "$run_dir/seen.txt"
"""


def test_setup_export_of_an_unset_variable_persists_to_the_ranks(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the job inherits this environment (--export=ALL)
    ranks = tmp_path / "ranks.sh"
    ranks.write_text(ENV_PROBE_RANKS)
    ranks.chmod(0o755)
    job_id, run_dir = submit_job(
        tmp_path, monkeypatch, f"cluster.python={ranks}",
        setup=["export PYTHONPATH=/x:$PYTHONPATH", 'export FROM_SETUP="${MAYBE_UNSET:-fallback} $NEVER_SET."'],
    )
    info = slurm_cluster.wait(job_id, timeout=90)
    log = main_log(run_dir, job_id)
    assert info.state == "COMPLETED" and info.rc == 0, (info, log)
    assert "unbound variable" not in log + (run_dir / "logs" / f"slurm-{job_id}.err").read_text()
    port = 20000 + int(job_id) % 20000  # cluster.rdzv_port=0: derived from the job id
    host = slurm_cluster.run(["scontrol", "show", "hostnames", info.fields["NodeList"]]).stdout.split()[0]
    assert (run_dir / "seen.txt").read_text() == f"/x:|fallback .|{host}:{port}"


def test_percent_in_the_run_dir_reaches_sbatch_literally(slurm_cluster: SlurmCluster, tmp_path, monkeypatch):
    spec = compose_spec(["+recipe=debug", "cluster=slurm", "cluster.exclusive=false", "cluster.python=/bin/true"])
    run_dir = tmp_path / "lr 5% %j"
    monkeypatch.chdir(tmp_path)
    assert slurm.submit(spec, build_plan(spec), run_dir) == 0
    job_id = (run_dir / slurm.JOB_INFO_NAME).read_text().split('"job_id": "')[1].split('"')[0]
    info = slurm_cluster.wait(job_id, timeout=90)
    assert info.state == "COMPLETED", info
    assert "launcher: training finished" in main_log(run_dir, job_id)  # the log is where `train` said


# Fails on the job's first run, succeeds on its rerun; each node records what it saw. The first
# run fails only once every node of the step has written its line: srun ends the step at the first
# failed task, and a node still starting would never write one. (cluster.python also runs the
# restart decision, whose last argument is a file, not the run folder: that call just fails.)
FAIL_ONCE_RANKS = r"""#!/bin/bash
run_dir="${@: -1}"
[[ -d "$run_dir" ]] || exit 1
restart="${SLURM_RESTART_COUNT:-0}"
echo "$restart $SLURMD_NODENAME $PET_RDZV_ENDPOINT" >> "$run_dir/runs.txt"
((restart > 0)) && exit 0
for i in $(seq 1 300); do
  (($(grep -c "^0 " "$run_dir/runs.txt") >= SLURM_NNODES)) && exit 1
  sleep 0.1
done
exit 1
"""


def test_two_node_job_requeues_on_failure_with_the_rendezvous_at_the_first_node_address(
    slurm_cluster: SlurmCluster, tmp_path, monkeypatch
):
    """cluster.requeue_on_failure=true: failed ranks requeue the job (the rerun succeeds);
    cluster.rdzv_host_from=nodeaddr: the endpoint is the first node's NodeAddr (127.0.1.I for nI)."""
    ranks = tmp_path / "ranks.sh"
    ranks.write_text(FAIL_ONCE_RANKS)
    ranks.chmod(0o755)
    job_id, run_dir = submit_job(
        tmp_path, monkeypatch, f"cluster.python={ranks}", f"cluster.nodes={JOB_NODES}",
        "cluster.requeue_on_failure=true", "cluster.rdzv_host_from=nodeaddr", "cluster.max_requeues=1",
    )
    first = slurm_cluster.wait(job_id, timeout=120, states={"COMPLETED", "FAILED", "CANCELLED"})
    log = main_log(run_dir, job_id)
    assert first.state == "COMPLETED" and first.restarts == 1, (first, log)
    assert "cluster.requeue_on_failure: requeueing job" in log, log
    port = 20000 + int(job_id) % 20000
    runs = sorted((run_dir / "runs.txt").read_text().splitlines())
    assert [r.split()[0] for r in runs] == ["0"] * JOB_NODES + ["1"] * JOB_NODES, runs
    for restart in ("0", "1"):
        seen = [r.split()[1:] for r in runs if r.split()[0] == restart]
        nodes = sorted(node for node, _ in seen)
        assert len(set(nodes)) == JOB_NODES, runs  # one task per node
        # Node nI has the address 127.0.1.I (dev-cluster.sh); the first node hosts the rendezvous.
        assert {endpoint for _, endpoint in seen} == {f"127.0.1.{nodes[0][1:]}:{port}"}, runs


def test_prepare_runs_as_a_one_node_cpu_job_and_writes_what_a_local_prepare_writes(slurm_cluster: SlurmCluster,
                                                                                   tmp_path):
    """`train action=prepare cluster=slurm` submits a real job on the dev cluster; its dataset
    folder equals, byte for byte, the one the same prepare writes locally."""
    from launcher.data.prepare import run_prepare
    from tests.conftest import TRAIN, train_env
    from tests.test_data_prepare import cfg, folder_bytes, make_corpus, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    make_corpus(tmp_path / "raw", 40)
    run_prepare(cfg(tmp_path, tok, "local", workers=2))
    proc = subprocess.run(
        [TRAIN, "action=prepare", f"prepare.input={tmp_path / 'raw'}", f"prepare.output={tmp_path / 'on_slurm'}",
         f"prepare.tokenizer={tok}", "prepare.workers=2", "cluster=slurm", "cluster.exclusive=false",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path, env=train_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    job_id = re.search(r"submitted SLURM prepare job (\d+)", proc.stdout).group(1)
    info = slurm_cluster.wait(job_id, timeout=300)
    log = (tmp_path / "run" / "logs" / f"prepare-{job_id}.out")
    assert info.state == "COMPLETED" and info.rc == 0, log.read_text()[-3000:] if log.exists() else info.fields
    assert folder_bytes(tmp_path / "on_slurm") != {}
    assert folder_bytes(tmp_path / "on_slurm").keys() == folder_bytes(tmp_path / "local").keys()
    for name, data in folder_bytes(tmp_path / "local").items():
        if name != "manifest.json":  # the manifest names its own folder's inputs and times
            assert folder_bytes(tmp_path / "on_slurm")[name] == data, name
