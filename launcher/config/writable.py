"""Can a folder the ranks will write into be created and written? Asked before launch or submission.

A folder that cannot be written (`checkpoint.dir=/proc/nope`, a read-only mount, a path under a
file) otherwise fails inside every rank, with one traceback each, after the job waited in the
queue. The answer comes from trying, not from permission bits: root passes every `os.access`
check, yet cannot create a folder in /proc or on a read-only file system. The probe is a hidden
temporary folder, removed at once, so a check that passes leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

_PROBE_PREFIX = ".launcher-write-probe-"


def _nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (what a `mkdir -p` would start from)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def unwritable_reason(folder: str) -> Optional[str]:
    """Why `folder` cannot be created (with its parents) and written, or None when it can.

    Writes nothing that stays: the probe folder is made inside the folder (or inside its nearest
    existing ancestor, where the folder itself would be created) and removed.
    """
    path = Path(folder).expanduser().absolute()
    existing = _nearest_existing(path)
    if not existing.is_dir():
        return f"{existing} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=_PROBE_PREFIX, dir=existing)
    except OSError as err:
        where = "" if existing == path else f" (its nearest existing folder {existing} is not writable)"
        return f"{err.strerror or type(err).__name__}{where}"
    try:
        # A file too: some file systems let a folder be made but refuse files in it (quotas at 0).
        with open(os.path.join(probe, "probe"), "wb") as handle:
            handle.write(b"ok")
    except OSError as err:
        return f"a file cannot be written in {existing}: {err.strerror or type(err).__name__}"
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    return None


def folder_problem(key: str, value: str, fix: str) -> Optional[str]:
    """One problem line for config key `key` holding a folder that cannot be created or written."""
    if not value:
        return None
    reason = unwritable_reason(value)
    if reason is None:
        return None
    return f"{key}={value} cannot be created or written: {reason}. Fix: {fix}"
