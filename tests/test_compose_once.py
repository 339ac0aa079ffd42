"""A plain `train KEY=VALUE...` composes its config once (issue 37 item 8) and still runs as
`@hydra.main` runs it: the same run dir, .hydra/*.yaml and output; flags keep Hydra's own main.

`train -r ...` (Hydra's "run a job" flag, the default) is the reference: a flag sends the command
through `@hydra.main`, as every command went before.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.conftest import TRAIN, train_env

PLAN = ["+recipe=llama405b", "action=plan", "plan.format=json", "cluster.nodes=1024", "cluster.gpus_per_node=8"]

# Counts Hydra's compositions (get_mode, run, the compose API: all go through load_configuration).
COUNTING_TRAIN = (
    "import atexit, sys\n"
    "from hydra._internal.config_loader_impl import ConfigLoaderImpl\n"
    "calls = []\n"
    "real = ConfigLoaderImpl.load_configuration\n"
    "ConfigLoaderImpl.load_configuration = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)\n"
    "atexit.register(lambda: sys.stderr.write('COMPOSED=%d\\n' % len(calls)))\n"
    "sys.argv = ['train'] + sys.argv[1:]\n"
    "from launcher.cli import main\n"
    "main()\n"
)


def _train(args, cwd: Path, script: Path = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(script), *args] if script else [TRAIN, *args]
    return subprocess.run(cmd, cwd=cwd, env=train_env(cwd), capture_output=True, text=True, timeout=120)


def test_a_plain_run_composes_once_and_a_flagged_one_as_hydra_does(tmp_path):
    script = tmp_path / "counting_train.py"
    script.write_text(COUNTING_TRAIN)
    once = _train([*PLAN, f"hydra.run.dir={tmp_path / 'once'}"], tmp_path, script)
    assert once.returncode == 0, once.stderr
    assert "COMPOSED=1" in once.stderr, once.stderr
    flagged = _train(["-r", *PLAN, f"hydra.run.dir={tmp_path / 'flagged'}"], tmp_path, script)
    assert flagged.returncode == 0, flagged.stderr
    assert "COMPOSED=3" in flagged.stderr, flagged.stderr  # the pre-check, Hydra's get_mode and run
    assert once.stdout == flagged.stdout


def test_the_run_dir_is_what_hydras_main_writes(tmp_path):
    args = ["+recipe=debug", "action=plan", "plan.plots=false", "trainer.steps=7"]
    for name, flags in (("once", []), ("hydra", ["-r"])):
        proc = _train([*flags, *args, f"hydra.run.dir={tmp_path / name}"], tmp_path)
        assert proc.returncode == 0, proc.stderr
    once, hydra = tmp_path / "once", tmp_path / "hydra"
    files = sorted(str(p.relative_to(once)) for p in once.rglob("*"))
    assert files == sorted(str(p.relative_to(hydra)) for p in hydra.rglob("*"))
    assert {".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", "cli.log"} <= set(files), files
    for name in ("config.yaml", "overrides.yaml"):
        assert (once / ".hydra" / name).read_text() == (hydra / ".hydra" / name).read_text()
    hydra_yaml = (hydra / ".hydra" / "hydra.yaml").read_text().replace(str(hydra), str(once))
    assert (once / ".hydra" / "hydra.yaml").read_text() == hydra_yaml
    assert "steps: 7" in (once / ".hydra" / "config.yaml").read_text()


def test_the_default_run_dir_is_under_outputs_named_after_the_model(tmp_path):
    proc = _train(["+recipe=debug", "action=plan", "plan.plots=true"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "outputs").glob("*/*_debug")
    assert (run_dir / "plan.json").exists() and (run_dir / ".hydra" / "config.yaml").exists()


def test_flags_keep_hydras_main(tmp_path):
    shown = _train(["--cfg", "job", "+recipe=debug", "trainer.steps=7"], tmp_path)
    assert shown.returncode == 0 and "steps: 7" in shown.stdout, shown.stderr
    helped = _train(["--help"], tmp_path)
    assert helped.returncode == 0 and "model:" in helped.stdout, helped.stderr
    # A newcomer's help: the actions, the main keys and three examples that compose (planned here).
    assert helped.stdout.startswith("train: validate, plan and launch LLM training runs")
    assert "Actions (action=...): run (default), plan" in helped.stdout and "Main keys:" in helped.stdout
    examples = [line.split("   ")[0].strip() for line in helped.stdout.splitlines() if line.startswith("  train ")]
    assert len(examples) == 3
    planned = _train([*examples[1].split()[1:], "plan.format=json", f"hydra.run.dir={tmp_path / 'planned'}"], tmp_path)
    assert planned.returncode == 0 and '"layout"' in planned.stdout, planned.stderr[-2000:]
    sweep = tmp_path / "sweep"
    swept = _train(["-m", "+recipe=debug", "action=plan", "plan.format=json", "trainer.steps=3,4",
                    f"hydra.sweep.dir={sweep}"], tmp_path)
    assert swept.returncode == 0, swept.stderr
    assert [(sweep / str(n) / ".hydra" / "config.yaml").exists() for n in (0, 1)] == [True, True]
    assert swept.stdout.count('"layout"') == 2
    assert not (tmp_path / "outputs").exists()
