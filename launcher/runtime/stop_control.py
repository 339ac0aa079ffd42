"""The torch-free half of graceful stops: the control files and the signal handler base.

`train` on the host (launcher/launch/local.py) forwards stop signals to the ranks and reads
their record of a stop; the ranks (launcher/runtime/signals.py StopWatcher) watch for the
stop file and write that record. Both use these names, and the host must not import torch.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path
from typing import Dict, Optional, Tuple

log = logging.getLogger("launcher.runtime.signals")

STOP_FILE = "stop"
STOPPED_FILE = "stopped"


def control_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "control"


class StopSignals:
    """Handlers for `signals` (installed until uninstall) that turn the first into a stop request.

    A repeat, of the same signal or another, is the same request: logged, never an abort.
    Subclasses say what a request does in `on_stop_signal`.
    """

    def __init__(self, signals: Tuple[signal.Signals, ...]):
        self.signals = signals
        self.first_signal: Optional[str] = None
        self._previous: Dict[signal.Signals, object] = {}

    def install(self):
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.first_signal is not None:
            self.on_repeat(name)
            return
        self.first_signal = name
        self.on_stop_signal(name)

    def on_stop_signal(self, name: str) -> None:
        raise NotImplementedError

    def on_repeat(self, name: str) -> None:
        """A signal after the first: by default the same request, only logged."""
        log.warning("received %s again: already stopping (asked by %s; SIGKILL aborts)", name, self.first_signal)


def stop_request_reason(stop_file: Path) -> Optional[str]:
    """Why control/stop was written (its text, e.g. "SIGINT to train"), or None when there is no
    stop request. An empty file (`touch control/stop`) is a request too."""
    try:
        text = stop_file.read_text().strip()
    except OSError:
        return None
    return f"{text} (stop file {stop_file})" if text else f"stop file {stop_file}"


def write_stopped(run_dir: Path, step: int, reason: str) -> Path:
    path = control_dir(run_dir) / STOPPED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "reason": reason}))
    tmp.replace(path)
    return path
