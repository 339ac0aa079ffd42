"""`train action=prepare cluster=slurm`: submit the prepare as a one-node CPU job.

The run directory gets config.yaml (the composed job) and prepare.sbatch, rendered from
slurm/prepare.sh.j2 with the same Jinja2 environment, quoting filters and sbatch call as a
training job (launcher/launch/slurm.py). The job runs `python -m launcher.data.prepare RUN_DIR`
on one task with every CPU SLURM gives it; prepare.workers=0 then uses exactly those cores.
Secrets are forwarded by name (--export=ALL) and never written.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from launcher.config.slurm_keys import SlurmConfigError, sanitize_job_name, slurm_key_problems
from launcher.config.loader import save_spec
from launcher.config.schema import JobConfig
from launcher.launch.slurm import (_jinja_env, container_mount_problems, escape_sbatch_pattern, sbatch_unless_dry_run,
                                   write_executable)
from launcher.paths import slurm_dir

TEMPLATE = "prepare.sh.j2"
SCRIPT_NAME = "prepare.sbatch"


def prepare_sbatch_options(spec: JobConfig, run_dir: Path, cwd: Path) -> List[Dict[str, Optional[str]]]:
    """#SBATCH options of the prepare job: one node, one task, no GPUs."""
    c = spec.cluster
    logs = escape_sbatch_pattern(str(run_dir / "logs"))
    opts: List[tuple] = [
        ("job-name", sanitize_job_name(c.job_name or spec.run.name or "prepare", "prepare")),
        ("nodes", 1),
        ("ntasks", 1),
    ]
    cpus = c.cpus_per_task or spec.prepare.workers
    if cpus > 0:
        opts.append(("cpus-per-task", cpus))
    for key in ("partition", "account", "qos", "time", "constraint", "mem"):
        if getattr(c, key):
            opts.append((key, getattr(c, key)))
    if c.exclusive:
        opts.append(("exclusive", None))
    opts += [("chdir", str(cwd)), ("output", f"{logs}/prepare-%j.out"), ("error", f"{logs}/prepare-%j.err"),
             ("open-mode", "append"), ("export", "ALL")]
    if c.after:
        opts.append(("dependency", "afterany:" + ":".join(str(j).strip() for j in c.after)))
    return [{"name": k, "value": None if v is None else str(v)} for k, v in opts]


def render_prepare_script(spec: JobConfig, run_dir: Path, cwd: Path) -> str:
    """The prepare job's script. Raises SlurmConfigError listing every bad cluster.* value."""
    c = spec.cluster
    problems = slurm_key_problems(c) + container_mount_problems(c, run_dir, cwd)
    if problems:
        raise SlurmConfigError(problems)
    srun = ["srun", "--nodes=1", "--ntasks=1"]
    if c.container:
        mounts = sorted({str(run_dir), str(cwd)})
        srun += [f"--container-image={c.container}", "--container-mounts=" + ",".join(f"{m}:{m}" for m in mounts),
                 f"--container-workdir={cwd}"]
    python = c.python or ("python" if c.container else sys.executable)
    context: Dict[str, Any] = {
        "template_path": str(slurm_dir() / TEMPLATE),
        "script_path": str(run_dir / SCRIPT_NAME),
        "sbatch_options": prepare_sbatch_options(spec, run_dir, cwd),
        "sbatch_args": [str(a) for a in c.sbatch_args],
        "env": {str(k): str(v) for k, v in c.env.items()},
        "secret_env": [str(s) for s in c.secret_env],
        "setup": [str(s) for s in c.setup],
        "srun_argv": srun,
        "prepare_argv": [python, "-m", "launcher.data.prepare", str(run_dir)],
    }
    return _jinja_env(slurm_dir()).get_template(TEMPLATE).render(**context)


def submit_prepare(spec: JobConfig, run_dir: Path) -> int:
    """Write config.yaml and prepare.sbatch into run_dir and submit (or print, with cluster.dry_run).

    0: submitted or rendered; 1: sbatch failed; 2: invalid cluster.* values."""
    run_dir = Path(run_dir).resolve()
    cwd = Path(os.getcwd()).resolve()
    try:
        text = render_prepare_script(spec, run_dir, cwd)
    except SlurmConfigError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    save_spec(spec, run_dir)
    script = write_executable(run_dir / SCRIPT_NAME, text)
    code, job_id = sbatch_unless_dry_run(script, cwd, spec.cluster.dry_run, "prepare script")
    if job_id is None:
        return code
    log = run_dir / "logs" / f"prepare-{job_id}.out"
    print(f"submitted SLURM prepare job {job_id}")
    print(f"  script: {script}")
    print(f"  log:    {log}")
    print(f"  follow: squeue -j {job_id}; tail -f {shlex.quote(str(log))}")
    return 0
