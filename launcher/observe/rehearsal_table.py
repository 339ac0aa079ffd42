"""The rehearsal's per-rank comparison (rehearsal.json) as a table: rehearsed bytes next to planned.

The rehearsal (launcher/rehearse/) writes rehearsal.json before the launch; the rank's loop
(launcher/runtime/entry.py) shows it in W&B through this table. It lives here, below both, so
the runtime never imports the rehearsal (which runs the runtime's entry for each rank).
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from launcher.plan.degrees import MESH_DIM_NAMES


def rehearsal_table(result: Dict[str, Any]) -> Tuple[List[str], List[List[Any]]]:
    """(columns, rows) of the rehearsed-vs-planned comparison, for W&B's table."""
    cols = ["rank", "coords", "params_numel", "error"]
    for k in ("params", "grads", "optimizer", "activations", "peak"):
        cols += [f"{k}_rehearsed", f"{k}_planned", f"{k}_rel_error"]
    rows = []
    for row in result["ranks"]:
        mem, pred = row["memory"] or {}, row["predicted"]
        coords = ",".join(str(row["coords"][k]) for k in MESH_DIM_NAMES)
        err = row["error"]
        line = [row["rank"], coords, row["params_numel"], f"{err['type']}: {err['message']}" if err else ""]
        for k in ("params", "grads", "optimizer", "activations", "peak"):
            line += [mem.get(k), pred.get(k), pred.get("relative_error", {}).get(k)]
        rows.append(line)
    return cols, rows
