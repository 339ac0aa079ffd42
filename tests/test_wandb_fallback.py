"""W&B never stops training: no network, no wandb package, or W&B failing mid-run.

Real `train` runs (2 ranks, torchrun, gloo) with the real wandb package; "no network" is a
TCP server on 127.0.0.1 that accepts connections and never answers, as a firewalled compute
node's route to api.wandb.ai behaves. Nothing leaves the machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Dict, List

import pytest

from tests.conftest import REPO, TRAIN, read_metrics, train_env

pytestmark = pytest.mark.multiprocess

STEPS = 10  # the debug recipe logs every 5 steps
FALLBACK_WARNING = "W&B could not start online"
MISSING_WARNING = "the wandb package cannot be imported"


class SilentServer:
    """Accepts TCP connections on 127.0.0.1 and never sends a byte (a black-holed W&B server)."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._held: List[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed by stop()
                return
            self._held.append(conn)

    def __enter__(self) -> "SilentServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        # close() alone does not wake the thread blocked in accept() on Linux; shutdown() does.
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for conn in self._held:
            conn.close()
        self._thread.join(timeout=5)


def _train(run_dir: Path, args: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    cmd = [TRAIN, "+recipe=debug", f"trainer.steps={STEPS}", *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def _assert_trained(run_dir: Path) -> None:
    steps = [r["step"] for r in read_metrics(run_dir) if "loss" in r]
    # Every log_every-th step (the trainer also logs step 1) up to the last one, each once.
    assert set(range(5, STEPS + 1, 5)) <= set(steps) and steps == sorted(set(steps)) and steps[-1] == STEPS, (
        f"metrics.jsonl is incomplete: steps {steps}")


def _rank0_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "rank_0.log").read_text()


def test_online_without_network_falls_back_to_offline(run_dir: Path):
    """mode=auto with an API key (as SLURM forwards it) and an unreachable server."""
    env = train_env(run_dir.parent)
    env.pop("WANDB_MODE")  # auto follows WANDB_MODE (train_env sets it); this test needs auto to try online
    env.pop("WANDB_SILENT")  # what a user's shell has: W&B's own console output is logging.wandb.quiet's job
    with SilentServer() as server:
        env.update(WANDB_API_KEY="0123456789abcdef" * 2 + "01234567", WANDB_BASE_URL=server.url)
        proc = _train(run_dir, ["logging.wandb.mode=auto", "logging.wandb.init_timeout_s=5"], env)
    console = proc.stdout + proc.stderr
    assert "Run summary:" not in console and "Run history:" not in console, console[-3000:]
    [offline] = (run_dir / "wandb").glob("offline-run-*")
    assert f"W&B offline run in {offline}: upload it with `wandb sync {offline}`" in console
    _assert_trained(run_dir)
    log = _rank0_log(run_dir)
    assert log.count(FALLBACK_WARNING) == 1, f"expected one fallback warning in rank_0.log:\n{log[-3000:]}"
    assert "wandb sync" in log, "the warning must say how to upload the offline run later"
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"no offline W&B run in {run_dir / 'wandb'}: {list((run_dir / 'wandb').glob('*'))}"
    data = runs[0].read_bytes()
    assert b"trainer/step" in data and b"loss" in data, "the offline W&B run holds no logged metrics"
    import torch

    # The run's config records what it ran on (also in run_summary.json): torch, CUDA, NCCL, GPU...
    assert b"environment" in data and torch.__version__.encode() in data and b"gpu_count" in data


@pytest.mark.parametrize("env,key,want", [("disabled", True, "disabled"), ("offline", True, "offline"),
                                          ("dryrun", False, "offline"), ("online", False, "online"),
                                          ("", True, "online"), ("", False, "offline")])
def test_auto_follows_wandb_mode_then_the_api_key(env, key, want, monkeypatch, tmp_path):
    """logging.wandb.mode=auto takes W&B's own WANDB_MODE when set, else online with an API key
    (environment or ~/.netrc), else offline; an explicit logging.wandb.mode wins over both."""
    from launcher.config.schema import WandbConfig
    from launcher.runtime.metrics import wandb_mode

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("WANDB_MODE", env)
    if key:
        monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    else:
        monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_mode(WandbConfig(mode="auto")) == want
    assert wandb_mode(WandbConfig(mode="offline")) == "offline"


def test_missing_wandb_package_trains_and_warns(run_dir: Path, tmp_path: Path):
    """A wandb that cannot be imported (not installed, or broken) in mode=auto."""
    fake = tmp_path / "no_wandb" / "wandb"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("No module named wandb (test stand-in)")\n')
    env = train_env(run_dir.parent, "offline")  # what auto picks without an API key
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(REPO), env.get("PYTHONPATH", "")])
    _train(run_dir, ["logging.wandb.mode=auto"], env)
    _assert_trained(run_dir)
    log = _rank0_log(run_dir)
    assert log.count(MISSING_WARNING) == 1, f"expected one missing-package warning in rank_0.log:\n{log[-3000:]}"
    assert not (run_dir / "wandb").exists() or not list((run_dir / "wandb").glob("*run-*"))


# Runs in its own interpreter: it kills that interpreter's wandb service, which must not
# disturb other tests' W&B runs.
SERVICE_DIES = textwrap.dedent("""
    import logging, os, signal, sys, time
    from pathlib import Path
    from launcher.config.schema import WandbConfig
    from launcher.runtime.metrics import MetricsLogger

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    run_dir = Path(sys.argv[1])
    logger = MetricsLogger(run_dir, enabled=True, wandb_cfg=WandbConfig(mode="offline"), config={},
                           total_steps=3, progress=False)
    record = dict(loss=1.0, lr=1e-3, grad_norm=1.0, tokens_per_s=1.0, step_time_s=1.0)
    logger.log(dict(record, step=1))
    # The W&B service process dies (OOM killer, node clean-up): every later W&B call raises.
    me = str(os.getpid())
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if stat[1] == me and b"wandb-core" in cmd:
            os.kill(int(pid), signal.SIGKILL)
            print("killed wandb service", pid)
    time.sleep(1)
    logger.log(dict(record, step=2))
    logger.summary({"x": 1})
    logger.log(dict(record, step=3))
    logger.close()
    print("closed cleanly")
""")


def test_wandb_service_dying_mid_run_never_stops_training(tmp_path: Path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = train_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SERVICE_DIES, str(run_dir)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "killed wandb service" in out, f"the test did not find the wandb service to kill:\n{out[-3000:]}"
    assert proc.returncode == 0 and "closed cleanly" in proc.stdout, f"a W&B failure stopped the run:\n{out[-4000:]}"
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3], "metrics.jsonl must keep every step"
    assert proc.stdout.count("W&B logging stops for this run") == 1, f"expected one warning:\n{out[-3000:]}"
