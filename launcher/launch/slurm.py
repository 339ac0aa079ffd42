"""Submit a planned job to SLURM: render the sbatch script into the run directory, call sbatch.

The script comes from a Jinja2 template (slurm/sbatch.sh.j2, or cluster.template). It starts
one torch elastic launcher per node with srun; the c10d rendezvous is hosted on the first
node of the allocation. It traps the preemption / time-limit warning (USR1) and SIGTERM,
turns them into a stop request for the ranks (the file <run_dir>/control/stop), and
requeues itself when the ranks report a clean stop (<run_dir>/control/stopped).

Quoting: every value reaches the script through a filter, `q` (shlex.quote) for shell text
and `sbatch_q` for #SBATCH lines, which sbatch parses itself (double quotes, backslash
escapes; a bare `#` starts a comment). Secrets (cluster.secret_env) are forwarded by name
through the submitting environment and never written.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import jinja2

from launcher.config.slurm_keys import SlurmConfigError, sanitize_job_name, slurm_key_problems
from launcher.config.schema import ClusterConfig, JobConfig
from launcher.compat import TorchCapabilities, floor_capabilities, ranks_capabilities
from launcher.launch.torchrun import shutdown_timeout_of, torchrun_argv, torchrun_env
from launcher.paths import slurm_dir
from launcher.plan.decide.eval_jobs import eval_jobs_on
from launcher.plan.present.plan import Plan

DEFAULT_TEMPLATE = "sbatch.sh.j2"
SCRIPT_NAME = "job.sbatch"
JOB_INFO_NAME = "slurm_job.json"
SBATCH_TIMEOUT_S = 120


# --- quoting ------------------------------------------------------------------------------


def sbatch_quote(value: Any) -> str:
    """Quote one value for an `#SBATCH` line as sbatch's own parser reads it.

    sbatch (not the shell) parses these lines: inside double quotes whitespace and `#` are
    literal, and a backslash escapes the next character. Shell syntax ($, `, ;) means
    nothing there. A newline cannot be represented and is refused.
    """
    text = str(value)
    if "\n" in text or "\r" in text:
        raise SlurmConfigError([f"a #SBATCH value may not contain a newline: {text!r}"])
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shell_quote(value: Any) -> str:
    """Quote one value for the shell (shlex.quote of its string form)."""
    return shlex.quote(str(value))


def container_mount_problems(cluster: ClusterConfig, run_dir: Path, cwd: Path) -> List[str]:
    """With cluster.container, folders that `--container-mounts=SRC:DST,...` cannot express.

    pyxis splits that option at `,` (between mounts) and `:` (source, target, flags) and has
    no escape for either, so such a folder is refused rather than mounted wrongly.
    """
    if not cluster.container:
        return []
    problems = []
    for what, folder, fix in (
        ("run directory", run_dir, "choose a run directory without them (hydra.run.dir=PATH)"),
        ("working directory", cwd, "run `train` from a folder without them"),
    ):
        bad = sorted({c for c in str(folder) if c in ",:"})
        if bad:
            problems.append(
                f"cluster.container={cluster.container!r}: the {what} {str(folder)!r} contains "
                f"{' and '.join(repr(c) for c in bad)}, which --container-mounts cannot express "
                f"(it separates mounts with ',' and source:target with ':'). Fix: {fix}, or cluster.container=''."
            )
    return problems


# --- rendering ----------------------------------------------------------------------------


@dataclass
class SlurmPaths:
    """Where a submission puts its files (all absolute)."""

    run_dir: Path
    script: Path
    logs_dir: Path
    stdout: str  # sbatch pattern, %j = job id
    stderr: str
    template: Path

    def log_paths(self, job_id: str) -> List[Path]:
        return [Path(expand_sbatch_pattern(p, job_id)) for p in (self.stdout, self.stderr)]


def escape_sbatch_pattern(text: str) -> str:
    """`text` for an sbatch filename pattern (--output/--error): a literal `%` is written `%%`."""
    return text.replace("%", "%%")


def expand_sbatch_pattern(pattern: str, job_id: str) -> str:
    """The file name sbatch makes of `pattern` for `job_id` (only the %j and %% it is given here)."""
    return re.sub(r"%([%j])", lambda m: "%" if m.group(1) == "%" else job_id, pattern)


def template_path(cluster: ClusterConfig) -> Path:
    """The template used: cluster.template when set, else the built-in slurm/sbatch.sh.j2."""
    if cluster.template:
        return Path(cluster.template).expanduser().resolve()
    return slurm_dir() / DEFAULT_TEMPLATE


def slurm_paths(cluster: ClusterConfig, run_dir: Path) -> SlurmPaths:
    run_dir = Path(run_dir).resolve()
    logs = run_dir / "logs"
    return SlurmPaths(
        run_dir=run_dir,
        script=run_dir / SCRIPT_NAME,
        logs_dir=logs,
        # sbatch expands %-patterns in --output/--error: a `%` of the run dir must stay literal.
        stdout=escape_sbatch_pattern(str(logs)) + "/slurm-%j.out",
        stderr=escape_sbatch_pattern(str(logs)) + "/slurm-%j.err",
        template=template_path(cluster),
    )


def _uses_gpus(spec: JobConfig) -> bool:
    # On a CPU cluster gpus_per_node is the number of ranks per node: request no GPUs.
    return spec.trainer.device != "cpu" and spec.cluster.gpus_per_node > 0


def sbatch_options(spec: JobConfig, paths: SlurmPaths, cwd: Path) -> List[Dict[str, Optional[str]]]:
    """The #SBATCH options as (name, value) pairs; value None is a bare flag."""
    c = spec.cluster
    name = sanitize_job_name(c.job_name or spec.run.name or f"train-{spec.model.name}")
    opts: List[tuple] = [
        ("job-name", name),
        # The spares (cluster.spare_nodes) are allocated with the job; each srun step uses c.nodes.
        ("nodes", c.nodes + c.spare_nodes),
        ("ntasks-per-node", 1),
    ]
    if _uses_gpus(spec):
        opts.append(("gpus-per-node", c.gpus_per_node))
    if c.cpus_per_task > 0:
        opts.append(("cpus-per-task", c.cpus_per_task))
    for key in ("partition", "account", "qos", "time", "constraint", "mem"):
        value = getattr(c, key)
        if value:
            opts.append((key, value))
    if c.exclusive:
        opts.append(("exclusive", None))
    opts += [
        ("chdir", str(cwd)),
        ("output", paths.stdout),
        ("error", paths.stderr),
        # Requeued runs of the job append to its logs instead of truncating them.
        ("open-mode", "append"),
        ("export", "ALL"),
    ]
    if c.signal_seconds > 0:
        opts.append(("signal", f"B:USR1@{c.signal_seconds}"))
    opts.append(("requeue", None) if c.max_requeues > 0 else ("no-requeue", None))
    if c.nodes + c.spare_nodes > 1:
        # A failed node does not end the allocation at once: srun ends with "Node failure on N",
        # and the script names the node and requeues (cluster.requeue_on_failure) itself.
        opts.append(("no-kill", None))
    if c.after:
        # afterany: a chained job starts once its predecessors end, however they ended, and
        # resumes from the newest checkpoint (a failed or time-limited run still left one).
        opts.append(("dependency", "afterany:" + ":".join(str(j).strip() for j in c.after)))
    return [{"name": k, "value": None if v is None else str(v)} for k, v in opts]


def srun_argv(spec: JobConfig, cwd: Path, run_dir: Path) -> List[str]:
    """srun options: one launcher task per node; a node's failure stops the others. The script adds
    `--nodelist` (the step's nodes, from the restart decision with cluster.spare_nodes)."""
    c = spec.cluster
    argv = [
        "srun",
        f"--nodes={c.nodes}",
        f"--ntasks={c.nodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    if c.cpus_per_task > 0:
        argv.append(f"--cpus-per-task={c.cpus_per_task}")
    return argv + container_args(c, cwd, run_dir)


def container_args(c: ClusterConfig, cwd: Path, run_dir: Path) -> List[str]:
    """srun options that run a step inside cluster.container (pyxis); none without one."""
    if not c.container:
        return []
    mounts = sorted({str(run_dir), str(cwd)})
    return [
        f"--container-image={c.container}",
        "--container-mounts=" + ",".join(f"{m}:{m}" for m in mounts),
        f"--container-workdir={cwd}",
    ]


def ranks_python(c: ClusterConfig) -> str:
    """The interpreter that runs the ranks: cluster.python, the container's `python`, or this one."""
    return c.python or ("python" if c.container else sys.executable)


def ranks_torch(c: ClusterConfig) -> TorchCapabilities:
    """What the ranks' torch has, asked here when their interpreter runs here (a shared file
    system: cluster.python or this venv); the floor's answer inside a container image."""
    return floor_capabilities() if c.container else ranks_capabilities(ranks_python(c))


def launch_argv(spec: JobConfig, plan: Plan, run_dir: Path, caps: Optional[TorchCapabilities] = None) -> List[str]:
    """The per-node torchrun command, from torchrun_argv.

    The rendezvous endpoint and id are known only inside the job (first node, job id), so
    the script exports them as PET_RDZV_ENDPOINT / PET_RDZV_ID, which torchrun reads.
    """
    return torchrun_argv(
        run_dir,
        nproc_per_node=plan.gpus_per_node,
        nnodes=plan.nodes,
        rdzv_from_env=True,
        python=ranks_python(spec.cluster),
        shutdown_timeout_s=shutdown_timeout_of(plan),
        capabilities=caps,
    )


def resilience_argv(spec: JobConfig, cwd: Path, run_dir: Path) -> List[str]:
    """The batch script's restart decision after a failed srun step (launcher/resilience/restarts.py):
    it appends `--restarts-done N --max-restarts M --exit-code C`. With a container the launcher's
    Python lives in the image, so the decision runs there too, as one task on one node."""
    c = spec.cluster
    python = ranks_python(c)
    prefix: List[str] = []
    if c.container:
        prefix = ["srun", "--nodes=1", "--ntasks=1", *container_args(c, cwd, run_dir)]
    return [*prefix, python, "-m", "launcher.resilience.restarts", "decide", "--run-dir", str(run_dir)]


def template_context(spec: JobConfig, plan: Plan, run_dir: Path, cwd: Optional[Path] = None) -> Dict[str, Any]:
    """Everything a template sees. Values are raw: the template quotes them with filters."""
    c = spec.cluster
    cwd = Path(cwd or os.getcwd()).resolve()
    paths = slurm_paths(c, run_dir)
    caps = ranks_torch(c)
    return {
        "spec": spec,
        "plan": plan,
        "cluster": c,
        "run_dir": str(paths.run_dir),
        "logs_dir": str(paths.logs_dir),
        "script_path": str(paths.script),
        "template_path": str(paths.template),
        "sbatch_options": sbatch_options(spec, paths, cwd),
        "sbatch_args": [str(a) for a in c.sbatch_args],
        "env": {str(k): str(v) for k, v in c.env.items()},
        "secret_env": [str(s) for s in c.secret_env],
        "setup": [str(s) for s in c.setup],
        "srun_argv": srun_argv(spec, cwd, paths.run_dir),
        "launch_argv": launch_argv(spec, plan, paths.run_dir, caps),
        "torchrun_env": torchrun_env(shutdown_timeout_of(plan), caps),
        "resilience_argv": resilience_argv(spec, cwd, paths.run_dir),
        "max_restarts": int(c.max_restarts),
        # trainer.on_spike=rewind restarts the step too, on a budget of its own (the loop's bound).
        "max_rewinds": int(spec.trainer.max_rewinds) if spec.trainer.on_spike == "rewind" else 0,
        "nodes": int(c.nodes),
        "spare_nodes": int(c.spare_nodes),
        "nproc_per_node": plan.gpus_per_node,
        "rdzv_port": int(c.rdzv_port),
        "max_requeues": int(c.max_requeues),
        "requeue_on_failure": bool(c.requeue_on_failure),
        "rdzv_host_from": str(c.rdzv_host_from),
        "eval_watch_argv": eval_watch_argv(spec, cwd, paths.run_dir),
    }


def eval_watch_argv(spec: JobConfig, cwd: Path, run_dir: Path) -> List[str]:
    """The batch script's submitter of per-checkpoint evaluation jobs (eval.job;
    launcher/launch/eval_submit.py), to which it appends `watch|scan RUN_DIR`; [] when off."""
    if not eval_jobs_on(spec):
        return []
    c = spec.cluster
    prefix: List[str] = []
    if c.container:  # the launcher's Python lives in the image: one task beside the ranks' step
        prefix = ["srun", "--nodes=1", "--ntasks=1", "--overlap", *container_args(c, cwd, run_dir)]
    return [*prefix, ranks_python(c), "-m", "launcher.launch.eval_submit"]


def _jinja_env(template_dir: Path) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch_q"] = sbatch_quote
    return env


def render_script(spec: JobConfig, plan: Plan, run_dir: Path, cwd: Optional[Path] = None) -> str:
    """The sbatch script text. Raises SlurmConfigError listing every bad cluster.* value."""
    cwd = Path(cwd or os.getcwd()).resolve()
    problems = slurm_key_problems(spec.cluster) + container_mount_problems(spec.cluster, Path(run_dir).resolve(), cwd)
    if problems:
        raise SlurmConfigError(problems)
    path = template_path(spec.cluster)
    template = _jinja_env(path.parent).get_template(path.name)
    return template.render(**template_context(spec, plan, run_dir, cwd))


def write_script(spec: JobConfig, plan: Plan, run_dir: Path, cwd: Optional[Path] = None) -> Path:
    """Render the script to <run_dir>/job.sbatch (and create <run_dir>/logs)."""
    paths = slurm_paths(spec.cluster, run_dir)
    text = render_script(spec, plan, run_dir, cwd)
    paths.logs_dir.mkdir(parents=True, exist_ok=True)
    (paths.run_dir / "control").mkdir(parents=True, exist_ok=True)
    return write_executable(paths.script, text)


def write_executable(path: Path, text: str) -> Path:
    """Write a job script atomically (aside, then renamed in), executable."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


# --- submission ---------------------------------------------------------------------------


def parse_job_id(sbatch_stdout: str) -> str:
    """The job id from `sbatch --parsable` output ("123" or "123;cluster")."""
    line = sbatch_stdout.strip().splitlines()[-1] if sbatch_stdout.strip() else ""
    job_id = line.split(";")[0].strip()
    if not job_id.isdigit():
        raise RuntimeError(f"could not read a job id from sbatch's output: {sbatch_stdout!r}")
    return job_id


_SBATCH_HINTS = (
    ("gres", "the cluster offers no GPUs of that kind; on a CPU cluster set trainer.device=cpu "
             "(gpus_per_node then means ranks per node, and no GPUs are requested)"),
    ("partition", "check cluster.partition against `sinfo -s`"),
    ("account", "check cluster.account / cluster.qos against `sacctmgr show assoc user=$USER`"),
    ("time limit", "lower cluster.time to the partition's limit (`sinfo -o '%P %l'`)"),
    ("node count", "lower cluster.nodes or choose a bigger partition (`sinfo -s`)"),
    ("dependency", "check the job ids in cluster.after with `squeue -j ID`"),
)


def _sbatch_hint(message: str) -> str:
    lower = message.lower()
    for needle, hint in _SBATCH_HINTS:
        if needle in lower:
            return hint
    return "compare the #SBATCH lines of the script with your cluster (`sinfo -s`); cluster.dry_run=true prints them"


def run_sbatch(script: Path, cwd: Path) -> str:
    """Submit `script`; returns the job id. Raises RuntimeError with sbatch's message."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise RuntimeError(
            "sbatch not found on PATH: run `train` on a SLURM login node, or start the development "
            "cluster with `slurm/dev-cluster.sh up`; cluster.dry_run=true renders without submitting"
        )
    proc = subprocess.run(
        [sbatch, "--parsable", str(script)],
        cwd=str(cwd),
        capture_output=True,
        text=True,
        timeout=SBATCH_TIMEOUT_S,
    )
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise RuntimeError(f"sbatch rejected {script} (exit {proc.returncode}): {msg}. Fix: {_sbatch_hint(msg)}")
    return parse_job_id(proc.stdout)


def sbatch_unless_dry_run(script: Path, cwd: Path, dry_run: bool, what: str) -> Tuple[int, Optional[str]]:
    """(exit code, job id) of submitting `script`: with cluster.dry_run it is printed instead
    (0, None); an sbatch failure is printed (1, None)."""
    if dry_run:
        print(f"dry run: {what} rendered to {script} (not submitted)")
        print(script.read_text(), end="")
        return 0, None
    try:
        return 0, run_sbatch(script, cwd)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1, None


def submit(spec: JobConfig, plan: Plan, run_dir: Path) -> int:
    """Render <run_dir>/job.sbatch and submit it (unless cluster.dry_run). Returns an exit code.

    0: submitted (or rendered, with dry_run); 1: sbatch failed; 2: invalid cluster.* values.
    """
    cwd = Path(os.getcwd()).resolve()
    try:
        script = write_script(spec, plan, run_dir, cwd)
    except SlurmConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    paths = slurm_paths(spec.cluster, run_dir)
    code, job_id = sbatch_unless_dry_run(script, cwd, spec.cluster.dry_run, "sbatch script")
    if job_id is None:
        return code
    logs = paths.log_paths(job_id)
    info = {
        "job_id": job_id,
        "script": str(script),
        "stdout": str(logs[0]),
        "stderr": str(logs[1]),
        "rank_logs": str(paths.logs_dir / "rank_*.log"),
    }
    (paths.run_dir / JOB_INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
    print(f"submitted SLURM job {job_id}")
    print(f"  script:    {script}")
    print(f"  log:       {logs[0]}")
    print(f"  errors:    {logs[1]}")
    print(f"  rank logs: {info['rank_logs']}")
    print(f"  follow:    squeue -j {job_id}; tail -f {shlex.quote(str(logs[0]))}")
    return 0
