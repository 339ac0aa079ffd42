"""Where a run's checkpoints live, and whether this command continues that run (host side, no torch).

`checkpoint.dir=''` (the default) is `outputs/runs/<run.name>/checkpoints`, a folder named after
the run rather than after the time of the command, so the same command run again (after a stop,
a crash, or with more `trainer.steps`) resumes there. `run.name` defaults to the recipe (else
model.name) plus a hash of what is trained (launcher/config/run_identity.py). Beside the
checkpoints, identity.json records that identity and the command; a command whose derived name is
new looks for the newest other run of the same recipe and names the keys that differ.

With `hydra.run.dir` (or a sweep's `hydra.sweep.dir`) given, '' keeps meaning
`<run dir>/checkpoints`, as before run names: that run dir is already a stable place. An explicit
`checkpoint.dir` is used as it is. In both, and with an explicit `run.name`, the rerun resumes
whatever its folder holds and only warns when what is trained differs.

The ranks read the folder from the run's config.yaml (`checkpoint.dir`, absolute), on every
executor: a SLURM requeue or in-job restart reads the same config.yaml and finds the same folder.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Tuple

from launcher.checkpoint.folder import MANIFEST, step_of
from launcher.config.run_identity import derive_run_name, identity_differences, identity_hash, identity_of
from launcher.config.schema import JobConfig

RUNS_ROOT = Path("outputs") / "runs"  # relative to the working directory, like Hydra's outputs/
IDENTITY_FILE = "identity.json"


@dataclass(frozen=True)
class RunChoice:
    """What `train` decided for a run: the spec to launch (run.name, absolute checkpoint.dir), the
    identity to record, and the one line that tells the user whether it resumes and why."""

    spec: JobConfig
    identity: Dict[str, Any]
    base: str
    message: str
    warn: bool  # the message reports a difference the user should look at


def newest_step(root: Path) -> Optional[int]:
    """The newest step_N folder under root that finished its save (has a manifest); None if none.

    A cheap look (the ranks verify sizes and checksums, and skip a damaged one)."""
    if not root.is_dir():
        return None
    steps = [step_of(p) for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / MANIFEST).is_file()]
    return max(steps) if steps else None


def read_identity(root: Path) -> Optional[Dict[str, Any]]:
    """The identity.json record in checkpoint folder `root`, or None (none yet, or unreadable)."""
    try:
        record = json.loads((root / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("identity"), dict) else None


def write_identity(root: Path, choice: RunChoice, command: str) -> None:
    """Record who trains into `root` (the last command's identity: the next rerun compares with it)."""
    root.mkdir(parents=True, exist_ok=True)
    record = {
        "run_name": choice.spec.run.name,
        "base": choice.base,
        "hash": identity_hash(choice.identity),
        "command": command,
        "written": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "identity": choice.identity,
    }
    tmp = root / (IDENTITY_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    tmp.replace(root / IDENTITY_FILE)


def previous_run(runs_root: Path, base: str, name: str) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The other run of the same recipe (or model) trained into last: (its checkpoint folder, identity.json)."""
    found = []
    for path in runs_root.glob(f"*/checkpoints/{IDENTITY_FILE}"):
        record = read_identity(path.parent)
        if record and record.get("base") == base and record.get("run_name") != name:
            found.append((path.stat().st_mtime, path.parent, record))
    if not found:
        return None
    _, root, record = max(found, key=lambda f: f[0])
    return root, record


def choose_run(spec: JobConfig, run_dir: Path, base: str, run_dir_given: bool,
               swept: Optional[Mapping[str, str]] = None, runs_root: Path = RUNS_ROOT) -> RunChoice:
    """Fill in run.name and the checkpoint folder (absolute) and say whether this run resumes.

    base: the recipe's name, else model.name. run_dir_given: the command set hydra.run.dir (or
    hydra.sweep.dir). swept: a sweep job's swept overrides ({key: value}).
    """
    identity = identity_of(spec, swept)
    derived = not spec.run.name
    name = derive_run_name(base, identity) if derived else spec.run.name
    if spec.checkpoint.dir:
        root = Path(spec.checkpoint.dir)
    elif run_dir_given:
        root = Path(run_dir) / "checkpoints"
    else:
        root = Path(runs_root) / name / "checkpoints"
    root = root.resolve()
    spec = replace(spec, run=replace(spec.run, name=name), checkpoint=spec.checkpoint.with_changes(dir=str(root)))
    step = newest_step(root)
    resume = spec.checkpoint.resume
    warn = False
    if resume == "none":
        message = f"run {name}: checkpoint.resume=none: starting at step 0 in {root}"
        if step is not None:
            message += " (its checkpoints move aside into abandoned_<time>/ at the first save)"
    elif resume != "auto":
        message = f"run {name}: resuming from checkpoint.resume={resume}; saving into {root}"
    elif step is not None:
        message = f"run {name}: resuming from its newest checkpoint, step {step}, in {root}"
        before = read_identity(root)
        changed = identity_differences(before["identity"], identity) if before else []
        if changed:  # only an explicit run.name / folder can hold another identity (a derived name is its hash)
            warn = True
            message += f", although what is trained differs from its last command ({'; '.join(changed)})"
        if step >= spec.trainer.steps:
            warn = True
            message += (f"; it already reached trainer.steps={spec.trainer.steps}: raise trainer.steps to train on, "
                        f"or checkpoint.resume=none to start over")
    else:
        message = f"run {name}: a new run, checkpoints in {root}"
        other = previous_run(Path(runs_root).resolve(), base, name) if derived and not run_dir_given else None
        if other is not None:
            other_root, record = other
            changed = identity_differences(record["identity"], identity)
            if changed:
                warn = True
                message += (f": what is trained differs from run {record.get('run_name')} ({other_root}): "
                            f"{'; '.join(changed)}. To continue that run instead, rerun its command "
                            f"({record.get('command', '?')}) or set run.name={record.get('run_name')}")
    return RunChoice(spec=spec, identity=identity, base=base, message=message, warn=warn)
