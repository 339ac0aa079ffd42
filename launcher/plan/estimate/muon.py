"""Muon's costs: Newton-Schulz FLOPs of one matrix and the owner assignment that balances them.

Pure Python: the engine assigns owners with `assign_owners` (launcher/engines/muon.py), the
planner and bench/muon.py price the same work with `ns_flops`, so the prediction and the run
share one formula (docs/optimizers.md, "Distributed Newton-Schulz").
"""

from __future__ import annotations

from typing import List, Sequence, Tuple


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
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(n_ranks), key=lambda r: (loads[r], r))
        owners[i] = r
        loads[r] += costs[i]
    return owners


def owner_loads(costs: Sequence[float], owners: Sequence[int], n_ranks: int) -> Tuple[float, float]:
    """(largest, mean) Newton-Schulz cost per rank of an assignment: its imbalance is their ratio."""
    loads = [0.0] * n_ranks
    for c, o in zip(costs, owners):
        loads[o] += c
    return max(loads), sum(loads) / n_ranks
