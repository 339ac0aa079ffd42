"""`train action=export checkpoint.resume=PATH checkpoint.export=hf`: a saved checkpoint -> an export.

Runs on the ranks the command line gives (the plan's world size): the engine is built as for
training, the checkpoint is loaded (torch.distributed.checkpoint reshards it to this layout)
and written with the engine's export, as at the end of a run. No data is read, nothing trains.
The export goes beside the checkpoint (`export_dir_of`: `<checkpoint>_export/`), not into the
command's own run dir, which keeps only its config, plan and logs.
"""

from __future__ import annotations

import logging
from pathlib import Path

from launcher.config.schema import JobConfig
from launcher.engines.base import Engine
from launcher.checkpoint.folder import export_dir_of
from launcher.checkpoint.manager import CheckpointManager

log = logging.getLogger("launcher")


def export_checkpoint(spec: JobConfig, engine: Engine, rank: int, world_size: int) -> Path:
    """Load checkpoint.resume into `engine` and write its export beside it, `<checkpoint>_export/`
    (collective). Returns the folder written."""
    resume = Path(spec.checkpoint.resume)
    checkpoints = CheckpointManager(resume.parent, keep=spec.checkpoint.keep,
                                    verify_checksums=spec.checkpoint.verify_checksums,
                                    rank=rank, world_size=world_size)
    path = checkpoints.select_resume(str(resume))
    if path is None:
        raise FileNotFoundError(f"checkpoint.resume={resume} is not a complete checkpoint. "
                                f"Fix: give a step_* folder written by a finished save.")
    state = checkpoints.load(path, engine, spec.trainer.seed)
    out = export_dir_of(path)
    engine.export(out, spec.checkpoint.export)
    log.info("exported the checkpoint of step %s (%s) to %s (%s)", state.get("step"), path, out,
             spec.checkpoint.export)
    return out
