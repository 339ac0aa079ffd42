"""In-flight micro-batches per pipeline rank (launcher.plan.estimate.memory.inflight_microbatches) against
the order torch's own ScheduleInterleaved1F1B runs (its _calculate_single_rank_operations): the
planner must hold as many micro-batches' activations as the real schedule does, including when
the micro-batches are not a multiple of pp (torch then runs one round of m micro-batches)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

from launcher.plan.layout import RankBatchPlan, Layout
from launcher.plan.degrees import MeshPlan
from launcher.plan.estimate.memory import inflight_microbatches


def _torch_peak_chunks(p: int, v: int, m: int, rank: int) -> int:
    """Most chunk forwards whose backward has not run yet, in torch's order for this rank."""
    rounds = max(1, m // p)
    sched = SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m,
                            number_of_rounds=rounds, microbatches_per_round=m // rounds)
    cur = peak = 0
    for action in ScheduleInterleaved1F1B._calculate_single_rank_operations(sched, rank):
        if action is None:
            continue
        if action.computation_type == _ComputationType.FORWARD:
            cur += 1
        elif action.computation_type == _ComputationType.FULL_BACKWARD:
            cur -= 1
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 4), (8, 2)])
def test_interleaved_inflight_matches_torchs_schedule(p, v):
    for m in range(p, 3 * p + 2):
        for rank in range(p):
            lay = Layout(mesh=MeshPlan(pp=p), vpp=v, batch=RankBatchPlan(microbatches=m), schedule="interleaved_1f1b")
            assert inflight_microbatches(lay, rank) == pytest.approx(_torch_peak_chunks(p, v, m, rank) / v), (p, v, m, rank)


def test_table5_layout_holds_every_micro_batch_under_both_schedules():
    # torchtitan's Table 5 (pp 8, 8 micro-batches): 1F1B's rank 0 warms up with all 8; interleaved
    # (v = 2) would warm up with 22 chunk forwards, capped at the 16 there are. Both hold 8
    # micro-batches of the rank's 16 layers, so in-flight activations do not order the two.
    one = Layout(mesh=MeshPlan(pp=8), vpp=1, batch=RankBatchPlan(microbatches=8), schedule="1f1b")
    two = Layout(mesh=MeshPlan(pp=8), vpp=2, batch=RankBatchPlan(microbatches=8), schedule="interleaved_1f1b")
    assert inflight_microbatches(one, 0) == inflight_microbatches(two, 0) == 8
    assert _torch_peak_chunks(8, 2, 8, 0) == 16
