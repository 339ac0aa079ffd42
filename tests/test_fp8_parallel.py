"""FP8 (emulated) through the native engine on 2 CPU ranks: FSDP2 with float8 all-gather, and TP.

The test launches this same file under torchrun as the worker (``--worker``), which trains
the debug model for a few steps in bf16 and fp8 for each layout through NativeEngine and
writes the per-step losses; the test then compares fp8 with bf16 of the same layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS = 4
# Same bound as tests/test_precision.py, whose single-rank runs measured 4.7e-3.
FP8_VS_BF16_TOL = 1.5e-2
LAYOUTS = {"fsdp2": {"dp_shard": 2}, "tp2": {"tp": 2}}


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO))
    from launcher.config.schema import OptimConfig
    from launcher.engines.base import EngineOptions
    from launcher.engines.native import NativeEngine
    from tests.layout_for import job_spec
    from launcher.plan.decide.resolve import resolve
    from tests.parallel_harness.run_layouts import model_config, rank_microbatches

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = model_config("debug")
    results = {}
    for name, degrees in LAYOUTS.items():
        for precision in ("bf16", "fp8"):
            key = f"{name}_{precision}"
            try:
                dotted = {f"parallel.{k}": v for k, v in degrees.items()}
                job = job_spec(cfg, 2, **dotted, **{"precision.name": precision})
                layout = resolve(job)
                mesh = layout.mesh
                engine = NativeEngine(
                    cfg, OptimConfig(lr=2e-3, warmup_steps=0, schedule="constant", weight_decay=0.0), layout,
                    torch.device("cpu"), EngineOptions(total_steps=STEPS, grad_clip=1.0, seed=7))
                c = mesh.coordinates(rank)
                losses = [engine.train_step(rank_microbatches(s, cfg.vocab_size, c["dp_shard"], mesh.dp)).loss
                          for s in range(STEPS)]
                report = getattr(engine.model_parts[0], "float8_report", None)
                results[key] = {"losses": losses,
                                "converted": len(report.converted) if report else 0,
                                "all_gather": bool(report and report.all_gather)}
            except Exception as e:  # record and go on: the other layouts still tell something
                import traceback

                results[key] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            dist.barrier()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    from launcher.runtime.dist import exit_after_shutdown

    exit_after_shutdown()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8_parallel")
    out = work / "results.json"
    env = dict(os.environ, TMPDIR=str(work), PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(__file__).resolve()), "--worker", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if not out.exists():
        raise AssertionError(f"2-rank launch failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


pytestmark = pytest.mark.multiprocess


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_tracks_bf16_in_layout(results, layout):
    bf16, fp8 = results[f"{layout}_bf16"], results[f"{layout}_fp8"]
    assert "error" not in bf16, bf16.get("traceback", bf16)
    assert "error" not in fp8, fp8.get("traceback", fp8)
    assert fp8["converted"] == 7 * 4  # wq wk wv wo w1 w2 w3 in each of the 4 blocks
    diffs = [abs(a - b) for a, b in zip(fp8["losses"], bf16["losses"])]
    assert max(diffs) < FP8_VS_BF16_TOL, f"{layout}: fp8 vs bf16 losses {fp8['losses']} vs {bf16['losses']}"
    assert fp8["losses"][-1] < fp8["losses"][0]


def test_fsdp2_uses_float8_all_gather(results):
    assert results["fsdp2_fp8"].get("all_gather") is True
    assert results["tp2_fp8"].get("all_gather") is False  # no FSDP in a pure-TP layout


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(sys.argv[sys.argv.index("--worker") + 1])
