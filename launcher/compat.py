"""Every torch capability newer than the torch floor, detected in one place.

pyproject.toml declares the torch range the launcher supports (`TORCH_FLOOR` below is its lower
end; tests/test_torch_compat.py holds the two equal). Anything the launcher uses that arrived
after the floor is a `Capability` here: how to detect it (a check of the API itself, never a
version comparison) and what the launcher does without it. Nothing else in the code asks which
torch it runs on.

Two ways to ask:
- the host (`train` on a login node) imports no torch, so `probe(python)` runs the checks in a
  subprocess of the interpreter that will run the ranks, and caches the answer per torch build
  (the interpreter and torch's installed files), so every later command pays nothing;
- the ranks have torch imported and call `has(name)`, which runs the same check in-process.

`python -m launcher.compat [--python PY]` prints what a torch has (the GPU acceptance script
records it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, FrozenSet, Optional, Tuple

log = logging.getLogger(__name__)

TORCH_FLOOR = "2.11"  # the oldest torch we support: pyproject's `torch>=` (2026 GPU images ship 2.11)
TORCH_NEWEST_TESTED = "2.14.1"  # the newest torch bench/torch_compat.sh ran on; pyproject's upper bound is below the next minor


@dataclass(frozen=True)
class Capability:
    """One torch feature newer than the floor."""

    name: str
    since: str  # the first torch release that has it (documentation only: detection checks the API)
    check: str  # a Python expression, evaluated with torch importable, that is True when present
    without: str  # what the launcher does when it is missing (said to the user once, in the log)


CAPABILITIES: Tuple[Capability, ...] = (
    Capability(
        name="torchrun_shutdown_timeout",
        since="2.12",
        check=("any('--shutdown-timeout' in a.option_strings for a in "
               "__import__('torch.distributed.run', fromlist=['get_args_parser']).get_args_parser()._actions)"),
        without=("torchrun gets no --shutdown-timeout (it kills the ranks 30 s after forwarding a signal): "
                 "`train` asks the ranks to stop through <run dir>/control/stop and waits the plan's predicted "
                 "stop time before it signals torchrun; a SLURM job script passes the value as PET_SHUTDOWN_TIMEOUT, "
                 "which a torchrun that has the option reads and an older one ignores"),
    ),
    Capability(
        name="pipeline_shape_vote",
        since="> 2.11 (seen in 2.13)",
        check="hasattr(__import__('torch.distributed.pipelining._utils', fromlist=['_']), 'InferenceMode')",
        without=("pipeline stages built with static shapes (launcher/parallel/pp.py stage_io_meta) skip torch's "
                 "shape inference by themselves, so the rehearsal has no shape vote to replace on a fake group"),
    ),
    Capability(
        name="pipeline_init_with_target",
        since="> 2.11 (seen in 2.13)",
        check=("'target' in __import__('inspect').signature(__import__('torch.distributed.pipelining.schedules', "
               "fromlist=['_']).PipelineScheduleSingle._initialize_stage).parameters"),
        without="the rehearsal sets up a pipeline schedule's stages without the loss target, as that torch does",
    ),
    Capability(
        name="dcp_reusable_stager",
        since="> 2.11 (seen in 2.13)",
        # Stage a tiny state dict twice with one stager: torch 2.11's DefaultStager closes itself
        # after each stage (clearing its copy table), so the second raises.
        check=("(lambda S: (lambda s: (s.stage({'a': {'b': 1}}), s.stage({'a': {'b': 1}}), True)[-1])("
               "S.DefaultStager(S.StagingOptions(False, False, False, False))))("
               "__import__('torch.distributed.checkpoint.staging', fromlist=['_']))"),
        without=("checkpoint.async=true makes a new DCP stager (and host buffers) for every save instead of "
                 "reusing the last one's: the same checkpoints, a slower staging"),
    ),
)
BY_NAME: Dict[str, Capability] = {c.name: c for c in CAPABILITIES}


@dataclass(frozen=True)
class TorchCapabilities:
    """What one torch build has: its version and the names of the capabilities present."""

    torch_version: str
    present: FrozenSet[str] = field(default_factory=frozenset)
    source: str = ""  # where the answer came from: an interpreter's path, "floor", "in-process"

    def has(self, name: str) -> bool:
        if name not in BY_NAME:
            raise KeyError(f"unknown torch capability {name!r}: add it to launcher.compat.CAPABILITIES")
        return name in self.present

    def missing(self) -> Tuple[Capability, ...]:
        return tuple(c for c in CAPABILITIES if c.name not in self.present)

    def to_json(self) -> dict:
        return {"torch": self.torch_version, "present": sorted(self.present), "source": self.source}


def floor_capabilities() -> TorchCapabilities:
    """The floor's answer (every capability off): for an interpreter that cannot be asked."""
    return TorchCapabilities(torch_version=f"{TORCH_FLOOR} (assumed)", present=frozenset(), source="floor")


# Run by `probe` in the ranks' interpreter: prints {"torch": version, "present": [names]}.
_PROBE = """
import json, sys
import torch
checks = json.loads(sys.argv[1])
present = []
for name, expression in checks.items():
    try:
        if eval(expression):
            present.append(name)
    except Exception:
        pass
print(json.dumps({"torch": torch.__version__, "present": present}))
"""

# Finds the torch package without importing it (fast): its __init__.py, or "" when not installed.
_FIND_TORCH = "import importlib.util as u; s = u.find_spec('torch'); print(s.origin if s and s.origin else '')"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "launcher" / "torch_capabilities"


def _torch_build_key(python: str, torch_init: str) -> str:
    """Changes when the interpreter, the torch installation or the capability checks change."""
    version_file = Path(torch_init).parent / "version.py"
    try:
        stamp = f"{version_file.stat().st_mtime_ns}:{version_file.stat().st_size}"
    except OSError:
        stamp = "?"
    checks = json.dumps({c.name: c.check for c in CAPABILITIES}, sort_keys=True)
    raw = "\n".join([os.path.realpath(python), torch_init, stamp, checks])
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _find_torch(python: str) -> Optional[str]:
    """torch's __init__.py as `python` would import it, or None (no such interpreter, no torch)."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        import importlib.util  # lazy: only for this interpreter (finds torch without importing it)

        spec = importlib.util.find_spec("torch")
        return spec.origin if spec and spec.origin else None
    try:
        out = subprocess.run([python, "-c", _FIND_TORCH], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def probe(python: str = "") -> Optional[TorchCapabilities]:
    """The capabilities of the torch that `python` (default: this interpreter) imports, asked in a
    subprocess once per torch build and cached; None when that interpreter or its torch cannot be
    run here (a path that exists only on compute nodes, a container image)."""
    python = python or sys.executable
    torch_init = _find_torch(python)
    if torch_init is None:
        return None
    cache = _cache_dir() / f"{_torch_build_key(python, torch_init)}.json"
    try:
        cached = json.loads(cache.read_text())
        return TorchCapabilities(cached["torch"], frozenset(cached["present"]), source=python)
    except (OSError, ValueError, KeyError):
        pass
    checks = json.dumps({c.name: c.check for c in CAPABILITIES})
    try:
        out = subprocess.run([python, "-c", _PROBE, checks], capture_output=True, text=True, timeout=300)
        answer = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    caps = TorchCapabilities(answer["torch"], frozenset(answer["present"]), source=python)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"torch": caps.torch_version, "present": sorted(caps.present)}))
        tmp.replace(cache)
    except OSError:  # a read-only home: probe again next time
        pass
    return caps


def ranks_capabilities(python: str = "") -> TorchCapabilities:
    """What the ranks' torch has, for building their command line: `probe`, or the floor's answer
    (every capability off, each with its fallback) when the interpreter cannot be asked here."""
    caps = probe(python)
    if caps is None:
        log.info("could not ask %s which torch it runs: building the ranks' command for the torch floor (%s)",
                 python or sys.executable, TORCH_FLOOR)
        return floor_capabilities()
    for missing in caps.missing():
        log.info("torch %s lacks %s (torch >= %s): %s", caps.torch_version, missing.name, missing.since, missing.without)
    return caps


@lru_cache(maxsize=None)
def has(name: str) -> bool:
    """In a process that imports torch (the ranks): whether this torch has capability `name`."""
    check = BY_NAME[name].check  # KeyError for an unknown name: a typo must not read as "absent"
    try:
        return bool(eval(check))  # the expressions are this module's own constants
    except Exception:  # the API is not there, or behaves as an older torch's does
        return False


def in_process() -> TorchCapabilities:
    """This process's torch, checked in-process (imports torch)."""
    import torch  # lazy: the host side of this module must not import torch

    return TorchCapabilities(torch.__version__, frozenset(c.name for c in CAPABILITIES if has(c.name)),
                             source="in-process")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.compat", description=__doc__.splitlines()[0])
    parser.add_argument("--python", default="", help="the interpreter to ask (default: this one, in-process)")
    args = parser.parse_args(argv)
    caps = probe(args.python) if args.python else in_process()
    if caps is None:
        print(f"could not run torch with {args.python}", file=sys.stderr)
        return 2
    print(json.dumps({**caps.to_json(), "floor": TORCH_FLOOR,
                      "missing": {c.name: f"torch >= {c.since}: {c.without}" for c in caps.missing()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
