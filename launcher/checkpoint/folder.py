"""The checkpoint folder on disk, without torch: names, manifests, the folder lock, timelines.

Used by the host side (`train` checks that no other job holds the checkpoint folder before it
starts any rank, and must not import torch to do so) and by the ranks' CheckpointManager
(launcher/checkpoint/manager.py, which adds the engines' state, RNG and the save protocol's
collectives). docs/checkpoints.md describes the layout and the protocol for users.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Dict, List, Optional, Sequence, Tuple

from launcher.job_env import job_facts

log = logging.getLogger("launcher.checkpoint.manager")  # one logger name for the whole checkpoint story

STEP_DIR = re.compile(r"^step_(\d{8})$")
REPLACED_DIR = re.compile(r"^\.replaced_(step_\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
LOCK_FILE = ".lock"
ABANDONED_README = "ABANDONED.txt"

FileEntries = Dict[str, Dict[str, int]]


def step_of(folder: Path) -> Optional[int]:
    """The step of a step_NNNNNNNN folder, None for any other name."""
    match = STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def step_folders(root: Path) -> List[Path]:
    """The finished step_NNNNNNNN folders under `root`, newest first ([] when root is absent)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)),
                  key=lambda p: p.name, reverse=True)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def export_dir_of(checkpoint: Path) -> Path:
    """Where `action=export` writes the export of `checkpoint` (a step_NNNNNNNN folder): beside it,
    `<checkpoint>_export/`. No checkpoint rule touches that name: pruning (`checkpoint.keep`),
    setting newer steps aside and resume only ever take `step_NNNNNNNN` folders."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent / f"{checkpoint.name}_export"


def _crc32(path: Path, fsync: bool = False) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
        if fsync:
            os.fsync(f.fileno())
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def list_files(folder: Path) -> List[Tuple[str, int]]:
    """(path relative to folder, size) of every file but the manifest, sorted by path."""
    return [(str(p.relative_to(folder)), p.stat().st_size) for p in _files(folder)]


def share_of(files: Sequence[Tuple[str, int]], rank: int, world_size: int) -> List[str]:
    """This rank's share of `files` ((name, size) pairs), balanced by bytes.

    Largest file first to the least loaded rank (ties: lowest rank), so every rank computes the
    same split from the same list and reads about total/world_size bytes.
    """
    loads = [0] * world_size
    mine: List[str] = []
    for name, size in sorted(files, key=lambda f: (-f[1], f[0])):
        target = min(range(world_size), key=lambda r: (loads[r], r))
        loads[target] += size
        if target == rank:
            mine.append(name)
    return sorted(mine)


def checksum_files(
    folder: Path, rank: int, world_size: int, files: Optional[Sequence[Tuple[str, int]]] = None
) -> FileEntries:
    """Size and crc32 (after fsync) of this rank's share of the files.

    All ranks share the work so that a multi-TB checkpoint is not read by rank 0 alone while
    the others wait in a barrier. files: the listing rank 0 broadcast (listed here if None).
    """
    listing = list_files(folder) if files is None else files
    entries = {}
    for rel in share_of(listing, rank, world_size):
        path = folder / rel
        entries[rel] = {"size": path.stat().st_size, "crc32": _crc32(path, fsync=True)}
    return entries


def write_manifest(folder: Path, step: int, entries: Dict[str, Dict[str, int]]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / MANIFEST)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry_problem(rel: Any, meta: Any) -> Optional[str]:
    """What is wrong with one manifest entry: a relative path inside the folder -> size and crc32."""
    if not isinstance(rel, str) or not rel or PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
        return f"manifest.json names {rel!r}, not a path inside the checkpoint"
    if not isinstance(meta, dict) or not _is_count(meta.get("size")) or not _is_count(meta.get("crc32")):
        return f"manifest.json entry {rel} needs integer size and crc32, has {meta!r}"
    return None


def read_manifest(folder: Path) -> Tuple[Optional[FileEntries], Optional[str]]:
    """(files, None) for a manifest of the right shape, else (None, what is wrong with it).

    Right shape: {"files": {relative path: {"size": int, "crc32": int}, ...}} naming trainer.json.
    """
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None, "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (ValueError, OSError) as err:
        return None, f"unreadable manifest.json ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return None, f"manifest.json has no files table (found {type(files).__name__}, wanted an object)"
    for rel, meta in files.items():
        problem = _entry_problem(rel, meta)
        if problem:
            return None, problem
    if TRAINER_STATE not in files:
        return None, f"no {TRAINER_STATE}"
    return files, None


def verify_files(folder: Path, entries: FileEntries, checksums: bool) -> Optional[str]:
    """None if every file in `entries` exists with its size (and crc32), else the first problem."""
    for rel, meta in sorted(entries.items()):
        path = folder / rel
        if not path.is_file():
            return f"missing file {rel}"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{rel} has {size} bytes, manifest says {meta['size']}"
        if checksums and _crc32(path) != meta["crc32"]:
            return f"{rel} fails its crc32 check"
    return None


def verify_checkpoint(folder: Path, checksums: bool = True) -> Optional[str]:
    """None if the checkpoint is complete and intact, else what is wrong with it (one process)."""
    files, problem = read_manifest(folder)
    if files is None:
        return problem
    return verify_files(folder, files, checksums)


def _utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


# ---------------------------------------------------------------------------------------------
# The folder lock: one job per checkpoint folder.


class CheckpointDirInUse(ValueError):
    """Another live process holds the checkpoint folder's lock."""


@dataclass
class FolderLock:
    """An exclusive POSIX lock on <root>/.lock, held through the open descriptor `fd`.

    The kernel drops it when the process ends in any way (SIGKILL and preemption included), so
    it is never stale. POSIX locks belong to the process and are lost when it closes *any*
    descriptor of the lock file: nothing else in the holding process may open .lock.
    """

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1


def holder_record(run_dir: Path) -> Dict[str, Any]:
    """Who takes the lock: written into the lock file so that a refused job can name us."""
    facts = job_facts()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "executor": facts.executor,
        "job_id": facts.job_id,
        "run_dir": str(run_dir),
        "since": _utc_now().strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


_EXECUTOR_TITLES = {"slurm": "SLURM"}  # how a holder's executor is written in messages


def _holder_job(record: Dict[str, Any]) -> Tuple[Optional[str], Optional[str]]:
    """(executor, job id) of a lock record; records written before the executor seam said slurm_job_id."""
    if record.get("slurm_job_id"):
        return "slurm", str(record["slurm_job_id"])
    return record.get("executor"), record.get("job_id")


def _read_holder(fd: int) -> Dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (ValueError, OSError):
        record = {}
    return record if isinstance(record, dict) else {}


def describe_holder(record: Dict[str, Any]) -> str:
    """One line naming a lock holder: host, pid, scheduler job, run dir and since when."""
    if not record:
        return "a process that has not written its name yet"
    executor, job_id = _holder_job(record)
    job = f"{_EXECUTOR_TITLES.get(executor, executor)} job {job_id}" if job_id else "no scheduler job"
    return (
        f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, {job}, "
        f"run dir {record.get('run_dir', '?')}, since {record.get('since', '?')}"
    )


class LocksUnsupported(OSError):
    """The file system of the checkpoint folder does not support POSIX locks."""


def _try_lock(fd: int) -> bool:
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as err:
        if err.errno in (errno.EACCES, errno.EAGAIN):
            return False
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise LocksUnsupported(err.errno, err.strerror) from err
        raise


def _try_lock_or_warn(fd: int, root: Path) -> bool:
    """_try_lock, except that a file system without locks is reported and treated as locked by us."""
    try:
        return _try_lock(fd)
    except LocksUnsupported as err:
        # Training must not depend on the lock: without it only the guard is lost.
        log.warning(
            "cannot lock the checkpoint folder %s (%s): its file system does not support POSIX locks "
            "(on Lustre mount with -o flock), so a second job using it would not be detected",
            root, err.strerror,
        )
        return True


def _in_use_message(root: Path, holder: Dict[str, Any]) -> str:
    return (
        f"checkpoint.dir: the checkpoint folder {root} is in use by another job ({describe_holder(holder)}; "
        f"lock file {root / LOCK_FILE}). Two jobs saving into one folder would prune each other's "
        f"checkpoints. Fix: wait for that job to end or stop it, or give this run its own "
        f"run.name (or checkpoint.dir)."
    )


def lock_checkpoint_dir(root: Path, run_dir: Path, same_job_wait_s: float = 120.0) -> FolderLock:
    """Take the exclusive lock on checkpoint folder `root` (created if missing) for this process.

    Raises CheckpointDirInUse naming the holder when another live process has it. A holder with
    this job's scheduler job id is the previous incarnation of a requeued job still exiting: wait up
    to same_job_wait_s for the kernel to release its lock.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    me = holder_record(run_dir)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + same_job_wait_s
    while not _try_lock_or_warn(fd, root):
        holder = _read_holder(fd)
        same_job = me["job_id"] is not None and _holder_job(holder) == (me["executor"], me["job_id"])
        if not (same_job and time.monotonic() < deadline):
            os.close(fd)
            raise CheckpointDirInUse(_in_use_message(root, holder))
        time.sleep(1.0)
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    os.fsync(fd)
    return FolderLock(root / LOCK_FILE, fd)


def checkpoint_dir_holder(root: Path) -> Optional[str]:
    """The refusal a job would get for checkpoint folder `root` right now, or None if it is free.

    A look without taking the lock (the launcher asks before it starts any rank, so that a
    second job ends with one clear line instead of failing inside its ranks). Only the ranks'
    own lock_checkpoint_dir guards the folder: this answer can be stale a moment later.
    """
    try:
        fd = os.open(Path(root) / LOCK_FILE, os.O_RDWR)
    except OSError:  # no lock file (or unreadable): nobody has locked this folder
        return None
    try:
        if _try_lock(fd):
            return None  # closing fd below drops our momentary lock
        return _in_use_message(Path(root), _read_holder(fd))
    except LocksUnsupported:
        return None
    finally:
        os.close(fd)


def checkpoint_root(checkpoint_dir: str, run_dir: Path) -> Path:
    """The checkpoint folder of a run: checkpoint.dir, or <run dir>/checkpoints. `train` fills in
    checkpoint.dir for action=run (launcher/checkpoint/run_folder.py); '' remains for export."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


# ---------------------------------------------------------------------------------------------
# Timelines: checkpoints newer than a run's start are moved aside, never deleted.


def recover_replaced(root: Path) -> None:
    """Finish or undo re-saves of an existing step that were cut short (rank 0 only).

    A re-save renames step_N to .replaced_step_N, renames the new folder to step_N, then
    deletes .replaced_step_N. Killed in between, step_N is missing: the old one is put back.
    """
    if not root.is_dir():
        return
    for aside in sorted(root.iterdir()):
        match = REPLACED_DIR.match(aside.name)
        if not match or not aside.is_dir():
            continue
        final = root / match.group(1)
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)  # the new save finished
        else:
            os.replace(aside, final)
            _fsync_dir(root)
            log.warning("restored %s from %s: a re-save of that step was interrupted", final, aside.name)


def _abandoned_folder(root: Path) -> Path:
    stamp = _utc_now().strftime("%Y%m%dT%H%M%SZ")
    folder = root / f"abandoned_{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = root / f"abandoned_{stamp}_{n}"
    return folder


def set_aside_newer(root: Path, start_step: int) -> Optional[Path]:
    """Move every step_N with N > start_step into <root>/abandoned_<UTC time>/ (rank 0 only).

    They belong to a run this one replaced (it started over, or resumed from an older
    checkpoint): `resume=auto` must not jump back to them, and deleting them could lose work.
    Returns the folder they went to, or None when there were none.
    """
    if not root.is_dir():
        return None
    newer = [p for p in sorted(root.iterdir()) if p.is_dir() and (step_of(p) or 0) > start_step]
    if not newer:
        return None
    target = _abandoned_folder(root)
    target.mkdir()
    (target / ABANDONED_README).write_text(
        f"Checkpoints of an earlier run in {root}, newer than step {start_step}, where a later run started "
        f"(checkpoint.resume=none, an older checkpoint.resume=PATH, or their newer checkpoints were unusable).\n"
        f"Moved here on {_utc_now():%Y-%m-%d %H:%M:%S} UTC instead of being deleted. To continue that run, "
        f"resume with checkpoint.resume=<this folder>/step_NNNNNNNN; delete this folder when you do not need it.\n"
    )
    for path in newer:
        os.replace(path, target / path.name)
    _fsync_dir(root)
    log.warning(
        "moved %d checkpoint(s) newer than this run's start (step %d) aside to %s: %s. They are kept, "
        "not deleted; resume from one with checkpoint.resume=PATH or delete the folder.",
        len(newer), start_step, target, ", ".join(p.name for p in newer),
    )
    return target


def publish(tmp: Path, final: Path) -> None:
    """Rename the finished folder `tmp` to `final` (rank 0 only).

    An existing `final` (a re-save of a step) is renamed aside first and deleted only after the
    new folder is in place, so at every instant one complete checkpoint of the step exists.
    """
    aside = final.with_name(f".replaced_{final.name}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
