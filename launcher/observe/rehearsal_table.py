"""The rehearsal's per-rank comparison (rehearsal.json) as tables: rehearsed bytes next to the
plan's figure for the same quantity, and every gap over GAP_THRESHOLD with the reason known for it.

The rehearsal (launcher/rehearse/) writes rehearsal.json before the launch; `action=rehearse`
prints it (launcher/rehearse/driver.py, render_rehearsal) and the rank's loop
(launcher/runtime/entry.py) shows it in W&B through `rehearsal_table`. It lives here, below both,
so the runtime never imports the rehearsal (which runs the runtime's entry for each rank).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from launcher.plan.degrees import MESH_DIM_NAMES

CATEGORIES = ("params", "grads", "optimizer", "activations", "peak")

# A rehearsed figure further than this from the plan's, either way, is a gap the table names.
GAP_THRESHOLD = 0.10

# What each column is (the console table prints these lines above the rows).
COLUMN_MEANINGS = (
    "params, grads, optimizer: the states a rank holds through the step (exact when the plan is right)",
    "activations: the largest activation bytes of one fake training step, against the plan's activations_max",
    "peak: every tensor byte at that step's peak, against the plan's peak less what a fake step cannot hold "
    "(the allocator's fragmentation margin; with parallel.accumulate_unsharded, the unsharded parameters "
    "and gradients kept across micro-batches); no CUDA reserve on either side",
)

# Why a category's rehearsed figure can differ from the plan's, as far as we know it
# (docs/rehearsal.md: "Which answer is trusted").
GAP_REASONS = {
    "params": "the built rank holds other state bytes than the plan's formula: trust the rehearsal, and fix the plan",
    "grads": "the built rank holds other state bytes than the plan's formula: trust the rehearsal, and fix the plan",
    "optimizer": "the built rank holds other state bytes than the plan's formula: trust the rehearsal, and fix the plan",
    "activations": "the fake step runs the CPU's kernels (attention, loss, norms), not the GPU's the plan's formula "
                   "describes, and the plan counts the logits, the backward workspace and the recomputed block "
                   "under other; on one GPU the rehearsal's figures are within 0.2 % of the GPU's",
    "peak": "the step's peak follows its activations (the CPU kernels' tensors and the plan's split of them differ, "
            "see activations); the states are compared exactly in their own columns",
}


def planned_figure(predicted: Dict[str, Any], category: str) -> Any:
    """The plan's figure for the quantity the rehearsal measures as `category` (`peak`: the plan's
    peak without what the fake step cannot hold, `peak_comparable`, when the plan has it)."""
    if category == "peak" and "peak_comparable" in predicted:
        return predicted["peak_comparable"]
    return predicted.get(category)


def known_gaps(row: Dict[str, Any], threshold: float = GAP_THRESHOLD) -> List[Tuple[str, float, str]]:
    """(category, relative gap, reason) for each category of a rehearsed rank whose rehearsed
    bytes differ from the plan's comparable figure by more than `threshold` (a fraction)."""
    errors = row["predicted"].get("relative_error", {})
    return [(cat, errors[cat], GAP_REASONS[cat]) for cat in CATEGORIES
            if cat in errors and abs(errors[cat]) > threshold]


def rehearsal_table(result: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    """(columns, rows) of the rehearsed-vs-planned comparison, for W&B's table."""
    cols = ["rank", "coords", "params_numel", "error"]
    for k in CATEGORIES:
        cols += [f"{k}_rehearsed", f"{k}_planned", f"{k}_rel_error"]
    cols.append(f"gaps_over_{GAP_THRESHOLD:.0%}")
    rows = []
    for row in result["ranks"]:
        mem, pred = row["memory"] or {}, row["predicted"]
        coords = ",".join(str(row["coords"][k]) for k in MESH_DIM_NAMES)
        err = row["error"]
        line = [row["rank"], coords, row["params_numel"], f"{err['type']}: {err['message']}" if err else ""]
        for k in CATEGORIES:
            line += [mem.get(k), planned_figure(pred, k), pred.get("relative_error", {}).get(k)]
        line.append("; ".join(f"{cat} {gap:+.0%}: {reason}" for cat, gap, reason in known_gaps(row)) if mem else "")
        rows.append(line)
    return cols, rows
