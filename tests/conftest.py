"""Shared helpers: run the real `train` command in a temporary run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("train"))
# Every process of the suite builds and loads DeepSpeed's JIT ops with this compiler: g++ with -g0
# last (333 instead of 421 CPU-seconds for the four ops on a quiet 2-core machine, 2026-11-28)
# and a precompiled torch header for async I/O (198 -> 155 CPU-s for that op); the script says
# why. Set for the whole session, so that each process sees the same build command (a changed
# command rebuilds the op). A CXX of your own is kept.
os.environ.setdefault("CXX", str(REPO / "tests" / "deepspeed_harness" / "suite-g++"))
# One intra-op thread in the pytest processes, as the ranks have (torchrun and launch/local.py set
# it for them): with two pytest workers on two cores, each worker's tests run beside the other's,
# and two OpenMP threads per worker spin for cores that are busy. In-process tests ran 23-28 s
# instead of 17.5-19.5 s with two busy processes beside them (test_models, test_layers, test_gqa,
# test_precision; 2026-11-28). Set before any test imports torch (the workers inherit it); a value
# of your own is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def train_env(tmp_path: Path, wandb: str = "disabled") -> Dict[str, str]:
    """The environment of a test's `train` launch. W&B (`logging.wandb.mode=auto`, which follows
    WANDB_MODE) is off unless a test asks for it: its service and its end-of-run sync cost a 2-rank
    debug launch about 2.6 s of CPU and of wall time (three alternating pairs of launches on a
    quiet 2-core machine, 2026-11-28). The launches that keep it offline: tests/test_wandb_fallback.py,
    test_train_e2e.py's reference run, crash/resume and Ctrl-C runs, and test_slurm_train.py's jobs."""
    env = dict(os.environ)
    env.update(
        WANDB_MODE=wandb,
        WANDB_DIR=str(tmp_path),
        WANDB_CACHE_DIR=str(tmp_path / ".wandb_cache"),
        WANDB_DATA_DIR=str(tmp_path / ".wandb_data"),
        WANDB_SILENT="true",
        HYDRA_FULL_ERROR="0",
    )
    env.pop("WANDB_API_KEY", None)
    return env


def run_train(args: Sequence[str], run_dir: Path, timeout: int = 300, check: bool = False,
              wandb: str = "disabled") -> subprocess.CompletedProcess:
    """Run `train ARGS hydra.run.dir=RUN_DIR` and return the finished process (W&B: train_env)."""
    cmd = [TRAIN, *args, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(
        cmd, cwd=run_dir.parent, env=train_env(run_dir.parent, wandb), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(run_dir: Path) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(run_dir: Path) -> Dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture
def fake_two_ranks():
    """Rank 0 of a 2-rank fake process group (no peers, collectives return at once) and its 1-D
    CPU device mesh, for code that needs a real mesh but no second process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- DeepSpeed ops

_PREBUILD = {}
PREBUILD_FINISH_S = 1200  # the longest wait for the op build at a pytest worker's end (a cold build: ~5-10 min)


@pytest.fixture(scope="module")
def debug_engine(tmp_path_factory):
    """(engine, batches, plan): a one-rank native engine of the debug recipe (10 steps of 2 x 32
    tokens, seed 0) with its batches, shared by the checkpoint tests of a module."""
    import torch  # here, not at the top: conftest is imported by tests that never start torch

    from launcher.config.loader import compose_spec
    from launcher.engines.native import NativeEngine
    from launcher.plan.present.plan import build_plan
    from launcher.runtime.entry import build_batches, engine_options

    tmp_path = tmp_path_factory.mktemp("engine")
    spec = compose_spec(["+recipe=debug", "cluster.gpus_per_node=1", "trainer.global_batch_size=2", "trainer.seq_len=32"])
    spec.trainer.steps, spec.trainer.grad_clip, spec.trainer.seed = 10, 1.0, 0
    plan = build_plan(spec)
    engine = NativeEngine(spec.model, spec.optim, plan.layout, torch.device("cpu"), engine_options(spec, tmp_path))
    return engine, build_batches(spec, plan, 0, tmp_path), plan


def _is_deepspeed_test(item) -> bool:
    return Path(str(item.fspath)).name.startswith("test_deepspeed")


def _is_slurm_module(path: str) -> bool:
    """The SLURM test modules (marked `slurm`, using the one dev cluster) are tests/test_slurm_*.py."""
    return Path(path).name.startswith("test_slurm_")


# The longest modules that train, after the SLURM unit and the layout matrix, longest first (wall
# seconds on one worker in fresh-clone CI runs, 2026-11-28): started early, they leave the short
# modules to fill the end of the suite on both workers. Last in file order, test_train_e2e.py
# (260-310 s) ran alone at the end for 65-115 s while the other worker had finished. Early, it
# runs beside the SLURM jobs: its signal and restart tests must not depend on how fast the ranks
# train (they hold the ranks at a known step, LAUNCHER_DEBUG_HOLD, where timing matters).
LONG_MODULES = ("test_train_e2e.py", "test_rehearse.py", "test_document_masking.py", "test_bench_smoke.py")


def _module_order(item) -> tuple:
    """Where an item's module runs: SLURM first, the layout matrix next, then LONG_MODULES in their
    order, the other modules in file order, DeepSpeed last."""
    name = Path(str(item.fspath)).name
    if _is_slurm_module(name):
        return (0, 0)
    if name == "test_parallel_layouts.py":
        return (1, 0)
    if name in LONG_MODULES:
        return (2, LONG_MODULES.index(name))
    return (4, 0) if _is_deepspeed_test(item) else (3, 0)


def pytest_collection_modifyitems(session, config, items):
    """Order the modules for two pytest workers (`make test` runs `-n 2`), each module's tests kept
    together and in order (pytest_xdist_make_scheduler below sends a module whole to one worker).

    - The SLURM modules first, as one unit on one worker: they share the one dev cluster (two of
      them at once would queue for its nodes, and the node-death test needs the nodes the others
      use), and they mostly wait on jobs, so the other worker trains beside them. The layout
      matrix, the longest module that trains, starts at the same time on the other worker.
    - Then the other long modules (LONG_MODULES), so that the end of the suite is made of short
      modules that even out the two workers.
    - The DeepSpeed modules last. Their JIT ops build in the background at the lowest priority
      (pytest_collection_finish): the build only gets the CPU the running tests leave idle. In
      file order the DeepSpeed modules come early: in the 2026-11-26 CI runs the build finished
      285 s into the suite (async I/O alone 136 s) and the set-up of the fixture that needs async
      I/O took 93-102 s. Last, they find every op built.
    """
    items[:] = sorted(items, key=_module_order)  # stable: file order within each class


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a plain pytest without xdist skips it
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler, one work unit per test module (its module-scoped launches are
    shared by its tests), all SLURM modules in one unit; units go out in collection order.
    (`--dist loadgroup` cannot group them: pytest 9.2 derives node ids, so xdist 3.8's group suffix
    on the node id no longer takes.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "slurm" if _is_slurm_module(module) else module

    return ModuleScheduling(config, log)


def pytest_collection_finish(session):
    """Start building DeepSpeed's JIT ops at the lowest priority when DeepSpeed tests will run
    (tests/deepspeed_harness/prebuild_ops.py says why)."""
    if not any(_is_deepspeed_test(item) for item in session.items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # one build for the session: the first pytest worker starts it
    from tests.deepspeed_harness.common import deepspeed_env

    log_dir = REPO / ".cache"
    log_dir.mkdir(exist_ok=True)
    _PREBUILD["log"] = log = open(log_dir / "prebuild_ops.log", "w")
    _PREBUILD["proc"] = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "deepspeed_harness" / "prebuild_ops.py")],
        env=deepspeed_env({"MAX_JOBS": "2"}), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        preexec_fn=lambda: os.nice(19))


def pytest_sessionfinish(session, exitstatus):
    """A build still running when a single-process session ends is interrupted, which releases its
    lock (torch removes the lock file on the way out) and leaves the rest to the next build.

    Under pytest-xdist the worker that started the build may finish while the other worker's
    DeepSpeed ranks wait on the build's lock. torch's waiters take a released lock for a finished
    build and import the op at once (`async_io.so: cannot open shared object file` in CI), so that
    worker lets the build finish instead (bounded, then interrupted)."""
    proc = _PREBUILD.pop("proc", None)
    if proc is not None and proc.poll() is None:
        if os.environ.get("PYTEST_XDIST_WORKER"):
            try:
                proc.wait(timeout=PREBUILD_FINISH_S)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if "log" in _PREBUILD:
        _PREBUILD.pop("log").close()
