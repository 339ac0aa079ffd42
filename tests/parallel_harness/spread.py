"""Observed differences per comparison, so each tolerance can be set from a measurement.

Every multi-process comparison (layout vs 1-rank reference, DeepSpeed vs torch) calls
`record_spread` before it asserts: it prints one `[spread]` line (seen with `pytest -s` or
`-rP`) and, when SPREAD_LOG=FILE is set, appends a JSON line with the raw values, so repeated
runs can be compared bit for bit (`python -m tests.parallel_harness.spread FILE` summarises).
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Dict, List, Sequence


def relative(got: float, want: float) -> float:
    """|got - want| / |want| (guarded against a zero reference)."""
    return abs(got - want) / max(abs(want), 1e-12)


def record_spread(what: str, metrics: Dict[str, Sequence[float]], reference: Dict[str, Sequence[float]]) -> Dict[str, float]:
    """Print and log the largest relative difference per metric of one comparison."""
    worst = {k: max((relative(g, w) for g, w in zip(metrics[k], reference[k])), default=0.0) for k in metrics}
    print(f"[spread] {what}: " + "  ".join(f"{k} {v:.2e}" for k, v in worst.items()), flush=True)
    path = os.environ.get("SPREAD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, "worst": worst, "values": {k: list(v) for k, v in metrics.items()}}) + "\n")
    return worst


def record_value(what: str, name: str, value: float) -> None:
    """Print and log one already-reduced difference (e.g. the largest absolute weight difference)."""
    print(f"[spread] {what}: {name} {value:.2e}", flush=True)
    path = os.environ.get("SPREAD_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": f"{what} ({name})", "worst": {name: value}, "values": {name: [value]}}) + "\n")


def summarise(path: str) -> List[str]:
    """Per comparison: runs seen, max relative difference per metric, bitwise identical across runs?"""
    runs: Dict[str, list] = defaultdict(list)
    for line in open(path):
        rec = json.loads(line)
        runs[rec["what"]].append(rec)
    out = []
    for what, recs in sorted(runs.items()):
        worst = {k: max(r["worst"][k] for r in recs) for k in recs[0]["worst"]}
        same = all(r["values"] == recs[0]["values"] for r in recs)
        out.append(f"{what}: runs {len(recs)}  " + "  ".join(f"max {k} {v:.2e}" for k, v in worst.items())
                   + f"  {'bitwise identical across runs' if same else 'VARIES between runs'}")
    return out


if __name__ == "__main__":
    print("\n".join(summarise(sys.argv[1])))
