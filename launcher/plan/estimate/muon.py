"""Muon's costs: Newton-Schulz FLOPs of one matrix, the owner assignment that balances them, and
one pipeline rank's Muon work (its momentum elements, its Newton-Schulz FLOPs, its gather/scatter bytes).

Pure Python: the engine assigns owners with `assign_owners` (launcher/engines/muon.py imports it
from here), the planner (launcher/plan/estimate/memory.py, perf.py) and bench/muon.py price the
same work with `ns_flops` and the same assignment, so the prediction and the run share one formula
(docs/optimizers.md, "Distributed Newton-Schulz").
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

from launcher.plan.layout import Layout
from launcher.plan.estimate.params import StageParams

# Where a Muon matrix lives in the planner's compact record (Layout.numerics.muon_matrices,
# written by launcher/plan/decide/optim_groups.py muon_matrices): a block
# index, or the first pipeline stage's tables (the embedding) or the last stage's (final norm,
# head, multi-token prediction).
WITH_EMBEDDING, WITH_OUTPUT = -1, -2
# How tensor / expert parallelism divide a Muon parameter: "split" (TP splits it: the block
# matrices, the tables), "whole" (TP leaves it whole: an MoE block's router and shared experts, as
# launcher/plan/estimate/params.py StageParams.tp_replicated counts them), "experts" (a routed
# expert stack: EP splits its matrices).
MUON_KINDS = ("split", "whole", "experts")
# Bytes per element of an update on its way to the owner and of the result on its way back: bf16
# (launcher/engines/muon_exchange.py sends bf16, as torch's Newton-Schulz casts to bf16 first).
UPDATE_BYTES = 2.0


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """FLOPs of `steps` Newton-Schulz iterations on a (rows, cols) matrix, as torch.optim.Muon runs
    them on X of shape (m, n), m = min(rows, cols): per step X X^T (2 m^2 n), the quintic's
    A A (2 m^3) and B X (2 m^2 n)."""
    m, n = min(rows, cols), max(rows, cols)
    return float(steps) * (4.0 * m * m * n + 2.0 * m ** 3)


def assign_owners(costs: Sequence[float], n_ranks: int, loads: List[float] = None) -> List[int]:
    """Owner rank (0..n_ranks-1) of each matrix: longest-processing-time first, each matrix to the
    least-loaded rank (ties: the lowest rank), so the largest rank load stays within 4/3 of the
    optimum. Deterministic: every rank computes the same answer from the same list. `loads`
    (per rank, updated in place) carries earlier assignments across calls."""
    loads = loads if loads is not None else [0.0] * n_ranks
    owners = [0] * len(costs)
    # A heap of (load, rank): its top is the least-loaded rank, the lowest on a tie (O(log n) per
    # matrix: the planner assigns DeepSeek-V3's ~45,000 expert matrices per candidate layout).
    heap = [(loads[r], r) for r in range(n_ranks)]
    heapq.heapify(heap)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heap[0]
        owners[i] = r
        loads[r] = load + costs[i]
        heapq.heapreplace(heap, (loads[r], r))
    return owners


def owner_loads(costs: Sequence[float], owners: Sequence[int], n_ranks: int) -> Tuple[float, float]:
    """(largest, mean) Newton-Schulz cost per rank of an assignment: its imbalance is their ratio."""
    loads = [0.0] * n_ranks
    for c, o in zip(costs, owners):
        loads[o] += c
    return max(loads), sum(loads) / n_ranks


# Bytes per Muon parameter element of the elementwise part of its step, fp32: the momentum lerp
# (read buf, g; write buf), Nesterov's lerp (read g, buf; write u), the weight decay (read, write p)
# and the update (read p, O; write p). AdamW's step: 28 B (perf.py optimizer_step_s).
MUON_ELEMENTWISE_BYTES = 12 + 12 + 8 + 12


@dataclass(frozen=True)
class MuonWork:
    """One rank's Muon work in one optimizer step (one pipeline rank; every rank of it alike)."""

    elements: float  # Muon parameter elements this rank holds (after TP, EP and FSDP): one momentum each
    matrices: int  # matrices this rank's owner groups orthogonalise between them
    ns_flops: float  # Newton-Schulz FLOPs of the busiest rank (bf16)
    ns_flops_mean: float  # ... and of the mean rank: their ratio is the owner assignment's imbalance
    # (kind, ranks in the owner group, bytes the busiest rank receives (= sends) in the gathers to
    # the owners and the scatters back), per kind of MUON_KINDS with more than one owner rank.
    traffic: Tuple[Tuple[str, int, float], ...]
    # Newton-Schulz FLOPs of the busiest rank per matrix shape's efficiency: (rows, cols, FLOPs).
    ns_by_shape: Tuple[Tuple[int, int, float], ...]

    @property
    def imbalance(self) -> float:
        return self.ns_flops / self.ns_flops_mean if self.ns_flops_mean else 1.0


@lru_cache(maxsize=4096)
def muon_work(entries: Tuple[Tuple[int, int, str, int, int, int], ...], blocks: Tuple[int, ...], tp: int, ep: int,
              fsdp: int, expert_fsdp: int, ns_steps: int) -> MuonWork:
    """The Muon work of one rank of a pipeline rank holding `blocks` (block indices, with
    WITH_EMBEDDING / WITH_OUTPUT for its tables: launcher/plan/decide/optim_groups.py), from the
    layout's `muon_matrices` rows. A matrix's owners are the ranks that shard it, as the engine
    chooses them (launcher/engines/muon.py `_GatherPlan`): fsdp x tp ranks for a TP-split matrix,
    fsdp for one TP leaves whole, expert_fsdp for a routed expert's (EP keeps each expert whole on
    its rank, which holds E/ep of them); one assignment per owner-group size, carried over the
    parameters in order, as the engine does. Gathering a matrix of M bytes to its owner and
    scattering the result back moves M (N-1)/N in and out of the owner and M/N in and out of every
    other rank of the N."""
    where = set(blocks)
    owners_of = {"split": fsdp * tp, "whole": fsdp, "experts": expert_fsdp}
    loads: Dict[int, List[float]] = {}
    recv: Dict[str, List[float]] = {}
    busy: Dict[int, List[Dict[Tuple[int, int], float]]] = {}
    elements, count = 0.0, 0
    for first, last, kind, rows, cols, n in entries:
        hit = sum(1 for b in range(first, last + 1) if b in where)
        if not hit:
            continue
        local_n = n // ep if kind == "experts" else n  # each EP rank's experts
        group = owners_of[kind]
        elements += hit * local_n * rows * cols / group
        cost = ns_flops(rows, cols, ns_steps)
        load = loads.setdefault(group, [0.0] * group)
        shapes = busy.setdefault(group, [dict() for _ in range(group)])
        got = recv.setdefault(kind, [0.0] * group) if group > 1 else None
        m = UPDATE_BYTES * rows * cols
        for _ in range(hit):
            owners = assign_owners([cost] * local_n, group, load)
            count += local_n
            for o in owners:
                shapes[o][(rows, cols)] = shapes[o].get((rows, cols), 0.0) + cost
            if got is not None:
                owned = Counter(owners)
                for r in range(group):
                    mine = owned.get(r, 0)
                    got[r] += mine * m * (group - 1) / group + (local_n - mine) * m / group
    top = sum(max(load) for load in loads.values())
    mean = sum(sum(load) / len(load) for load in loads.values())
    by_shape: Dict[Tuple[int, int], float] = {}
    for group, per_rank in busy.items():
        heaviest = max(range(group), key=lambda r: (loads[group][r], -r))
        for shape, flops in per_rank[heaviest].items():
            by_shape[shape] = by_shape.get(shape, 0.0) + flops
    traffic = tuple((kind, owners_of[kind], max(got)) for kind, got in recv.items())
    return MuonWork(elements, count, top, mean, traffic,
                    tuple((r, c, f) for (r, c), f in sorted(by_shape.items())))


def stage_muon_work(stage: StageParams, lay: Layout) -> Optional[MuonWork]:
    """`muon_work` of one rank of pipeline rank `stage` under `lay` (None: no Muon matrix, or
    DeepSpeed owns the states: optim=muon is refused there before launch)."""
    entries = lay.numerics.muon_matrices
    if not entries or lay.owners.sharding_backend != "native":
        return None
    blocks = tuple(stage.layers) + ((WITH_EMBEDDING,) if stage.has_embedding else ()) + ((WITH_OUTPUT,) if stage.has_output else ())
    return muon_work(entries, blocks, lay.mesh.tp, lay.mesh.ep, lay.fsdp_degree, lay.expert_fsdp_degree,
                     lay.numerics.muon_ns_steps)
