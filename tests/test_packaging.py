"""`train` works from any directory after a normal (wheel) install: conf/, recipes/ and slurm/ ship inside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO


def test_wheel_carries_configs_and_plans_from_another_directory(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(wheel_dir), str(REPO)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    wheel = next(wheel_dir.glob("launcher-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("launcher/_conf/train.yaml", "launcher/_conf/model/llama3_70b.yaml",
                     "launcher/_recipes/llama70b.yaml", "launcher/_slurm/sbatch.sh.j2"):
        assert required in names, required
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-c", "from launcher.cli import main; main()", "+recipe=llama70b", "action=plan",
         "plan.format=json", "plan.plots=false", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(proc.stdout)
    assert plan["world_size"] == 64 and plan["mesh"]["tp"] == 8
    check = subprocess.run(
        [sys.executable, "-c", "import launcher.paths as p; print(p.config_dir())"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    )
    assert Path(check.stdout.strip()) == site / "launcher" / "_conf"
