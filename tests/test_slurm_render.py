"""The sbatch script as rendered: quoting, secrets, options. No cluster needed (bash only)."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.launch import slurm
from launcher.plan.present.plan import build_plan
from launcher.resilience.restarts import EXCLUDE_DOWN

SECRET = "s3cr3t-VALUE-7f2a"


def make_spec(*overrides: str, **cluster_fields):
    spec = compose_spec(["+recipe=debug", "cluster=slurm", *overrides])
    if cluster_fields:
        spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, **cluster_fields))
    return spec


def render(spec, run_dir: Path) -> str:
    return slurm.render_script(spec, build_plan(spec), run_dir)


def nasty(tmp_path: Path) -> str:
    """A value that runs `touch` if any shell ever evaluates it, plus quotes and `;`."""
    marker = tmp_path / "pwned"
    return f"x $(touch {marker}); `touch {marker}` 'single' \"double\" ; echo done \\ $HOME #end"


def sbatch_lines(script: str) -> dict:
    out = {}
    for line in script.splitlines():
        m = re.match(r"^#SBATCH --([\w-]+)(?:=(.*))?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def test_env_value_and_run_dir_with_metacharacters_round_trip_through_bash(tmp_path):
    value = nasty(tmp_path)
    run_dir = tmp_path / "run $(touch pwned2); 'q'"
    spec = make_spec(env={"NASTY": value, "PLAIN": "1"})
    script = render(spec, run_dir)
    exports = [line for line in script.splitlines() if line.startswith("export NASTY=") or line.startswith("RUN_DIR=")]
    assert len(exports) == 2, script
    probe = "\n".join(exports) + '\nprintf "%s\\n%s" "$NASTY" "$RUN_DIR"'
    proc = subprocess.run(["bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert proc.stdout == f"{value}\n{run_dir.resolve()}"
    assert not (tmp_path / "pwned").exists()
    assert not (tmp_path / "pwned2").exists()


def test_job_name_is_sanitised(tmp_path):
    spec = make_spec(job_name=nasty(tmp_path))
    name = sbatch_lines(render(spec, tmp_path / "run"))["job-name"]
    assert re.fullmatch(r'"[A-Za-z0-9._-]{1,64}"', name), name
    assert slurm.sanitize_job_name("llama 70b; rm -rf /") == "llama-70b-rm-rf"
    assert slurm.sanitize_job_name("$();'\"") == "train"


def test_whole_script_is_valid_bash(tmp_path):
    spec = make_spec(
        env={"A": nasty(tmp_path)},
        setup=["echo setup-line"],
        after=["11", "12"],
        sbatch_args=["--comment=a b"],
        job_name=nasty(tmp_path),
    )
    path = tmp_path / "job.sbatch"
    path.write_text(render(spec, tmp_path / "run dir"))
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_sbatch_quote_escapes_for_sbatchs_parser():
    assert slurm.sbatch_quote('a "b" #c \\d') == '"a \\"b\\" #c \\\\d"'
    with pytest.raises(slurm.SlurmConfigError):
        slurm.sbatch_quote("two\nlines")


def test_script_holds_no_secret_value(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("MY_TOKEN", SECRET + "-2")
    spec = make_spec(secret_env=["WANDB_API_KEY", "MY_TOKEN"], env={"VISIBLE": "ok"})
    script = render(spec, tmp_path / "run")
    assert SECRET not in script
    assert "WANDB_API_KEY" in script and "MY_TOKEN" in script  # forwarded by name
    assert sbatch_lines(script)["export"] == '"ALL"'


def test_secret_in_cluster_env_is_refused(tmp_path):
    spec = make_spec(env={"WANDB_API_KEY": SECRET})
    with pytest.raises(slurm.SlurmConfigError) as err:
        render(spec, tmp_path / "run")
    assert "cluster.env.WANDB_API_KEY" in str(err.value)
    assert SECRET not in str(err.value)


def test_every_bad_cluster_value_is_reported_before_anything_is_written(tmp_path, capsys):
    spec = make_spec(
        after=["12", "not-a-job"],
        sbatch_args=["reservation=big"],
        env={"1BAD": "x"},
        max_requeues=-1,
        rdzv_port=70000,
        template=str(tmp_path / "missing.j2"),
    )
    code = slurm.submit(spec, build_plan(spec), tmp_path / "run")
    err = capsys.readouterr().err
    assert code == 2
    for key in ("cluster.after[1]", "cluster.sbatch_args[0]", "'1BAD'", "cluster.max_requeues=-1",
                "cluster.rdzv_port=70000", "cluster.template"):
        assert key in err, err
    assert not (tmp_path / "run" / "job.sbatch").exists()


def test_options_cpu_cluster(tmp_path):
    spec = make_spec(
        "cluster.gpus_per_node=2", "cluster.partition=debug", "cluster.exclusive=false",
        "cluster.signal_seconds=45", "cluster.after=[101,102]", "cluster.max_requeues=2",
    )
    assert spec.trainer.device == "cpu"
    opts = sbatch_lines(render(spec, tmp_path / "run"))
    assert "gpus-per-node" not in opts  # CPU: gpus_per_node is ranks per node, no GPUs requested
    assert "exclusive" not in opts
    assert opts["ntasks-per-node"] == '"1"'
    assert opts["signal"] == '"B:USR1@45"'
    assert opts["dependency"] == '"afterany:101:102"'
    assert "requeue" in opts and opts["open-mode"] == '"append"'
    assert opts["output"] == f'"{(tmp_path / "run").resolve()}/logs/slurm-%j.out"'


def test_options_gpu_cluster_and_container(tmp_path):
    spec = make_spec(
        "trainer.device=cuda", "cluster.gpus_per_node=8", "cluster.nodes=2", "cluster.cpus_per_task=16",
        "cluster.max_requeues=0", "cluster.container=nvcr.io/nvidia/pytorch:24.05-py3", "parallel.dp_shard=-1",
        "trainer.global_batch_size=32",  # 16 ranks x micro-batch 2: a batch the resolver can split
    )
    script = render(spec, tmp_path / "run")
    opts = sbatch_lines(script)
    assert opts["gpus-per-node"] == '"8"' and opts["nodes"] == '"2"' and opts["cpus-per-task"] == '"16"'
    assert "no-requeue" in opts and "requeue" not in opts
    srun = next(line.strip() for line in script.splitlines() if line.strip().startswith("srun "))
    assert "--ntasks=2" in srun and "--cpus-per-task=16" in srun
    assert "--container-image=nvcr.io/nvidia/pytorch:24.05-py3" in srun
    # The in-job restart decision needs the launcher's Python: in the image, one task on one node.
    decide = next(line.strip() for line in script.splitlines() if "-m launcher.resilience.restarts" in line)
    assert decide.startswith("srun --nodes=1 --ntasks=1 --container-image=nvcr.io/nvidia/pytorch:24.05-py3 ")
    assert " python -m launcher.resilience.restarts decide --run-dir " in decide


def test_launch_uses_torchrun_with_c10d_on_first_node(tmp_path):
    spec = make_spec("cluster.gpus_per_node=2", "cluster.rdzv_port=29611")
    script = render(spec, tmp_path / "run")
    launch = next(line.strip() for line in script.splitlines() if "torch.distributed.run" in line)
    assert "--rdzv_backend=c10d" in launch and "--nproc_per_node=2" in launch and "--nnodes=1" in launch
    assert "--rdzv_endpoint" not in launch  # comes from PET_RDZV_ENDPOINT, set inside the job
    assert 'STEP_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n "$NODES" | paste -sd, -)' in script
    assert 'export LAUNCHER_RDZV_NODE="${STEP_NODES%%,*}"' in script  # the step's first node hosts it
    assert "RDZV_PORT=29611" in script
    assert 'export PET_RDZV_ID="${SLURM_JOB_ID}"' in script


def test_a_failed_srun_step_is_followed_by_the_restart_decision_and_a_new_step(tmp_path):
    """cluster.max_restarts (3 on SLURM) reaches the script; after a failed step it asks
    launcher.resilience.restarts (this Python, quoted) and loops to a new srun step."""
    script = render(make_spec("cluster.max_restarts=2"), tmp_path / "run dir")
    assert "MAX_RESTARTS=2" in script
    decide = next(line.strip() for line in script.splitlines() if "-m launcher.resilience.restarts" in line)
    run_dir = str((tmp_path / "run dir").resolve())
    assert decide.startswith(f"{shlex.quote(sys.executable)} -m launcher.resilience.restarts decide "
                             f"--run-dir {shlex.quote(run_dir)}")
    assert '--restarts-done "$RESTARTS_DONE" --max-restarts "$MAX_RESTARTS" --exit-code "$SRUN_RC"' in script
    assert 'export LAUNCHER_RESTART="$RESTARTS_DONE"' in script
    assert '--attempt-started "$STEP_STARTED" --lost-nodes "$LOST_NODES"' in script
    assert '--allocation "$ALLOCATION" --step-nodes "$STEP_NODES" --excluded "$EXCLUDED_NODES"' in script
    assert "MAX_RESTARTS=3" in render(make_spec(), tmp_path / "default")


def test_dry_run_prints_script_and_submits_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch reachable: a submission would fail
    spec = make_spec("cluster.dry_run=true")
    code = slurm.submit(spec, build_plan(spec), tmp_path / "run")
    out = capsys.readouterr().out
    assert code == 0
    assert str((tmp_path / "run" / "job.sbatch").resolve()) in out
    assert "#SBATCH --job-name=" in out
    assert not (tmp_path / "run" / slurm.JOB_INFO_NAME).exists()


def test_user_template_gets_the_same_filters(tmp_path):
    tpl = tmp_path / "mine.j2"
    tpl.write_text("#!/bin/bash\necho {{ run_dir|q }}\n{% for k, v in env.items() %}export {{ k }}={{ v|q }}\n{% endfor %}")
    spec = make_spec(template=str(tpl), env={"X": "a'b"})
    assert render(spec, tmp_path / "r un") == f"#!/bin/bash\necho '{(tmp_path / 'r un').resolve()}'\nexport X='a'\"'\"'b'\n"


STUB_SRUN = """#!/usr/bin/env bash
# Stand-in for srun: the ranks "checkpoint and stop" (writes control/stopped) and exit 0.
while (($#)); do
  if [[ $1 == --run-dir ]]; then mkdir -p "$2/control"; echo '{"step": 1}' > "$2/control/stopped"; fi
  shift
done
exit 0
"""

STUB_SCONTROL = """#!/usr/bin/env bash
# Stand-in for scontrol: node names work, requeue is refused (as when SLURM already requeues the job).
[[ $1 == show ]] && { echo localhost; exit 0; }
exit 1
"""


@pytest.mark.parametrize("restart_count,expected_rc", [(0, 1), (5, 3)], ids=["requeue-refused", "no-requeues-left"])
def test_whole_script_runs_with_a_hostile_run_dir_and_executes_nothing(tmp_path, restart_count, expected_rc):
    """Run the rendered script end to end (stub srun/scontrol) through its resubmit messages."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", STUB_SRUN), ("scontrol", STUB_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run $(touch pwned); `touch pwned2` 'q'"
    run_dir.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render(make_spec(), run_dir))
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1", "SLURM_RESTART_COUNT": str(restart_count),
    }
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == expected_rc, proc.stdout + proc.stderr
    assert "resume with: sbatch" in proc.stdout.lower()
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    assert not list(run_dir.rglob("pwned*"))


# Stand-in for srun: records what the ranks would see (PATH-like variables, the rendezvous) in the run dir.
STUB_SRUN_ENV = """#!/usr/bin/env bash
while (($#)); do
  if [[ $1 == --run-dir ]]; then
    printf '%s|%s|%s' "${PYTHONPATH-<unset>}" "${FROM_SETUP-<unset>}" "$PET_RDZV_ENDPOINT" > "$2/seen.txt"
  fi
  shift
done
exit 0
"""


def run_script_with_stubs(tmp_path: Path, spec, job_id: str = "7") -> tuple:
    """Render `spec` and run the script under bash with a stand-in srun; returns (process, run_dir)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", STUB_SRUN_ENV), ("scontrol", STUB_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / f"run{job_id}"
    run_dir.mkdir()
    script = tmp_path / f"job{job_id}.sbatch"
    script.write_text(render(spec, run_dir))
    env = {  # no PYTHONPATH, as on a fresh login
        "PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_NUM_NODES": "1",
    }
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    return proc, run_dir


def test_setup_lines_with_unset_variables_run_and_their_exports_reach_srun(tmp_path):
    spec = make_spec(setup=[
        "export PYTHONPATH=/x:$PYTHONPATH",  # unset here: aborted under `set -u`
        'if [[ -n $NOT_SET_ANYWHERE ]]; then exit 9; fi',
        "false | true",  # plain bash rules: a pipeline's status is its last command's
        'export FROM_SETUP="set up"',
    ])
    proc, run_dir = run_script_with_stubs(tmp_path, spec)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unbound variable" not in proc.stderr
    assert (run_dir / "seen.txt").read_text() == "/x:|set up|localhost:20007"


def test_a_failing_setup_line_is_reported_by_its_text(tmp_path):
    spec = make_spec(setup=["true", "ls /no/such/dir-5b1c", "touch ran-on"])
    proc, run_dir = run_script_with_stubs(tmp_path, spec)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "launcher: error: a cluster.setup line failed (exit 2): ls /no/such/dir-5b1c" in proc.stdout
    assert not (tmp_path / "ran-on").exists() and not (run_dir / "seen.txt").exists()


def test_default_rendezvous_port_is_derived_from_the_job_id(tmp_path):
    spec = make_spec()
    assert spec.cluster.rdzv_port == 0
    ports = []
    for job_id in ("7", "41234"):
        proc, run_dir = run_script_with_stubs(tmp_path, spec, job_id)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ports.append((run_dir / "seen.txt").read_text().rsplit(":", 1)[1])
    assert ports == ["20007", "21234"]  # 20000 + job id % 20000: two jobs on one node differ
    fixed, run_dir = run_script_with_stubs(tmp_path, make_spec("cluster.rdzv_port=29611"), "8")
    assert (run_dir / "seen.txt").read_text().endswith("localhost:29611")  # a port the user sets wins


def test_percent_in_the_run_dir_is_literal_for_sbatch_log_patterns(tmp_path):
    run_dir = tmp_path / "lr 5% %j"
    opts = sbatch_lines(render(make_spec(), run_dir))
    logs = f"{run_dir.resolve()}/logs".replace("%", "%%")
    assert opts["output"] == f'"{logs}/slurm-%j.out"' and opts["error"] == f'"{logs}/slurm-%j.err"'
    paths = slurm.slurm_paths(make_spec().cluster, run_dir)
    assert paths.log_paths("12") == [run_dir.resolve() / "logs" / "slurm-12.out", run_dir.resolve() / "logs" / "slurm-12.err"]


def test_container_mounts_refuse_a_run_dir_with_comma_or_colon(tmp_path, capsys):
    spec = make_spec("cluster.container=img.sqsh")
    for name in ("a,b", "a:b"):
        run_dir = tmp_path / name
        code = slurm.submit(spec, build_plan(spec), run_dir)
        err = capsys.readouterr().err
        assert code == 2, err
        assert f"the run directory {str(run_dir.resolve())!r} contains {name[1]!r}" in err
        assert "Fix: choose a run directory without them" in err and "Traceback" not in err
        assert not (run_dir / "job.sbatch").exists()
    srun = next(l.strip() for l in render(spec, tmp_path / "plain").splitlines() if l.strip().startswith("srun "))
    assert "--container-mounts=" in srun


def test_multi_node_keys_render_and_bad_rdzv_host_from_is_refused(tmp_path):
    from launcher.config.validate import validate as validate_spec

    spec = make_spec("cluster.nodes=2", "cluster.requeue_on_failure=true", "cluster.rdzv_host_from=nodeaddr")
    script = render(spec, tmp_path / "run")
    assert "no-kill" in sbatch_lines(script)  # a dead node does not end the allocation before the script reports it
    assert "REQUEUE_ON_FAILURE=True" in script
    assert "scontrol show node \"$1\" | grep -o 'NodeAddr=" in script
    assert '[[ "$SLURMD_NODENAME" == "$LAUNCHER_RDZV_NODE" ]] && h=1' in script
    single = render(make_spec(), tmp_path / "run1")
    assert "no-kill" not in sbatch_lines(single) and "REQUEUE_ON_FAILURE=False" in single
    assert "NodeAddr" not in single
    problems = validate_spec(compose_spec(["+recipe=debug", "cluster=slurm", "cluster.rdzv_host_from=dns"]))
    assert any(p.startswith("cluster.rdzv_host_from='dns' is not one of hostname, nodeaddr") and "Fix:" in p for p in problems), problems


# Stand-ins for an allocation of $STUB_HOSTS (job 7, already excluded from n0): scontrol logs what it
# is asked to change (a running job's ExcNodeList only once requeued), sinfo reports the nodes listed in $STUBS/lost as not responding, and srun logs
# each step's --nodelist and rendezvous; its first step fails as $STUBS/first_step.sh says, the next succeeds.
STUB_SCONTROL_NODES = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") printf '%s\\n' $STUB_HOSTS ;;
  "show job") echo "JobId=7 ExcNodeList=n0 Restarts=0" ;;
  *) echo "$*" >> "$STUBS/scontrol.log"
     [[ $1 == requeue ]] && touch "$STUBS/requeued"
     # As SLURM 22.05 (the dev cluster's): a running job's ExcNodeList cannot change, a pending one's can.
     if [[ $1 == update && ! -f "$STUBS/requeued" ]]; then echo "Job is no longer pending execution" >&2; exit 1; fi ;;
esac
"""
STUB_SINFO = """#!/usr/bin/env bash
cat "$STUBS/lost" 2>/dev/null
"""
STUB_SRUN_STEPS = """#!/usr/bin/env bash
for arg; do [[ $arg == --nodelist=* ]] && nodes=${arg#--nodelist=}; done
echo "$nodes $PET_RDZV_ENDPOINT" >> "$STUBS/steps.log"
(($(wc -l < "$STUBS/steps.log") > 1)) && exit 0
source "$STUBS/first_step.sh"
"""


def run_spare_script(tmp_path: Path, first_step: str, hosts: str, *overrides: str) -> tuple:
    """Run the script of `cluster.nodes=2` + `overrides` on the allocation `hosts` with the stand-ins above and the real
    restart decision; returns (process, run_dir, steps: [(nodelist, rendezvous)], scontrol's log)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name, text in (("srun", STUB_SRUN_STEPS), ("scontrol", STUB_SCONTROL_NODES), ("sinfo", STUB_SINFO)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (stubs / "first_step.sh").write_text(first_step)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = tmp_path / "job.sbatch"
    script.write_text(render(make_spec("cluster.nodes=2", "cluster.gpus_per_node=2", "trainer.device=cpu",
                                       "cluster.rdzv_port=29611", *overrides), run_dir))
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "7", "STUBS": str(stubs),
           "STUB_HOSTS": hosts, "SLURM_JOB_NODELIST": "n[1-3]", "RUN_DIR_FOR_STUB": str(run_dir),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # the decision imports this checkout
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    steps = [tuple(line.split()) for line in (stubs / "steps.log").read_text().splitlines()]
    log = (stubs / "scontrol.log").read_text() if (stubs / "scontrol.log").exists() else ""
    return proc, run_dir, steps, log


def test_with_a_spare_the_job_asks_for_one_more_node_and_restarts_on_it_without_requeueing(tmp_path):
    # The first step's rank 1 on n2 crashes (its failure summary names n2); the decision excludes n2.
    crash_on_n2 = ('mkdir -p "$RUN_DIR_FOR_STUB/failure"; printf \'{"what": "exception", "error": "RuntimeError: '
                   'CUDA error: uncorrectable ECC error", "rank": 1, "host": "n2", "last_step": 6, "unix_time": %s}\' '
                   '"$(date +%s)" > "$RUN_DIR_FOR_STUB/failure/summary.json"; exit 1\n')
    proc, run_dir, steps, log = run_spare_script(tmp_path, crash_on_n2, "n1 n2 n3", "cluster.spare_nodes=1")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sbatch_lines(render(make_spec("cluster.nodes=2", "cluster.spare_nodes=1"), tmp_path / "r"))["nodes"] == '"3"'
    assert steps == [("n1,n2", "n1:29611"), ("n1,n3", "n1:29611")], out  # srun --nodes=2 on the decision's nodes
    assert "excluding node(s) n2 for the rest of the job" in out and log == "", (out, log)  # no requeue
    events = [json.loads(line) for line in (run_dir / "resilience.jsonl").read_text().splitlines()]
    assert [(e["event"], e.get("node"), e["action"]) for e in events] == [
        ("failure", "n2", "restart"), ("exclude", "n2", "restart on a spare")]


def test_without_a_spare_a_lost_node_is_requeued_without_waiting_to_exclude_it(tmp_path):
    # n2 stops responding: its ranks write nothing, sinfo -d names it; no spare to take its place.
    lost_n2 = 'echo n2 > "$STUBS/lost"; exit 1\n'
    proc, run_dir, steps, log = run_spare_script(tmp_path, lost_n2, "n1 n2", "cluster.requeue_on_failure=true")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and steps == [("n1,n2", "n1:29611")], out
    # A node that stopped responding is DOWN and not allocated while down: the requeue does not wait
    # to add it to ExcNodeList (SLURM takes it only once the job is pending), and says so.
    assert "no spare node left" in out and "node(s) n2 not added to ExcNodeList: not responding" in out
    assert log.splitlines() == ["requeue 7"], log
    event = json.loads((run_dir / "resilience.jsonl").read_text().splitlines()[-1])
    assert (event["event"], event["node"], event["action"]) == ("exclude", "n2", EXCLUDE_DOWN)
