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
runs the protocol above (on a process group of its own, launcher/checkpoint/async_save.py).
One save is in flight at a time; `wait` blocks until it is published, `poll` checks without blocking.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from launcher.engines.base import Engine
from launcher.checkpoint.async_save import CheckpointGroup, storage_writer
from launcher.checkpoint.folder import (
    TRAINER_STATE, CheckpointDirInUse, FolderLock, _fsync_dir, checksum_files, list_files,
    lock_checkpoint_dir, publish, read_manifest, recover_replaced, set_aside_newer, share_of, step_dir_name,
    step_folders, verify_checkpoint, verify_files, write_manifest,
)
from launcher.parallel.phase import phase_all_gather, phase_barrier, phase_broadcast

log = logging.getLogger(__name__)


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
            self._async_group = CheckpointGroup(async_timeout_s)  # collective: every rank builds a manager
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finisher")

    def checkpoints(self) -> List[Path]:
        """Finished checkpoint folders, newest first (not yet verified)."""
        return step_folders(self.root)

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
