"""The rehearsal's reduced pipeline micro-batch count reports the bytes of the full count, exactly.

launcher/rehearse/pp_states.py picks, from torch's own schedule action lists, the smallest
micro-batch count that passes a pipeline rank through the same memory states as the layout's
count; the rehearsal runs that many and adds what the micro-batches not run hold for the whole
step (their receive buffers and token slices). One subprocess (a fake process group of 4 ranks,
rank 0) rehearses each case twice, reduced and with every micro-batch, through the real
engine and schedule; every category must be equal to the byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.multiprocess

_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from launcher.config.loader import compose_spec
from launcher.parallel.pp import chunks_of_rank, pipeline_order, schedule_class
from launcher.rehearse.pp_states import smallest_equivalent_microbatches
from launcher.plan.present.plan import build_plan
from launcher.runtime.entry import engine_options
from launcher.rehearse.rank import rehearse_rank

CASES = {
    # debug model, FSDP2 (dp_shard 2) x 1F1B, 8 micro-batches: rank 0 runs 3
    "debug_fsdp2_1f1b": ["+recipe=debug", "cluster.gpus_per_node=4", "parallel.dp_shard=2", "parallel.pp=2",
                         "parallel.pp_schedule=1f1b", "trainer.global_batch_size=32"],
    # the same x interleaved 1F1B (2 chunks per rank): its sends are held to the step's end, all 8 run
    "debug_interleaved": ["+recipe=debug", "cluster.gpus_per_node=4", "parallel.dp_shard=2", "parallel.pp=2",
                          "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=2",
                          "trainer.global_batch_size=32"],
    # two layers of Llama 3 405B's shapes (bf16), TP 2 + SP x 1F1B, 4 micro-batches: rank 0 runs 3
    "llama405b_shapes_1f1b": [
        "+recipe=debug", "model=llama3_405b", "model.n_layers=2", "precision=bf16",
        "trainer.seq_len=64", "trainer.micro_batch_size=1", "trainer.global_batch_size=4", "cluster.gpus_per_node=4",
        "parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.pp_schedule=1f1b"],
}
out = {}
for name, overrides in CASES.items():
    spec = compose_spec(overrides)
    plan = build_plan(spec, None)
    runs = {}
    for reduce in (True, False):
        rep = rehearse_rank(spec.model, spec.optim, plan.layout, engine_options(spec, Path(sys.argv[1])), 0,
                            reduce_pipeline=reduce)
        runs["reduced" if reduce else "full"] = {"memory": rep["memory"], "notes": rep["notes"]}
    out[name] = dict(runs, microbatches=plan.layout.batch.microbatches)

# Counts the state comparison picks, from torch's action lists (every rank of pp=2, 8 micro-batches).
import torch.distributed as dist
PP2 = dist.new_group([0, 1])

def order_for(name, n):
    v = 1 if name in ("gpipe", "1f1b") else 2
    stages = [PipelineStage(nn.Linear(2, 2), s, 2 * v, torch.device("cpu"), input_args=torch.empty(1, 2, device="meta"),
                            output_args=torch.empty(1, 2, device="meta"), group=PP2) for s in chunks_of_rank(0, 2, v, name)]
    try:
        sched = schedule_class(name)(stages[0] if v == 1 else stages, n_microbatches=n, loss_fn=lambda a, b: a.sum())
    except (ValueError, RuntimeError):
        return None
    return pipeline_order(sched)

counts = {}
for name in ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"):
    v = 1 if name in ("gpipe", "1f1b") else 2
    counts[name] = [smallest_equivalent_microbatches(lambda n: order_for(name, n), 8, r,
                                                     chunks_of_rank(r, 2, v, name), 2 * v - 1) for r in range(2)]
out["counts"] = counts
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("pp_states")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(work)], cwd=work, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["debug_fsdp2_1f1b", "llama405b_shapes_1f1b"])
def test_reduced_microbatch_count_reports_the_full_counts_bytes(compared, case):
    got = compared[case]
    full, reduced = got["full"]["memory"], got["reduced"]["memory"]
    assert full["activations"] > 0 and full["peak"] > full["activations"]
    assert reduced == full, f"{case}: reduced {reduced} != full {full}"
    note = next(n for n in got["reduced"]["notes"] if n.startswith("pipeline:"))
    m = got["microbatches"]
    assert f"of the {m} micro-batches" in note and "same" in note, note
    ran = int(note.split("ran ")[1].split(" of")[0])
    assert 0 < ran < m, note


def test_looped_schedules_run_every_microbatch(compared):
    """Interleaved 1F1B keeps every send's Work (and its tensor) until the step ends, so each
    micro-batch adds to the peak: the rehearsal runs all of them, and says why. (With 6 of 8,
    as the state comparison alone allows, the rank reported 262,144 B less.)"""
    got = compared["debug_interleaved"]
    assert got["reduced"]["memory"] == got["full"]["memory"]
    note = next(n for n in got["reduced"]["notes"] if n.startswith("pipeline:"))
    assert f"run all {got['microbatches']} micro-batches" in note and "until the step ends" in note, note


def test_counts_come_from_the_schedules_action_lists(compared):
    """What the state comparison alone allows (the looped schedules then run every micro-batch,
    above). pp=2, 8 micro-batches. GPipe holds every micro-batch in flight, and the rank holding the last
    stage keeps one output per micro-batch: no smaller count there. 1F1B rank 0 holds at most 2 in
    flight (3 micro-batches reach its steady state); the looped schedules hold more."""
    assert compared["counts"] == {"gpipe": [8, 8], "1f1b": [3, 8], "interleaved_1f1b": [6, 8],
                                  "zero_bubble": [6, 8], "zbv": [8, 4]}
