"""`train` on the host (login node, laptop) imports no torch: it validates, plans, writes the run
directory, renders or starts the ranks; only the ranks import torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from launcher.gpus import visible_gpu_count
from tests.conftest import read_metrics, train_env

# Records, when `train` exits, whether the host process imported torch or DeepSpeed.
WRAPPER = (
    "import atexit, sys\n"
    "atexit.register(lambda: sys.stderr.write('HEAVY=' + repr(sorted(m for m in ('torch', 'deepspeed') "
    "if m in sys.modules)) + '\\n'))\n"
    "sys.argv = ['train'] + sys.argv[1:]\n"
    "from launcher.cli import main\n"
    "main()\n"
)


def _host_train(tmp_path: Path, args):
    script = tmp_path / "wrapper.py"
    script.write_text(WRAPPER)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                          env=train_env(tmp_path), capture_output=True, text=True, timeout=300)
    return proc, run_dir


def test_local_run_host_imports_no_torch(tmp_path):
    """A real local run (one rank trains two steps): the ranks train, the host never imports torch."""
    proc, run_dir = _host_train(tmp_path, ["+recipe=debug", "cluster.gpus_per_node=1", "trainer.steps=2",
                                           "trainer.global_batch_size=2", "logging.wandb.mode=disabled",
                                           "checkpoint.interval=0"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert "HEAVY=[]" in proc.stderr, proc.stderr[-2000:]


def test_slurm_render_host_imports_no_torch(tmp_path):
    proc, run_dir = _host_train(tmp_path, ["+recipe=debug", "cluster=slurm", "cluster.dry_run=true"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (run_dir / "plan.json").is_file()
    assert "HEAVY=[]" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("visible, expected", [(None, 3), ("0,2", 2), ("", 0), ("1,-1,2", 1), ("0,1,2,3,4", 3)])
def test_visible_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path, monkeypatch, visible, expected):
    gpus = tmp_path / "gpus"
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:03:00.0"):
        (gpus / bus).mkdir(parents=True)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpu_count(gpus) == expected
    assert visible_gpu_count(tmp_path / "no_driver", dev_dir=tmp_path / "no_dev") == 0


def test_without_the_drivers_proc_folder_the_device_files_are_counted(tmp_path, monkeypatch):
    """A container or VM may have /dev/nvidiaN but no /proc/driver/nvidia/gpus."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (dev / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpu_count(tmp_path / "no_proc", dev_dir=dev) == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert visible_gpu_count(tmp_path / "no_proc", dev_dir=dev) == 1


def test_cuda_without_a_visible_gpu_is_refused_before_any_rank_starts(tmp_path):
    """trainer.device=cuda on a machine without GPUs: one exit-2 line with the fix, before torchrun
    starts ranks that would fail with tracebacks (no rank log is written)."""
    env = {**train_env(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "launcher", "+recipe=debug", "trainer.device=cuda",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "trainer.device=cuda: cluster.gpus_per_node=2 local ranks need as many GPUs" in out
    assert "Fix: trainer.device=cpu or trainer.device=auto" in out and "Traceback" not in out
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


def test_a_recipe_that_submits_without_sbatch_on_path_is_refused_naming_cluster_local(tmp_path):
    """`train +recipe=llama8b data.path=...` on a machine without SLURM: the recipe sets cluster=slurm,
    so the command would call sbatch; one exit-2 line naming cluster=local, before anything is written."""
    import numpy as np

    (tmp_path / "tokens").mkdir()
    np.arange(50_000, dtype=np.uint16).tofile(tmp_path / "tokens" / "a.bin")
    no_slurm = tmp_path / "bin"  # PATH with no sbatch on it (this machine may have one)
    no_slurm.mkdir()
    env = {**train_env(tmp_path), "PATH": str(no_slurm)}
    proc = subprocess.run([sys.executable, "-m", "launcher", "+recipe=llama8b", f"data.path={tmp_path / 'tokens'}",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Invalid configuration (1 problem)" in out and "sbatch, which is not on PATH" in out, out[-3000:]
    assert "Fix: cluster=local" in out and "Traceback" not in out
    assert not (tmp_path / "run").exists()  # nothing written


def test_a_sweep_without_sbatch_says_it_once_for_every_job(tmp_path, monkeypatch, capsys):
    """`train -m +recipe=llama8b optim.lr=1e-4,3e-4 ...` without sbatch: the problem every job has is
    one line, not one per job."""
    import numpy as np

    from launcher.cli import _precheck

    (tmp_path / "tokens").mkdir()
    np.arange(50_000, dtype=np.uint16).tofile(tmp_path / "tokens" / "a.bin")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        _precheck(["-m", "+recipe=llama8b", "optim.lr=1e-4,3e-4", f"data.path={tmp_path / 'tokens'}"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Invalid configuration (1 problem)" in err, err
    assert err.count("sbatch, which is not on PATH") == 1 and "every sweep job: cluster=slurm" in err, err
