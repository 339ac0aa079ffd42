"""Atomic checkpoints: a crash at any moment leaves the last good checkpoint intact.

Layout of one checkpoint, <root>/step_00000100/:
    engine/           model + optimizer + LR schedule, written by the Engine (DCP or DeepSpeed)
    rng/rank_00000.pt RNG states of each rank
    trainer.json      step, samples consumed (the data position), tokens seen, layout
    manifest.json     every file with its size and crc32, written last

Protocol: every rank writes into <root>/.incomplete_step_00000100/; rank 0 lists the files once
and broadcasts the list; the ranks checksum shares of it; rank 0 writes manifest.json
(everything fsynced) and renames the folder to step_00000100 in one atomic rename (an existing
step_00000100 is first renamed aside to .replaced_step_00000100 and removed only after). A folder
without a manifest, with a manifest of the wrong shape, or whose files disagree with it, is
skipped on resume with a warning, and the previous checkpoint is used; on resume the ranks
verify shares of the files, as on save.

Checkpoints newer than the step a run started from belong to a timeline that run replaced: at
its first save they are moved, never deleted, to <root>/abandoned_<UTC time>/. Rank 0 holds an
exclusive kernel lock on <root>/.lock for the whole run, so a second job refuses to use the
folder. docs/checkpoints.md describes all of this for users.

checkpoint.async=true (CheckpointManager(async_save=True)): `save` returns once the engine has
staged its state in host memory; DCP writes it from a background thread and a finisher thread
runs the protocol above (on a process group of its own, launcher/runtime/async_checkpoint.py).
One save is in flight at a time; `wait` blocks until it is published, `poll` checks without blocking.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import random
import re
import shutil
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from launcher.engines.base import Engine
from launcher.parallel.phase import phase_all_gather, phase_barrier, phase_broadcast

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
REPLACED_DIR = re.compile(r"^\.replaced_(step_\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"
LOCK_FILE = ".lock"
ABANDONED_README = "ABANDONED.txt"

FileEntries = Dict[str, Dict[str, int]]


# Checkpoint collectives wait for single-rank work (rank 0 lists, publishes, prunes, takes the
# folder lock): they use the phase group, so a long save never trips cluster.collective_timeout_s.
def _barrier() -> None:
    phase_barrier()


def _debug_slow_save() -> None:
    """Test aid: LAUNCHER_DEBUG_SLOW_SAVE_S=N makes every save N seconds longer (a stop must not be cut short)."""
    seconds = float(os.environ.get("LAUNCHER_DEBUG_SLOW_SAVE_S") or 0)
    if seconds > 0:
        log.warning("LAUNCHER_DEBUG_SLOW_SAVE_S=%g: this save takes %g s longer", seconds, seconds)
        time.sleep(seconds)


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank (the value itself without a process group)."""
    return phase_broadcast(value)


def _all_gather(value: Any) -> List[Any]:
    """Every rank's `value`, in rank order."""
    return phase_all_gather(value)


class Collectives(NamedTuple):
    """The three collectives of the save protocol, on one process group."""

    barrier: Callable[[], None]
    broadcast: Callable[[Any], Any]
    all_gather: Callable[[Any], List[Any]]


# Synchronous saves run the protocol on the main thread, through the phase group.
PHASE_COLLECTIVES = Collectives(_barrier, _broadcast, _all_gather)


def step_of(folder: Path) -> Optional[int]:
    """The step of a step_NNNNNNNN folder, None for any other name."""
    match = STEP_DIR.match(folder.name)
    return int(match.group(1)) if match else None


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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


def rng_state() -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
        "run_dir": str(run_dir),
        "since": _utc_now().strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def _read_holder(fd: int) -> Dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
    except (ValueError, OSError):
        record = {}
    return record if isinstance(record, dict) else {}


def describe_holder(record: Dict[str, Any]) -> str:
    """One line naming a lock holder: host, pid, SLURM job, run dir and since when."""
    if not record:
        return "a process that has not written its name yet"
    slurm = f"SLURM job {record['slurm_job_id']}" if record.get("slurm_job_id") else "no SLURM job"
    return (
        f"host {record.get('host', '?')}, pid {record.get('pid', '?')}, {slurm}, "
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
        f"checkpoint.dir (or run directory)."
    )


def lock_checkpoint_dir(root: Path, run_dir: Path, same_job_wait_s: float = 120.0) -> FolderLock:
    """Take the exclusive lock on checkpoint folder `root` (created if missing) for this process.

    Raises CheckpointDirInUse naming the holder when another live process has it. A holder with
    this job's SLURM job id is the previous incarnation of a requeued job still exiting: wait up
    to same_job_wait_s for the kernel to release its lock.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    me = holder_record(run_dir)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + same_job_wait_s
    while not _try_lock_or_warn(fd, root):
        holder = _read_holder(fd)
        same_job = me["slurm_job_id"] is not None and holder.get("slurm_job_id") == me["slurm_job_id"]
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
    """The checkpoint folder of a run: checkpoint.dir, or <run dir>/checkpoints."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


def lock_for_run(root: Path, run_dir: Path, rank: int) -> Optional[FolderLock]:
    """Collective: rank 0 takes the folder lock; if it cannot, every rank raises the same error.

    Returns the lock on rank 0 (hold it for the whole run) and None on the other ranks.
    """
    lock: Optional[FolderLock] = None
    problem: Optional[str] = None
    if rank == 0:
        try:
            lock = lock_checkpoint_dir(root, run_dir)
        except CheckpointDirInUse as err:
            problem = str(err)
    problem = _broadcast(problem)
    if problem:
        raise CheckpointDirInUse(problem)
    return lock


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


class CheckpointManager:
    """Saves, prunes, finds and loads checkpoints under one root folder."""

    def __init__(self, root: Path, *, keep: int, verify_checksums: bool, rank: int, world_size: int,
                 async_save: bool = False, async_timeout_s: int = 1800):
        self.root = Path(root)
        self.keep = keep
        self.verify_checksums = verify_checksums
        self.rank = rank
        self.world_size = world_size
        # The step this run continues from (set by `load`; 0 for a fresh start). Checkpoints
        # newer than it are another timeline, moved aside at this run's first save.
        self.start_step = 0
        self._timeline_settled = False
        # checkpoint.async: saves finish in the background (save_async); `published` is the
        # newest checkpoint known complete on this rank, as (step, path).
        self.async_save = async_save
        self.published: Optional[Tuple[int, Path]] = None
        self._async_group = None
        self._finisher = None
        self._pending = None  # (step, Future) of the save in flight
        if async_save:
            from concurrent.futures import ThreadPoolExecutor

            from launcher.runtime.async_checkpoint import CheckpointGroup

            self._async_group = CheckpointGroup(async_timeout_s)  # collective: every rank builds a manager
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finisher")

    def checkpoints(self) -> List[Path]:
        """Finished checkpoint folders, newest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def _candidates(self, resume: str) -> Tuple[List[str], Optional[str]]:
        """Rank 0: folders to try in order, or a problem with checkpoint.resume=PATH."""
        if resume == "auto":
            recover_replaced(self.root)
            return [str(p) for p in self.checkpoints()], None
        path = Path(resume)
        if not path.is_dir():
            return [], f"{path}: not a folder"
        return [str(path)], None

    def verify_shared(self, path: Path) -> Optional[str]:
        """Collective: None if checkpoint `path` is intact, else the first problem (same on all ranks).

        Rank 0 reads the manifest once and broadcasts it; every rank checks the sizes (and crc32s
        when verify_checksums) of its share of the files, balanced by bytes.
        """
        files, problem = read_manifest(path) if self.rank == 0 else (None, None)
        files, problem = _broadcast((files, problem))
        if files is None:
            return problem
        mine = share_of([(rel, meta["size"]) for rel, meta in files.items()], self.rank, self.world_size)
        local = verify_files(path, {rel: files[rel] for rel in mine}, self.verify_checksums)
        log.info(
            "rank %d verified %d of %d files (%d bytes, checksums %s) of %s",
            self.rank, len(mine), len(files), sum(files[rel]["size"] for rel in mine),
            "on" if self.verify_checksums else "off", path,
        )
        return next((p for p in _all_gather(local) if p is not None), None)

    def select_resume(self, resume: str) -> Optional[Path]:
        """The checkpoint to resume from (collective): the ranks verify it together.

        resume: "auto" (newest valid under the root, None if there is none) or a checkpoint path.
        """
        candidates, problem = self._candidates(resume) if self.rank == 0 else ([], None)
        candidates, problem = _broadcast((candidates, problem))
        for name in candidates:
            problem = self.verify_shared(Path(name))
            if problem is None:
                return Path(name)
            if resume == "auto":
                if self.rank == 0:
                    log.warning("skipping checkpoint %s: %s; trying the previous one", name, problem)
            else:
                problem = f"{name}: {problem}"
        if problem is not None and resume != "auto":
            raise ValueError(
                f"checkpoint.resume={problem}. Fix: give a checkpoint folder such as "
                f"{self.root / step_dir_name(100)}, or checkpoint.resume=auto."
            )
        return None

    def _settle_timeline(self) -> None:
        """Rank 0, first save of this run: finish interrupted re-saves, move newer checkpoints aside."""
        if self._timeline_settled:
            return
        recover_replaced(self.root)
        set_aside_newer(self.root, self.start_step)
        self._timeline_settled = True

    def save(self, step: int, engine: Engine, trainer_state: Dict[str, Any]) -> Path:
        """Write a checkpoint for `step` atomically (collective over all ranks).

        With async_save, returns once the state is staged in host memory: the folder appears at
        the returned path when the background write and the protocol below complete (`poll`,
        `wait`); the previous asynchronous save is waited for first.
        """
        if self.async_save:
            return self._save_async(step, engine, trainer_state)
        final, tmp = self._begin(step)
        engine.save(tmp / "engine")
        _debug_slow_save()
        self._write_small_files(tmp, step, trainer_state, rng_state())
        self._finish(tmp, final, step, PHASE_COLLECTIVES)
        self.published = (step, final)
        return final

    def _begin(self, step: int) -> Tuple[Path, Path]:
        """(final folder, temporary folder) of a save of `step`; rank 0 prepares the temporary one."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".incomplete_{step_dir_name(step)}"
        if self.rank == 0:
            self._settle_timeline()
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        return final, tmp

    def _write_small_files(self, tmp: Path, step: int, trainer_state: Dict[str, Any], rng: Dict[str, Any]) -> None:
        torch.save(rng, tmp / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(dict(trainer_state, step=step), indent=1))

    def _finish(self, tmp: Path, final: Path, step: int, comm: "Collectives") -> None:
        """Every rank wrote its files into `tmp`: checksum, manifest, publish as `final`, prune."""
        comm.barrier()
        # One listing (rank 0's) for everyone: each rank listing a shared file system would cost
        # a metadata storm and could see different files.
        listing = comm.broadcast(list_files(tmp) if self.rank == 0 else None)
        entries = checksum_files(tmp, self.rank, self.world_size, listing)
        entries = {k: v for part in comm.all_gather(entries) for k, v in (part or {}).items()}
        if self.rank == 0:
            write_manifest(tmp, step, entries)
            for sub in [tmp, *[d for d in tmp.rglob("*") if d.is_dir()]]:
                _fsync_dir(sub)
            publish(tmp, final)
            self._prune(final, step)
            log.info("saved checkpoint %s", final)
        comm.barrier()

    # ------------------------------------------------------------------ checkpoint.async=true
    def _save_async(self, step: int, engine: Engine, trainer_state: Dict[str, Any]) -> Path:
        save_async = getattr(engine, "save_async", None)
        if save_async is None:
            raise ValueError(
                f"checkpoint.async=true: the {type(engine).__name__} cannot save asynchronously. "
                f"Fix: checkpoint.async=false."
            )
        from launcher.runtime.async_checkpoint import storage_writer

        self.wait()  # one save in flight at a time: the host buffers and the folder protocol are shared
        final, tmp = self._begin(step)
        group = self._async_group
        upload = save_async(tmp / "engine", group.group, storage_writer(str(tmp / "engine"), step))
        # The RNG state is this step's; trainer.json is tiny: both written now, before training moves on.
        self._write_small_files(tmp, step, trainer_state, rng_state())
        comm = Collectives(group.barrier, group.broadcast, group.all_gather)
        done = self._finisher.submit(self._finish_async, upload, tmp, final, step, comm)
        self._pending = (step, done)
        log.info("checkpoint of step %d staged; writing %s in the background", step, tmp)
        return final

    def _finish_async(self, upload: Any, tmp: Path, final: Path, step: int, comm: "Collectives") -> Path:
        """Finisher thread: wait for this rank's DCP write, then the protocol on the checkpoint group."""
        upload.result()
        _debug_slow_save()
        self._finish(tmp, final, step, comm)  # renamed into place only once every rank's write is done
        return final

    def _harvest(self, block: bool) -> Optional[Tuple[int, Path]]:
        if self._pending is None:
            return None
        step, done = self._pending
        if not block and not done.done():
            return None
        self._pending = None
        final = done.result()  # re-raises a failed background save on the main thread
        self.published = (step, final)
        return self.published

    def poll(self) -> Optional[Tuple[int, Path]]:
        """(step, path) of an asynchronous save that has completed since the last poll/wait, else
        None; never blocks (local: no collective). Raises the error of a failed background save."""
        return self._harvest(block=False)

    def wait(self) -> Optional[Tuple[int, Path]]:
        """Block until the asynchronous save in flight (if any) is published; (step, path) or None.

        Called before the next save, at a stop request and at the end of the run: the rank does
        not go on (or exit) while its checkpoint is half-written.
        """
        if self._pending is not None and not self._pending[1].done():
            log.info("waiting for the background save of step %d", self._pending[0])
        return self._harvest(block=True)

    def _prune(self, newest: Path, step: int) -> None:
        """Keep `newest` and the keep-1 newest valid checkpoints before it; never delete `newest`.

        Folders of later steps belong to an abandoned timeline: they are moved aside, never
        deleted (left in place, `resume=auto` would later jump back to them).
        """
        set_aside_newer(self.root, step)
        older_valid = []
        for path in self.checkpoints():
            if path == newest:
                continue
            problem = verify_checkpoint(path, checksums=False)
            if problem is None:
                older_valid.append(path)
            else:
                log.warning("removing unusable checkpoint %s: %s", path, problem)
                shutil.rmtree(path, ignore_errors=True)
        for old in older_valid[max(0, self.keep - 1) :]:
            shutil.rmtree(old, ignore_errors=True)
            log.info("removed old checkpoint %s (checkpoint.keep=%d)", old, self.keep)
        for leftover in self.root.glob(".incomplete_step_*"):
            if leftover.name != f".incomplete_{newest.name}":
                shutil.rmtree(leftover, ignore_errors=True)

    def load(self, path: Path, engine: Engine, seed: int) -> Dict[str, Any]:
        """Restore engine state and this rank's RNG from a checkpoint chosen by `select_resume`
        (collective); returns its trainer.json."""
        state = json.loads((path / TRAINER_STATE).read_text())
        self.start_step = int(state["step"])
        engine.load(path / "engine")
        rng_file = path / "rng" / f"rank_{self.rank:05d}.pt"
        if state.get("world_size") == self.world_size and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            # Different layout: per-rank RNG streams do not map; reseed deterministically instead.
            torch.manual_seed(seed + state["step"] * 1000 + self.rank)
            if self.rank == 0:
                log.warning(
                    "resuming with world size %d from a checkpoint written with %s: RNG streams reseeded",
                    self.world_size, state.get("world_size"),
                )
        return state
