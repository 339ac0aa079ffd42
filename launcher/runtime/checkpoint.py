"""Atomic checkpoints: a crash at any moment leaves the last good checkpoint intact.

Layout of one checkpoint, <root>/step_00000100/:
    engine/           model + optimizer + LR schedule, written by the Engine (DCP or DeepSpeed)
    rng/rank_00000.pt RNG states of each rank
    trainer.json      step, samples consumed (the data position), tokens seen, layout
    manifest.json     every file with its size and crc32, written last

Protocol: every rank writes into <root>/.incomplete_step_00000100/; the ranks checksum the
files between them; rank 0 writes manifest.json (everything fsynced) and renames the folder to
step_00000100 in one atomic rename. A folder without a manifest, or whose files disagree with it, is skipped on
resume with a warning, and the previous checkpoint is used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from launcher.runtime.engine import Engine

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.json"


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _debug_slow_save() -> None:
    """Test aid: LAUNCHER_DEBUG_SLOW_SAVE_S=N makes every save N seconds longer (a stop must not be cut short)."""
    seconds = float(os.environ.get("LAUNCHER_DEBUG_SLOW_SAVE_S") or 0)
    if seconds > 0:
        log.warning("LAUNCHER_DEBUG_SLOW_SAVE_S=%g: this save takes %g s longer", seconds, seconds)
        time.sleep(seconds)


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


def checksum_files(folder: Path, rank: int, world_size: int) -> Dict[str, Dict[str, int]]:
    """Size and crc32 (after fsync) of this rank's share of the files: every world_size-th one.

    All ranks share the work so that a multi-TB checkpoint is not read by rank 0 alone while
    the others wait in a barrier.
    """
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "crc32": _crc32(p, fsync=True)}
        for p in _files(folder)[rank::world_size]
    }


def write_manifest(folder: Path, step: int, entries: Dict[str, Dict[str, int]]) -> None:
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(folder / MANIFEST)


def verify_checkpoint(folder: Path, checksums: bool = True) -> Optional[str]:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files: Dict[str, Dict[str, int]] = manifest["files"]
    except (ValueError, KeyError) as err:
        return f"unreadable manifest.json ({err})"
    for rel, meta in files.items():
        path = folder / rel
        if not path.is_file():
            return f"missing file {rel}"
        size = path.stat().st_size
        if size != meta["size"]:
            return f"{rel} has {size} bytes, manifest says {meta['size']}"
        if checksums and _crc32(path) != meta["crc32"]:
            return f"{rel} fails its crc32 check"
    if TRAINER_STATE not in files:
        return f"no {TRAINER_STATE}"
    return None


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


class CheckpointManager:
    """Saves, prunes, finds and loads checkpoints under one root folder."""

    def __init__(self, root: Path, *, keep: int, verify_checksums: bool, rank: int, world_size: int):
        self.root = Path(root)
        self.keep = keep
        self.verify_checksums = verify_checksums
        self.rank = rank
        self.world_size = world_size

    def checkpoints(self) -> List[Path]:
        """Finished checkpoint folders, newest first (not yet verified)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def latest_valid(self) -> Optional[Path]:
        """Newest checkpoint that passes verification; broken ones are reported and skipped."""
        for path in self.checkpoints():
            problem = verify_checkpoint(path, self.verify_checksums)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s; trying the previous one", path, problem)
        return None

    def select_resume(self, resume: str) -> Optional[Path]:
        """The checkpoint to resume from (collective): rank 0 verifies, every rank gets its answer.

        resume: "auto" (newest valid under the root, None if there is none) or a checkpoint path.
        """
        choice: List[Optional[str]] = [None]
        if self.rank == 0:
            if resume == "auto":
                found = self.latest_valid()
                choice[0] = str(found) if found is not None else None
            else:
                path = Path(resume)
                problem = "not a folder" if not path.is_dir() else verify_checkpoint(path, self.verify_checksums)
                choice[0] = f"!{path}: {problem}" if problem else str(path)
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is not None and choice[0].startswith("!"):
            raise ValueError(
                f"checkpoint.resume={choice[0][1:]}. Fix: give a checkpoint folder such as "
                f"{self.root / step_dir_name(100)}, or checkpoint.resume=auto."
            )
        return Path(choice[0]) if choice[0] is not None else None

    def save(self, step: int, engine: Engine, trainer_state: Dict[str, Any]) -> Path:
        """Write a checkpoint for `step` atomically (collective over all ranks)."""
        final = self.root / step_dir_name(step)
        tmp = self.root / f".incomplete_{step_dir_name(step)}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / "rng").mkdir(parents=True)
        _barrier()
        engine.save(tmp / "engine")
        _debug_slow_save()
        torch.save(rng_state(), tmp / "rng" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            (tmp / TRAINER_STATE).write_text(json.dumps(dict(trainer_state, step=step), indent=1))
        _barrier()
        entries = checksum_files(tmp, self.rank, self.world_size)
        if dist.is_initialized():
            gathered: List[Optional[Dict]] = [None] * self.world_size
            dist.all_gather_object(gathered, entries)
            entries = {k: v for part in gathered for k, v in (part or {}).items()}
        if self.rank == 0:
            write_manifest(tmp, step, entries)
            for sub in [tmp, *[d for d in tmp.rglob("*") if d.is_dir()]]:
                _fsync_dir(sub)
            if final.exists():  # a leftover of an earlier attempt at this step (valid or not)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune(final, step)
            log.info("saved checkpoint %s", final)
        _barrier()
        return final

    def _prune(self, newest: Path, step: int) -> None:
        """Keep `newest` and the keep-1 newest valid checkpoints before it; never delete `newest`.

        Folders of later steps belong to an abandoned timeline (this run resumed from an older
        checkpoint): left in place, `resume=auto` would later jump back to them.
        """
        older_valid = []
        for path in self.checkpoints():
            if path == newest:
                continue
            if int(STEP_DIR.match(path.name).group(1)) > step:
                log.warning("removing %s: it is later than step %d, from a run this one replaced", path, step)
                shutil.rmtree(path, ignore_errors=True)
            elif verify_checkpoint(path, checksums=False) is None:
                older_valid.append(path)
            else:
                log.warning("removing unusable checkpoint %s", path)
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
