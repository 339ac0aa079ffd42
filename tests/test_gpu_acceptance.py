"""The GPU acceptance script cannot rot: its CPU smoke (debug models, gloo, no compile) runs the
rows that need no CUDA through the real `train` command, and names the rows that do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, train_env

pytestmark = pytest.mark.multiprocess


def test_cpu_smoke_runs_the_rows_without_cuda_and_names_the_others(tmp_path):
    out = tmp_path / "acceptance"
    env = {**train_env(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_acceptance.sh"), str(out), "--cpu-smoke"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {r["row"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert sorted(rows) == list("abcdefghi")
    assert rows["a"]["ok"] is True and any("loss falls" in n for n in rows["a"]["notes"])
    assert rows["c"]["ok"] is True
    assert any("resumed losses equal the uninterrupted run's: max |diff| 0 " in n for n in rows["c"]["notes"])
    for name in "bdefghi":
        assert rows[name]["ok"] is None and rows[name]["notes"] == ["needs CUDA: not run in the CPU smoke"], name
    table = (out / "results.md").read_text()
    assert "| a | each family" in table and "| c | async checkpoint" in table


def test_every_row_is_built():
    """Each row the docstring lists has its method: on a GPU none answers "not built yet"."""
    from bench.gpu_acceptance import ROW_ORDER, Acceptance, row_titles

    assert sorted(row_titles()) == sorted(ROW_ORDER)
    assert [r for r in ROW_ORDER if not callable(getattr(Acceptance, f"row_{r}", None))] == []
