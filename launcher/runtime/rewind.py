"""trainer.on_spike=rewind, on the ranks: where a rewound run starts and how many batches it skips.

The chain: the spike's step raises LossSpike on every rank (launcher/runtime/numerics.py); the
restart decision writes a "failure" event with action "rewind" and the spike's steps
(launcher/resilience/restarts.py); the ranks of the next attempt call `rewind_start` here. A
rewind is pending while the newest checkpoint was written before it (its trainer.json
"rewinds_applied" is below the rewind's number): the ranks then resume from the newest checkpoint
older than the spike's onset (none: from scratch), rank 0 moves the newer ones aside at once
(abandoned_<time>/, as checkpoint.resume=<older step> does at its first save), and the data skips
`trainer.spike_skip_batches` global batches (default: those from that checkpoint through the
spike). The checkpoints written after it record "rewinds_applied" and "batches_skipped", so a
crash before the first of them rewinds again from the same place with the same skip, and one
after it resumes normally.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from launcher.checkpoint.folder import TRAINER_STATE, set_aside_newer, step_folders, step_of
from launcher.resilience.restarts import REWIND, append_event, read_events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rewind:
    """The run's latest rewind decision (from resilience.jsonl)."""

    number: int  # 1 for the run's first rewind
    spike_step: int
    onset_step: int  # the first step of the logging window that spiked
    skip_batches: Optional[int]  # trainer.spike_skip_batches (None: from the checkpoint through the spike)


@dataclass(frozen=True)
class RewindStart:
    """Where a pending rewind resumes: a checkpoint folder (None: from scratch) and the batches to skip."""

    rewind: Rewind
    path: Optional[str]
    step: int
    skip: int


def latest_rewind(run_dir: Path) -> Optional[Rewind]:
    """The run's newest rewind decision, or None when the run never rewound."""
    decisions = [e for e in read_events(run_dir) if e.get("event") == "failure" and e.get("action") == REWIND]
    if not decisions:
        return None
    info: Dict[str, Any] = decisions[-1].get("cause", {}).get("rewind") or {}
    spike = int(info.get("spike_step") or 0)
    return Rewind(number=len(decisions), spike_step=spike, onset_step=int(info.get("onset_step") or spike),
                  skip_batches=info.get("skip_batches"))


def _rewinds_applied(folder: Path) -> int:
    try:
        return int(json.loads((folder / TRAINER_STATE).read_text()).get("rewinds_applied", 0))
    except (OSError, ValueError, TypeError):
        return 0


def rewind_start(checkpoint_root: Path, rewind: Optional[Rewind]) -> Optional[RewindStart]:
    """Rank 0: the start of a pending rewind (None: none pending; resume as usual). Reads folder
    names and one trainer.json; moves nothing (see `apply_on_rank0`)."""
    if rewind is None:
        return None
    root = Path(checkpoint_root)
    folders = step_folders(root)
    if folders and _rewinds_applied(folders[0]) >= rewind.number:
        return None  # the newest checkpoint already continues the rewound timeline
    before = [p for p in folders if (step_of(p) or 0) < rewind.onset_step]
    start = before[0] if before else None
    step = step_of(start) if start is not None else 0
    skip = rewind.skip_batches if rewind.skip_batches is not None else max(0, rewind.spike_step - step)
    return RewindStart(rewind, str(start) if start is not None else None, step, int(skip))


def apply_on_rank0(run_dir: Path, checkpoint_root: Path, start: RewindStart) -> None:
    """Rank 0: move the checkpoints newer than the rewind's start aside now (a crash before the
    first save must not resume into the spike) and record the rewind in resilience.jsonl."""
    aside = set_aside_newer(Path(checkpoint_root), start.step)
    append_event(run_dir, {"event": "rewound", "rewind": start.rewind.number, "from_step": start.step,
                           "checkpoint": start.path, "spike_step": start.rewind.spike_step,
                           "onset_step": start.rewind.onset_step, "skipped_batches": start.skip,
                           "abandoned": str(aside) if aside is not None else None})
    log.warning("loss spike at step %d: rewind %d resumes from %s and skips %d global batch(es)%s",
                start.rewind.spike_step, start.rewind.number, start.path or "scratch (no earlier checkpoint)",
                start.skip, f"; newer checkpoints moved aside to {aside}" if aside is not None else "")
