"""bench/gpu_throughput.py in --smoke mode (CPU, debug model) so the GPU harness never rots,
and the FLOPs-per-token formula it reports MFU with."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.config.loader import compose_spec
from launcher.plan.estimate.flops import achieved_tflops, mfu, param_counts, training_flops_per_token

REPO = Path(__file__).resolve().parents[1]


def test_flops_per_token_by_hand():
    # llama_1b (tied embeddings): the table is the output matmul, so N = all 1,235,814,400 params.
    m = compose_spec(["model=llama_1b"]).model
    assert param_counts(m).total == 1_235_814_400
    assert training_flops_per_token(m, 4096) == 6 * 1_235_814_400 + 12 * 16 * 2048 * 4096  # 9.0255e9
    # 50k tokens/s on one H100 (989 TFLOP/s dense bf16) -> 451.3 TFLOP/s -> 45.6 % MFU.
    assert achieved_tflops(50_000, 9_025_499_136) == pytest.approx(451.27, abs=0.01)
    assert mfu(50_000, 9_025_499_136, 989.0) == pytest.approx(0.4563, abs=1e-4)
    # Untied (debug): the input table is only looked up, not multiplied.
    d = compose_spec(["model=debug"]).model
    pc = param_counts(d)
    assert pc.matmul_active == pc.total - 256 * 64
    with pytest.raises(ValueError, match="peak_tflops"):
        mfu(1.0, 1.0, 0.0)


def test_moe_flops_count_active_experts_only():
    m = compose_spec(["model=mixtral_8x7b"]).model
    pc = param_counts(m)
    assert pc.total > 3 * pc.active  # 46.7 B total, 12.9 B active
    assert training_flops_per_token(m, 4096) == 6 * pc.matmul_active + 12 * 32 * 4096 * 4096


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_throughput.py"), "--smoke",
         "--json", str(out / "r.json"), "--append", str(out / "benchmarks.md")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    return proc, out


def test_smoke_runs_every_variant(smoke):
    proc, out = smoke
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    data = json.loads((out / "r.json").read_text())
    by = {r["variant"]: r for r in data["results"]}
    assert list(by) == ["reference bf16 + compile", "launcher bf16", "launcher bf16 + compile",
                        "launcher fp8 + compile"]
    ref = by["reference bf16 + compile"]
    assert ref["status"] == "ok" and ref["tokens_per_s"] > 0 and ref["tflops"] > 0
    assert ref["mfu"] is None  # a GPU peak means nothing on CPU
    assert ref["params"] == param_counts(compose_spec(["model=debug"]).model).total
    assert ref["predicted_mem_bytes"] > 0  # the planner's estimate sits next to each row
    steps = data["settings"]["warmup"] + data["settings"]["steps"]
    assert len(ref["losses"]) == steps and all(math.isfinite(x) for x in ref["losses"])
    for name in ("launcher bf16", "launcher bf16 + compile", "launcher fp8 + compile"):
        assert by[name]["status"] == "ok", f"{name}: {by[name]['status']}"
        assert by[name]["tokens_per_s"] > 0
        assert by[name]["params"] == ref["params"]  # the same model in every variant
    # Same model, init, data and optimizer: the reference really is the launcher's loop, by hand.
    for a, b in zip(ref["losses"], by["launcher bf16"]["losses"]):
        assert abs(a - b) < 1e-2, (ref["losses"], by["launcher bf16"]["losses"])
    for a, b in zip(by["launcher bf16"]["losses"], by["launcher fp8 + compile"]["losses"]):
        assert abs(a - b) < 5e-2
    assert data["ratios"]["launcher_over_reference"] > 0


def test_smoke_prints_and_appends_the_record(smoke):
    proc, out = smoke
    table_header = "| variant | compile | tokens/s | step ms | TFLOP/s | MFU | peak mem GiB | planner GiB | status |"
    assert table_header in proc.stdout
    assert "launcher / reference step time" in proc.stdout
    record = (out / "benchmarks.md").read_text()
    assert table_header in record and "torchao" in record and "smoke" in record


@pytest.mark.multiprocess
def test_step_overhead_smoke_prints_the_ratio_line(tmp_path):
    """bench/step_overhead.py with one timed step per side (2 ranks, CPU): it runs, the bare loop and
    the launcher train the same model to the same loss, and the last line is `overhead ratio R`.
    No timing assertion: R itself is a benchmark result (bench/README.md)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "step_overhead.py"), "--rounds", "1", "--steps", "1", "--warmup", "1",
         "--log-every", "1", "--json", str(tmp_path / "r.json")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    last = proc.stdout.strip().splitlines()[-1]
    words = last.split()
    assert words[:2] == ["overhead", "ratio"] and len(words) == 3 and float(words[2]) > 0, last
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["ranks"], r["timed_steps"], r["loss_step"]) == (2, 1, 2)
    assert r["bare_loss"] == pytest.approx(r["launcher_loss"], abs=1e-4)


@pytest.mark.multiprocess
def test_step_overhead_data_path_smoke_prints_the_ratio_line(tmp_path):
    """bench/step_overhead.py --data-path with one timed step per side (2 ranks, CPU): the launcher
    on a 3-source indexed mix with document masking and the same launcher on those micro-batches
    held in memory train the same model to the same loss, and the last line is `data path ratio R`.
    No timing assertion: R is a benchmark result (bench/README.md)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "step_overhead.py"), "--data-path", "--rounds", "1", "--steps", "1",
         "--warmup", "1", "--log-every", "1", "--json", str(tmp_path / "r.json")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    words = proc.stdout.strip().splitlines()[-1].split()
    assert words[:3] == ["data", "path", "ratio"] and len(words) == 4 and float(words[3]) > 0, proc.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["indexed_step_s"] > 0 and r["in_memory_step_s"] > 0
    assert (r["ranks"], r["timed_steps"], r["loss_step"]) == (2, 1, 2)
    assert [name for name, _ in r["sources"]] == ["web", "code", "math"]
    assert max(r["documents_per_row_step1"]) > 1  # packed rows: the document mask is really in play
    # The same batches through the same model: the data path changes no number.
    assert r["indexed_loss"] == r["in_memory_loss"]


@pytest.mark.multiprocess
def test_checkpoint_blocking_smoke_prints_the_ratio_line(tmp_path):
    """bench/checkpoint_blocking.py with one round of one step per kind on the debug model (2 ranks,
    CPU): a synchronous and an asynchronous save run, and the last line is `blocking ratio R`.
    No timing assertion: R is a benchmark result (bench/README.md)."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "checkpoint_blocking.py"), "--rounds", "1", "--steps", "1",
         "--warmup", "1", "--dim", "0", "--layers", "0", "--vocab", "0", "--json", str(tmp_path / "r.json")],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    words = proc.stdout.strip().splitlines()[-1].split()
    assert words[:2] == ["blocking", "ratio"] and len(words) == 3, proc.stdout
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["checkpoint_bytes"] > 0 and {k: len(v) for k, v in r["round_s"].items()} == {"none": 1, "sync": 1, "async": 1}


def test_gpu_moe_smoke_grouped_equals_the_loop():
    """bench/gpu_moe.py --smoke (CPU, small MoE layer): the harness runs, the grouped GEMM's output
    and expert-weight gradients equal the loop's, and fp8 is skipped with the reason (no CPU kernel)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_moe.py"), "--smoke"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| variant")}
    assert set(rows) == {"loop", "grouped", "fp8"}, proc.stdout
    ms, out_err, _x_err, *w_errs = (float(c) for c in rows["grouped"])
    assert ms > 0 and out_err == 0.0 and all(e == 0.0 for e in w_errs), rows["grouped"]
    assert rows["fp8"][0].startswith("skipped: device 'cpu'"), rows["fp8"]


def test_rehearse_gpu_smoke_row_matches_the_real_step(tmp_path):
    """bench/rehearse_gpu.py --smoke for one row (real side on the CPU): the harness runs, and on the
    CPU the rehearsal's activation peak and peak equal the real step's (the GPU rows are in
    docs/benchmarks.md)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "rehearse_gpu.py"), "--smoke",
                           "--rows", "debug s128 AC none", "--json", str(tmp_path / "r.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    real, fake, plan = row["real"], row["fake"], row["plan"]
    assert real["activations"] > 0 and fake["activations"] == real["activations"], row
    assert fake["peak"] == real["peak"] and plan["peak"] > 0, row
